"""Beam search over the engine equals transformers' float32 `num_beams` generate: the same beams,
best first, with the same scores."""

import asyncio

import pytest
import torch
from greedy_checks import assert_pool_whole, random_prompts
from transformers import AutoModelForCausalLM

from pagedbatch.engine import LLM, AsyncLLM
from pagedbatch.engine.beam_search import BeamSearch, BeamSearchParams, beam_search
from pagedbatch.engine.core.request import TokenLogprob


@torch.inference_mode()
def hf_beams(model_dir, prompt, width, max_tokens, length_penalty):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        num_beams=width,
        num_return_sequences=width,
        max_new_tokens=max_tokens,
        do_sample=False,
        early_stopping=True,
        length_penalty=length_penalty,
        eos_token_id=None,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    return out.sequences[:, len(prompt) :].tolist(), out.sequences_scores.tolist()


@pytest.mark.parametrize("width, length_penalty", [(2, 1.0), (4, 0.5)])
def test_beams_equal_transformers_num_beams(tiny_llama, width, length_penalty):
    llm = LLM(tiny_llama, num_kv_blocks=128)
    prompts = random_prompts(2, 6, 20, seed=31)
    params = BeamSearchParams(
        beam_width=width, max_tokens=8, ignore_eos=True, length_penalty=length_penalty
    )
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens, scores = hf_beams(tiny_llama, prompt, width, 8, length_penalty)
        assert [beam.tokens[len(prompt) :] for beam in output.sequences] == tokens
        for beam, score in zip(output.sequences, scores, strict=True):
            assert beam.tokens[: len(prompt)] == prompt and beam.finish_reason == "length"
            assert abs(beam.cum_logprob / 8**length_penalty - score) < 1e-4
            assert len(beam.logprobs) == 8
            generated = beam.tokens[len(prompt) :]
            assert beam.text == llm.tokenizer.decode(generated, skip_special_tokens=True)
    assert_pool_whole(llm)


def test_the_async_search_gives_the_same_beams_as_one_output(tiny_llama):
    prompt = random_prompts(1, 8, 8, seed=32)[0]
    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
    (expected,) = LLM(tiny_llama, num_kv_blocks=128).beam_search([prompt], params)

    async def main():
        llm = AsyncLLM(tiny_llama, num_kv_blocks=128)
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
    for completion in output.outputs:
        assert completion.finish_reason == "length"
        assert [lp.token_id for lp in completion.logprobs] == completion.token_ids
        assert all(len(lp.top) == 2 for lp in completion.logprobs)


def test_an_end_token_completes_a_beam_and_width_complete_beams_end_the_search():
    params = BeamSearchParams(beam_width=2, max_tokens=10, length_penalty=1.0)
    search = BeamSearch([1, 2], params, eos_token_ids={0})
    search.advance([TokenLogprob(0, -0.1, 1, [(0, -0.1), (5, -0.5), (6, -1.0), (7, -2.0)])])
    assert [beam.tokens for beam in search.live] == [[1, 2, 5], [1, 2, 6]]
    assert [beam.tokens for beam in search.complete] == [[1, 2, 0]] and not search.done
    search.advance(
        [
            TokenLogprob(0, -0.2, 1, [(0, -0.2), (8, -3.0), (9, -3.5), (3, -4.0)]),
            TokenLogprob(4, -0.3, 1, [(4, -0.3), (0, -0.4), (9, -3.0), (3, -4.0)]),
        ]
    )
    assert search.done  # two beams complete
    output = search.output(lambda ids: " ".join(map(str, ids)))
    # Cumulative logprob over generated length, the end token counted: -0.1 / 1, -0.7 / 2.
    assert [beam.tokens for beam in output.sequences] == [[1, 2, 0], [1, 2, 5, 0]]
    assert [beam.text for beam in output.sequences] == ["", "5"]
    assert [beam.finish_reason for beam in output.sequences] == ["stop", "stop"]


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
