"""The engine loop: cancellation, timeouts, priorities, bad input, and blocks always returned."""

import asyncio
import json
import shutil
import time

import pytest

from pagedbatch.engine import AsyncLLM, EngineArgs, LLMEngine, SamplingParams

LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


def make_engine(model_dir, **kwargs) -> LLMEngine:
    return LLMEngine(
        EngineArgs(model=str(model_dir), num_kv_blocks=kwargs.pop("blocks", 128), **kwargs)
    )


def run_to_completion(engine: LLMEngine) -> list[str]:
    """Step until idle; returns request ids in the order they finished."""
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    return order


def assert_pool_whole(engine: LLMEngine):
    stats = engine.get_stats()
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]


def test_abort_frees_blocks_and_reports_abort(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.add_request("a", "one two three", LONG)
    engine.add_request("b", "four five six", LONG)
    for _ in range(3):
        engine.step()
    assert engine.abort_request("a")
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs["a"].finished and outputs["a"].finish_reason == "abort"
    engine.abort_request("b")
    run_to_completion(engine)
    assert_pool_whole(engine)
    assert not engine.abort_request("a")  # already gone


def test_aborting_a_waiting_request_works_too(tiny_llama):
    engine = make_engine(tiny_llama, max_num_seqs=1)
    engine.add_request("running", "a b c", LONG)
    engine.add_request("queued", "d e f", LONG)
    engine.step()
    engine.abort_request("queued")
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs["queued"].finish_reason == "abort"
    assert outputs["queued"].token_ids == []


def test_timeout_aborts_by_the_next_step(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.add_request("slow", "x y z", LONG, timeout=0.05)
    engine.step()
    time.sleep(0.06)
    (output,) = engine.step()
    assert output.finished and output.finish_reason == "abort"
    assert output.error == "request timed out"
    assert_pool_whole(engine)


def test_later_high_priority_request_finishes_first_under_a_full_engine(tiny_llama):
    engine = make_engine(tiny_llama, max_num_seqs=2)
    for i in range(4):
        engine.add_request(f"batch-{i}", f"batch work {i}", LONG, priority=10)
    for _ in range(3):
        engine.step()
    engine.add_request(
        "urgent", "realtime", SamplingParams(max_tokens=20, ignore_eos=True), priority=0
    )
    order = run_to_completion(engine)
    assert order[0] == "urgent"
    assert engine.get_stats()["preemptions"] >= 1
    assert_pool_whole(engine)


def test_the_engine_learns_what_its_steps_cost_and_bounds_batch_steps_by_it(tiny_llama):
    engine = make_engine(tiny_llama, blocks=256, max_num_seqs=16, realtime_target_itl_ms=1000.0)
    assert engine.scheduler.step_cost.cost is None
    # Steps of many sizes: prefills of 1 to 400 tokens beside decodes. The prompts share no
    # prefix, else the prefix cache would leave each prefill a few new tokens, too few for the
    # fit to tell the tokens' cost from the steps' noise.
    short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i in range(40):
        prompt = [1000 + (401 * i + j) % 15_000 for j in range(1 + 37 * i % 400)]
        engine.add_request(f"batch-{i}", prompt, short, priority=10)
        engine.step()
    run_to_completion(engine)
    cost = engine.scheduler.step_cost.cost
    assert cost is not None and cost.per_token > 0
    assert engine.scheduler.realtime_target_seconds == 1.0
    assert_pool_whole(engine)
    # Nothing measured where nothing is sized by the measure.
    assert make_engine(tiny_llama, scheduling_policy="fcfs").scheduler.step_cost is None


def test_prompt_longer_than_the_context_is_refused_clearly(tiny_llama):
    engine = make_engine(tiny_llama, max_model_len=64)
    with pytest.raises(ValueError, match="maximum context length is 64"):
        engine.add_request("long", list(range(10, 80)), SamplingParams())
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("long", list(range(10, 50)), SamplingParams(max_tokens=40))
    # Nothing else disturbed: the engine still serves.
    engine.add_request("ok", "fine", SamplingParams(max_tokens=4, ignore_eos=True))
    assert run_to_completion(engine) == ["ok"]


def test_a_kv_cache_too_small_for_max_model_len_is_a_start_up_error(tiny_llama):
    with pytest.raises(
        ValueError, match=r"max_model_len 100 .* holds 64 tokens \(4 blocks of 16\)"
    ):
        make_engine(tiny_llama, blocks=4, max_model_len=100)
    # Unset, the context is the model's as far as the KV cache holds it.
    assert make_engine(tiny_llama, blocks=4).max_model_len == 64
    assert make_engine(tiny_llama, blocks=4096).max_model_len == 2048  # the model's own


def test_bad_token_ids_and_duplicate_ids_are_refused(tiny_llama):
    engine = make_engine(tiny_llama)
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("x", [1, 10**9], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("x", [], SamplingParams())
    engine.add_request("x", "hi", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", "hi", SamplingParams())


def test_unknown_architecture_names_itself(tiny_llama, tmp_path):
    model_dir = tmp_path / "odd"
    shutil.copytree(tiny_llama, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["FooForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FooForCausalLM"):
        make_engine(model_dir)


def test_broken_checkpoint_is_reported(tiny_llama, tmp_path):
    model_dir = tmp_path / "broken"
    shutil.copytree(tiny_llama, model_dir)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        make_engine(model_dir)


def test_missing_config_is_reported(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        make_engine(tmp_path)


def test_failing_logits_processor_fails_only_its_request(tiny_llama):
    def explode(_ids, _row):
        raise RuntimeError("boom")

    engine = make_engine(tiny_llama)
    engine.add_request("bad", "a", SamplingParams(max_tokens=5, logits_processors=[explode]))
    engine.add_request("good", "b", SamplingParams(max_tokens=5, ignore_eos=True))
    results = {}
    while engine.has_unfinished_requests():
        results.update({o.request_id: o for o in engine.step() if o.finished})
    assert results["bad"].finish_reason == "error" and "boom" in results["bad"].error
    assert results["good"].finish_reason == "length" and len(results["good"].token_ids) == 5
    assert_pool_whole(engine)


def test_async_stream_grows_and_matches_offline(tiny_llama):
    async def main():
        llm = AsyncLLM(tiny_llama, num_kv_blocks=128)
        try:
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
            texts, last = [], None
            async for out in llm.generate("stream me", params):
                texts.append(out.text)
                last = out
            assert last.finished and len(last.token_ids) == 12
            assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
            return last
        finally:
            llm.shutdown()

    streamed = asyncio.run(main())
    engine = make_engine(tiny_llama)
    engine.add_request(
        "x", "stream me", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    final = None
    while engine.has_unfinished_requests():
        final = engine.step()[-1]
    assert final.token_ids == streamed.token_ids and final.text == streamed.text


def test_async_final_only_yields_just_the_finished_output(tiny_llama):
    async def main():
        llm = AsyncLLM(tiny_llama, num_kv_blocks=128)
        try:
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
            finals = [out async for out in llm.generate("stream me", params, final_only=True)]
            streamed = [out async for out in llm.generate("stream me", params)]
            return finals, streamed
        finally:
            llm.shutdown()

    finals, streamed = asyncio.run(main())
    assert len(streamed) > 1 and len(finals) == 1 and finals[0].finished
    assert finals[0].token_ids == streamed[-1].token_ids and finals[0].text == streamed[-1].text


def test_async_client_leaving_early_aborts_and_frees_blocks(tiny_llama):
    async def main():
        llm = AsyncLLM(tiny_llama, num_kv_blocks=128)
        try:
            stream = llm.generate("walk away", LONG)
            async for out in stream:
                if len(out.token_ids) >= 3:
                    break
            await stream.aclose()
            for _ in range(100):
                stats = await llm.get_stats()
                if stats["running"] == 0 and stats["free_kv_blocks"] == stats["total_kv_blocks"]:
                    return stats
                await asyncio.sleep(0.02)
            raise AssertionError(f"blocks not returned: {stats}")
        finally:
            llm.shutdown()

    asyncio.run(main())


def test_async_bad_request_raises_before_streaming(tiny_llama):
    async def main():
        llm = AsyncLLM(tiny_llama, num_kv_blocks=128, max_model_len=32)
        try:
            with pytest.raises(ValueError, match="context length"):
                async for _ in llm.generate(list(range(10, 60)), SamplingParams()):
                    pass
        finally:
            llm.shutdown()

    asyncio.run(main())


def test_penalised_requests_count_their_own_tokens_whatever_ran_before(tiny_llama):
    penalised = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=2.0, repetition_penalty=1.5
    )

    def generate(engine: LLMEngine, prompts: dict[str, str]) -> dict[str, list[int]]:
        for request_id, prompt in prompts.items():
            engine.add_request(request_id, prompt, penalised)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        return done

    engine = make_engine(tiny_llama)
    first = generate(engine, {"p": "one two", "q": "three four five"})
    # The same ids again, prompts swapped: each gets what a fresh engine gives its prompt.
    again = generate(engine, {"p": "three four five", "q": "one two"})
    fresh = generate(make_engine(tiny_llama), {"x": "three four five"})
    assert again == {"p": first["q"], "q": first["p"]}
    assert again["p"] == fresh["x"]
    assert_pool_whole(engine)
