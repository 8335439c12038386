"""What the engine hands back per `RequestOutputKind`: everything so far, only what is new, or
one final output; the same completions whichever is asked."""

import asyncio
from dataclasses import replace

import pytest

from pagedbatch.engine import (
    LLM,
    AsyncLLM,
    EngineArgs,
    LLMEngine,
    RequestOutputKind,
    SamplingParams,
)

CUMULATIVE, DELTA, FINAL_ONLY = (
    RequestOutputKind.CUMULATIVE,
    RequestOutputKind.DELTA,
    RequestOutputKind.FINAL_ONLY,
)
# Sampled (seeded, so every kind gets the same completions), with logprobs and stop strings: the
# completions end on "e" at different steps, and "nx" holds back an "n" for a step.
PARAMS = SamplingParams(n=2, seed=7, max_tokens=24, logprobs=2, stop=["e", "nx"], ignore_eos=True)
PROMPT = "Once upon a time"


def run(model_dir, kind: RequestOutputKind) -> list:
    """Every output of one request, in order."""
    engine = LLMEngine(EngineArgs(model=str(model_dir), num_kv_blocks=64))
    engine.add_request("x", PROMPT, replace(PARAMS, output_kind=kind))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def joined(deltas: list) -> dict[int, dict]:
    """Each completion's deltas put together."""
    completions: dict[int, dict] = {}
    for output in deltas:
        for c in output.outputs:
            whole = completions.setdefault(c.index, {"text": "", "token_ids": [], "logprobs": []})
            whole["text"] += c.text
            whole["token_ids"] += c.token_ids
            whole["logprobs"] += c.logprobs
            whole["finish_reason"] = c.finish_reason
    return completions


def as_dicts(output) -> dict[int, dict]:
    return {
        c.index: {
            "text": c.text,
            "token_ids": c.token_ids,
            "logprobs": c.logprobs,
            "finish_reason": c.finish_reason,
        }
        for c in output.outputs
    }


def test_cumulative_outputs_grow_and_end_with_everything(tiny_llama):
    outputs = run(tiny_llama, CUMULATIVE)
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    for before, after in zip(outputs, outputs[1:], strict=False):
        for b, a in zip(before.outputs, after.outputs, strict=True):
            assert a.text.startswith(b.text) and a.token_ids[: len(b.token_ids)] == b.token_ids
    assert all(len(o.outputs) == 2 for o in outputs)


def test_deltas_add_up_to_the_cumulative_output(tiny_llama):
    final = run(tiny_llama, CUMULATIVE)[-1]
    deltas = run(tiny_llama, DELTA)
    assert deltas[-1].finished and not any(o.finished for o in deltas[:-1])
    assert joined(deltas) == as_dicts(final)
    # Each delta holds only the completions that moved, each with something new in it.
    for output in deltas:
        assert output.outputs
        for c in output.outputs:
            assert c.token_ids or c.text or c.finish_reason is not None
            assert len(c.logprobs) == len(c.token_ids)
    # A completion's finish reason comes once, in its last delta.
    for index in (0, 1):
        reasons = [c.finish_reason for o in deltas for c in o.outputs if c.index == index]
        assert reasons[-1] is not None and reasons[:-1] == [None] * (len(reasons) - 1)


def test_deltas_folded_into_one_equal_the_cumulative_output(tiny_llama):
    # What a caller that fell behind gets: the deltas it missed, as one.
    final = run(tiny_llama, CUMULATIVE)[-1]
    first, *later = run(tiny_llama, DELTA)
    for delta in later:
        first.add(delta)
    assert first.finished and as_dicts(first) == as_dicts(final)
    assert [c.index for c in first.outputs] == [0, 1]


def test_final_only_gives_one_output_equal_to_the_last_cumulative(tiny_llama):
    final = run(tiny_llama, CUMULATIVE)[-1]
    (only,) = run(tiny_llama, FINAL_ONLY)
    assert only.finished and as_dicts(only) == as_dicts(final)
    assert only.prompt_token_ids == final.prompt_token_ids


def test_an_aborted_delta_request_ends_with_an_empty_finished_delta(tiny_llama):
    engine = LLMEngine(EngineArgs(model=str(tiny_llama), num_kv_blocks=64))
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, output_kind=DELTA)
    engine.add_request("x", PROMPT, params)
    engine.step()
    engine.step()
    engine.abort_request("x")
    (last,) = engine.step()
    assert last.finished and last.finish_reason == "abort"
    assert last.token_ids == [] and last.text == ""
    assert not engine.has_unfinished_requests()


def test_a_final_only_request_waiting_or_running_hands_back_nothing(tiny_llama):
    engine = LLMEngine(EngineArgs(model=str(tiny_llama), num_kv_blocks=64, max_num_seqs=1))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, output_kind=FINAL_ONLY)
    engine.add_request("first", PROMPT, params)
    engine.add_request("second", PROMPT, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [(o.request_id, o.finished, len(o.token_ids)) for o in outputs] == [
        ("first", True, 5),
        ("second", True, 5),
    ]


def test_offline_generation_returns_whole_outputs_whatever_the_kind(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=64)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (cumulative,) = llm.generate([PROMPT], greedy)
    (delta,) = llm.generate([PROMPT], replace(greedy, output_kind=DELTA))
    assert delta.token_ids == cumulative.token_ids and len(delta.token_ids) == 8
    assert delta.text == cumulative.text


def test_an_async_delta_stream_adds_up_to_the_final_text(tiny_llama):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def main():
        llm = AsyncLLM(tiny_llama, num_kv_blocks=64)
        try:
            deltas = [o async for o in llm.generate(PROMPT, replace(greedy, output_kind=DELTA))]
            whole = [o async for o in llm.generate(PROMPT, greedy)]
            return deltas, whole[-1]
        finally:
            llm.shutdown()

    deltas, final = asyncio.run(main())
    assert len(deltas) > 1 and deltas[-1].finished
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids


def test_output_kind_must_be_a_request_output_kind():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")
