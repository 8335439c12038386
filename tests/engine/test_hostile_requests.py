"""Requests built to hurt the engine: each must end alone (or be refused), never the engine."""

import asyncio
import threading
from dataclasses import replace

import pytest

from pagedbatch.engine import AsyncLLM, EngineArgs, LLMEngine, SamplingParams
from pagedbatch.engine.sampling_params import MAX_LOGIT_BIAS

SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
PROMPT = list(range(100, 140))  # 40 tokens: two full 16-token blocks to cache


def make_engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(model_dir), num_kv_blocks=128))


def finals(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


async def final_output(llm: AsyncLLM, prompt, params: SamplingParams, **kwargs):
    last = None
    async for output in llm.generate(prompt, params, **kwargs):
        last = output
    return last


def test_a_top_k_and_a_seed_beyond_any_integer_type_are_served(tiny_llama):
    engine = make_engine(tiny_llama)
    for i, top_p in enumerate([1.0, 0.9]):
        huge = SamplingParams(top_k=2**63, top_p=top_p, seed=-(2**200), max_tokens=3)
        engine.add_request(f"huge-{i}", "a b", huge)
    engine.add_request("plain", "c d", SHORT)
    done = finals(engine)
    assert all(output.error is None and len(output.token_ids) >= 1 for output in done.values())


def test_token_ids_outside_the_vocabulary_are_refused_by_name(tiny_llama):
    engine = make_engine(tiny_llama)
    for bad in (-1, 10**23, engine.model_config.vocab_size):
        with pytest.raises(ValueError, match=f"logit_bias .* {bad}"):
            engine.add_request("x", "hi", SamplingParams(logit_bias={bad: 1.0}))
    with pytest.raises(ValueError, match="stop_token_ids holds token id 1000000000"):
        engine.add_request("x", "hi", SamplingParams(stop_token_ids=[10**9], min_tokens=2))
    engine.add_request("x", "hi", SHORT)  # nothing was left behind under the id
    assert finals(engine)["x"].finish_reason == "length"


def test_logit_bias_forces_and_bans_tokens(tiny_llama):
    engine = make_engine(tiny_llama)
    forced = SamplingParams(max_tokens=5, ignore_eos=True, logit_bias={777: 100.0})
    engine.add_request("forced", "a b c", forced)
    plain = dict(temperature=0, max_tokens=5, ignore_eos=True)
    engine.add_request("plain", "a b c", SamplingParams(**plain))
    done = finals(engine)
    first = done["plain"].token_ids[0]
    engine.add_request("banned", "a b c", SamplingParams(**plain, logit_bias={first: -100.0}))
    banned = finals(engine)["banned"]
    assert done["forced"].token_ids == [777] * 5
    assert banned.token_ids[0] != first


def test_logit_bias_may_name_as_many_tokens_as_allowed(tiny_llama):
    engine = make_engine(tiny_llama)
    bias = {token: -100.0 for token in range(MAX_LOGIT_BIAS)}
    engine.add_request("wide", "a b c", replace(SHORT, logit_bias=bias))
    output = finals(engine)["wide"]
    assert output.finish_reason == "length"
    assert all(token >= MAX_LOGIT_BIAS for token in output.token_ids)


def test_prefix_cache_is_shared_only_under_the_same_salt(tiny_llama):
    engine = make_engine(tiny_llama)

    def cached(request_id: str, salt: str | None) -> int:
        engine.add_request(request_id, PROMPT, SHORT, cache_salt=salt)
        return finals(engine)[request_id].num_cached_tokens

    assert cached("alice-1", "alice") == 0
    assert cached("bob-1", "bob") == 0  # the same prompt, another tenant: nothing to learn
    assert cached("none-1", None) == 0
    assert cached("alice-2", "alice") == 32
    assert cached("bob-2", "bob") == 32
    assert cached("none-2", None) == 32
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request("empty", PROMPT, SHORT, cache_salt="")


def test_a_failing_request_ends_alone_and_the_async_engine_serves_on(tiny_llama):
    def explode(_ids, _row):
        raise RuntimeError("boom")

    async def main():
        llm = AsyncLLM(tiny_llama, num_kv_blocks=128)
        try:
            bad = SamplingParams(max_tokens=5, logits_processors=[explode])
            outputs = await asyncio.gather(
                final_output(llm, "a b", SHORT),
                final_output(llm, "c d", bad),
                final_output(llm, "e f", SHORT),
            )
            later = await final_output(llm, "g h", SHORT)
            return outputs, later, llm.dead_error
        finally:
            llm.shutdown()

    (good, bad, other), later, dead = asyncio.run(main())
    assert bad.finish_reason == "error" and "boom" in bad.error
    assert good.finish_reason == other.finish_reason == later.finish_reason == "length"
    assert dead is None


def test_a_caller_whose_loop_closed_before_admission_leaves_the_engine_running(tiny_llama):
    # The engine thread is held inside a step (by a logits processor) while a caller asks for
    # admission and then ends its event loop: the admission is answered into a closed loop.
    entered, release = threading.Event(), threading.Event()

    def hold(_ids, row):
        entered.set()
        release.wait(30)
        return row

    llm = AsyncLLM(tiny_llama, num_kv_blocks=128)
    held = []
    holder = threading.Thread(
        target=lambda: held.append(
            asyncio.run(
                final_output(llm, "a b", SamplingParams(max_tokens=3, logits_processors=[hold]))
            )
        )
    )
    try:
        holder.start()
        assert entered.wait(30)

        async def ask_and_leave():
            stream = llm.generate("c d", LONG, request_id="gone")
            asyncio.create_task(anext(stream))  # noqa: RUF006 - left pending on purpose
            await asyncio.sleep(0)  # the admission is queued

        asyncio.run(ask_and_leave())
        release.set()
        holder.join(30)
        later = asyncio.run(final_output(llm, "e f", SHORT))
        stats = asyncio.run(llm.get_stats())
    finally:
        release.set()
        llm.shutdown()
    assert llm.dead_error is None
    assert held[0].finish_reason == "length" and later.finish_reason == "length"
    assert stats["running"] == stats["waiting"] == 0  # the abandoned request was aborted


@pytest.mark.parametrize("final_only", [False, True])
def test_abort_ends_the_stream_another_task_reads(tiny_llama, final_only):
    async def main():
        llm = AsyncLLM(tiny_llama, num_kv_blocks=128)
        try:
            outputs = []

            async def read():
                async for output in llm.generate(
                    "abort me", LONG, request_id="victim", final_only=final_only
                ):
                    outputs.append(output)

            reader = asyncio.create_task(read())
            while (await llm.get_stats())["running"] == 0:
                await asyncio.sleep(0.01)
            llm.abort("victim")
            await asyncio.wait_for(reader, 20)
            later = await final_output(llm, "next", SHORT)
            return outputs, later, await llm.get_stats()
        finally:
            llm.shutdown()

    outputs, later, stats = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
    assert len(outputs[-1].token_ids) < LONG.max_tokens
    assert later.finish_reason == "length"
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]
