"""Beam search over the engine equals transformers' float32 `num_beams` generate: the same beams,
best first, with the same scores, also where beams end on end tokens."""

import asyncio
import json
import shutil

import pytest
import torch
from greedy_checks import assert_pool_whole, random_prompts
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from pagedbatch.engine import LLM, AsyncLLM
from pagedbatch.engine.beam_search import BeamSearch, BeamSearchParams, beam_search
from pagedbatch.engine.core.request import TokenLogprob


@torch.inference_mode()
def hf_beams(model_dir, prompt, width, max_tokens, length_penalty, eos=None, **options):
    """transformers' beams after the prompt, best first (cut after an end token, where the
    padding starts), and their scores."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        num_beams=width,
        num_return_sequences=width,
        max_new_tokens=max_tokens,
        do_sample=False,
        length_penalty=length_penalty,
        eos_token_id=eos,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
        **options,
    )
    beams = []
    for sequence in out.sequences[:, len(prompt) :].tolist():
        ends = [i for i, token in enumerate(sequence) if token in (eos or [])]
        beams.append(sequence[: ends[0] + 1] if ends else sequence)
    return beams, out.sequences_scores.tolist()


@pytest.mark.parametrize("width, length_penalty", [(2, 1.0), (4, 0.5)])
def test_beams_equal_transformers_num_beams(tiny_llama, width, length_penalty):
    llm = LLM(tiny_llama, num_kv_blocks=128)
    prompts = random_prompts(2, 6, 20, seed=31)
    params = BeamSearchParams(
        beam_width=width, max_tokens=8, ignore_eos=True, length_penalty=length_penalty
    )
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens, scores = hf_beams(tiny_llama, prompt, width, 8, length_penalty, early_stopping=True)
        assert [beam.tokens[len(prompt) :] for beam in output.sequences] == tokens
        for beam, score in zip(output.sequences, scores, strict=True):
            assert beam.tokens[: len(prompt)] == prompt and beam.finish_reason == "length"
            assert abs(beam.cum_logprob / 8**length_penalty - score) < 1e-4
            assert len(beam.logprobs) == 8
            generated = beam.tokens[len(prompt) :]
            assert beam.text == llm.tokenizer.decode(generated, skip_special_tokens=True)
    assert_pool_whole(llm)


# How much the end token's row of the LM head is scaled: its logit then spreads 8 times wider,
# so that it is among the likeliest tokens after some prefixes (a random model's end tokens are
# about as likely as any of its 16,384 tokens, and its beams never end).
END_BOOST = 8.0


@pytest.fixture(scope="module")
def ending_llama(tiny_llama, tmp_path_factory):
    """tiny_llama with its first end token (generation_config.json's) made likely at times."""
    model_dir = tmp_path_factory.mktemp("ending") / "llama"
    shutil.copytree(tiny_llama, model_dir)
    end = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"][0]
    weights = load_file(model_dir / "model.safetensors")
    weights["lm_head.weight"][end] *= END_BOOST
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    return model_dir


@pytest.mark.parametrize("width, length_penalty", [(3, 1.0), (2, 0.5), (4, 2.0)])
def test_beams_that_end_on_end_tokens_equal_transformers(ending_llama, width, length_penalty):
    """transformers' rules with end tokens on: of each step's likeliest extensions only the
    first `width` may finish, the `width` best finished are kept (scored with the length
    penalty, the end token counted), and the search stops once no live beam can beat them."""
    llm = LLM(ending_llama, num_kv_blocks=256)
    eos = sorted(llm.engine.eos_token_ids)
    prompts = random_prompts(4, 6, 12, seed=41)
    params = BeamSearchParams(beam_width=width, max_tokens=8, length_penalty=length_penalty)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    ended = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens, scores = hf_beams(ending_llama, prompt, width, 8, length_penalty, eos)
        assert [beam.tokens[len(prompt) :] for beam in output.sequences] == tokens
        for beam, score in zip(output.sequences, scores, strict=True):
            generated = beam.tokens[len(prompt) :]
            assert abs(beam.cum_logprob / len(generated) ** length_penalty - score) < 1e-4
            assert len(beam.logprobs) == len(generated)
            stopped = generated[-1] in eos
            ended += stopped
            assert beam.finish_reason == ("stop" if stopped else "length")
            text = generated[:-1] if stopped else generated
            assert beam.text == llm.tokenizer.decode(text, skip_special_tokens=True)
    assert ended > 0  # the end token was chosen, and kept
    assert_pool_whole(llm)


@pytest.mark.parametrize("ends", [False, True])
def test_the_async_search_gives_the_same_beams_as_one_output(request, ends):
    """The serving path's search (over AsyncLLM, as the doors run it) finds LLM.beam_search's
    beams, also where they end on end tokens."""
    model_dir = request.getfixturevalue("ending_llama" if ends else "tiny_llama")
    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=not ends)
    offline = LLM(model_dir, num_kv_blocks=128)
    prompts = random_prompts(4, 6, 12, seed=41) if ends else random_prompts(1, 8, 8, seed=32)
    found = offline.beam_search(prompts, params)
    # Where end tokens are on, a prompt some of whose best beams end.
    prompt, expected = next(
        (p, e) for p, e in zip(prompts, found, strict=True) if not ends or "stop" in reasons(e)
    )

    async def main():
        llm = AsyncLLM(model_dir, num_kv_blocks=128)
        try:
            return [output async for output in beam_search(llm, prompt, params, "b", logprobs=2)]
        finally:
            llm.shutdown()

    (output,) = asyncio.run(main())
    assert output.finished and output.prompt_token_ids == prompt
    beams = [beam.tokens[len(prompt) :] for beam in expected.sequences]
    assert [completion.token_ids for completion in output.outputs] == beams
    assert [completion.text for completion in output.outputs] == [
        beam.text for beam in expected.sequences
    ]
    assert [completion.finish_reason for completion in output.outputs] == reasons(expected)
    for completion in output.outputs:
        assert [lp.token_id for lp in completion.logprobs] == completion.token_ids
        assert all(len(lp.top) == 2 for lp in completion.logprobs)


def reasons(output) -> list[str]:
    return [beam.finish_reason for beam in output.sequences]


def step(*top: tuple[int, float]) -> TokenLogprob:
    """A beam's step: its top (token, logprob) pairs, likeliest first."""
    return TokenLogprob(top[0][0], top[0][1], 1, list(top))


def test_only_a_steps_first_width_extensions_may_finish():
    """An end token outside the step's `width` likeliest extensions is dropped (it was there to
    keep `width` beams going), and at `max_tokens` the likeliest extensions finish by length."""
    params = BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=1.0)
    search = BeamSearch([1], params, eos_token_ids={0})
    search.advance([step((5, -0.1), (6, -0.2), (0, -0.3), (7, -2.0))])
    assert [beam.tokens for beam in search.live] == [[1, 5], [1, 6]] and not search.complete
    search.advance([step((8, -1.0), (9, -1.1), (3, -3.0)), step((8, -1.2), (9, -1.3))])
    assert search.done and not search.live
    output = search.output(lambda ids: " ".join(map(str, ids)))
    assert [beam.tokens for beam in output.sequences] == [[1, 5, 8], [1, 5, 9]]
    assert [beam.finish_reason for beam in output.sequences] == ["length", "length"]
    assert [beam.text for beam in output.sequences] == ["5 8", "5 9"]


def test_the_search_goes_on_while_a_live_beam_may_beat_the_finished():
    """transformers' default early stop: `width` finished beams end the search only once the
    best live beam, scored at its present length, is no better than the worst of them."""
    params = BeamSearchParams(beam_width=2, max_tokens=10, length_penalty=1.0)
    search = BeamSearch([1], params, eos_token_ids={0})
    search.advance([step((5, -0.5), (0, -0.6), (6, -0.7))])
    assert [beam.tokens for beam in search.complete] == [[1, 0]]
    search.advance([step((0, -0.1), (7, -0.2)), step((0, -0.05), (8, -2.0))])
    # [1, 6, 0] (-0.75) was third: dropped. Two finished: -0.3 ([1, 5, 0]) and -0.6 ([1, 0]);
    # [1, 5, 7] at -0.7 / 2 = -0.35 may still beat -0.6.
    assert [beam.tokens for beam in search.complete] == [[1, 5, 0], [1, 0]]
    assert [beam.tokens for beam in search.live] == [[1, 5, 7], [1, 6, 8]] and not search.done
    search.advance([step((0, -0.05), (9, -1.0)), step((0, -0.1), (4, -3.0))])
    # [1, 5, 7, 0] scores -0.75 / 3 = -0.25; the best live, -1.7 / 3, cannot beat -0.3.
    assert search.done
    output = search.output(lambda ids: " ".join(map(str, ids)))
    assert [beam.tokens for beam in output.sequences] == [[1, 5, 7, 0], [1, 5, 0]]
    assert [beam.text for beam in output.sequences] == ["5 7", "5"]
    assert [beam.finish_reason for beam in output.sequences] == ["stop", "stop"]
    assert [search.score(beam) for beam in output.sequences] == pytest.approx([-0.25, -0.3])


@pytest.mark.parametrize(
    "bad",
    [
        {"beam_width": 0, "max_tokens": 4},
        {"beam_width": 11, "max_tokens": 4},
        {"beam_width": 2, "max_tokens": 0},
        {"beam_width": 2, "max_tokens": 4, "length_penalty": 11.0},
    ],
)
def test_params_are_bounded(bad):
    with pytest.raises(ValueError):
        BeamSearchParams(**bad)
