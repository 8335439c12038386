"""Embedding models, continuously batched: a random BERT in sentence-transformers' layout gives
sentence-transformers' own vectors; a decoder with last-token or mean pooling gives the pooled
hidden states transformers computes; requests are prefill-only, hold no KV blocks once their
step is done, and obey max_num_seqs, max_num_batched_tokens, priorities and aborts."""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers import SentenceTransformer
from transformers import AutoModel

from pagedbatch.engine import (
    LLM,
    AsyncLLM,
    EngineArgs,
    LLMEngine,
    PoolingParams,
    RequestOutputKind,
    SamplingParams,
)

WORDS = "the sea sky a river runs under old stone bridges while birds sing of summer rain"
WORDS = WORDS.split()
# Mixed lengths, from one word to a couple of hundred tokens.
TEXTS = [" ".join(WORDS[(i * 7) % len(WORDS) :] + WORDS * (i % 5) * (i % 3)) for i in range(24)]
TEXTS += ["x", "Hello, world!", "naïve café — 東京 🌊"]
# Float32 arithmetic, for equality with transformers to 1e-4: `auto` takes bfloat16 matmuls for
# embedding models on CPUs with AMX, which stay within cosine 0.9999 only (tested below).
EXACT = {"matmul_precision": "highest"}


@pytest.fixture(scope="module")
def bert(make_checkpoint) -> Path:
    return make_checkpoint("bert")


@pytest.fixture(scope="module")
def bert_llm(bert) -> LLM:
    return LLM(bert, **EXACT)


@pytest.fixture(scope="module")
def decoder(make_checkpoint) -> Path:
    return make_checkpoint("llama", task="embed")


@pytest.fixture(scope="module")
def decoder_llm(decoder) -> LLM:
    # Small steps: long prompts are prefilled in chunks, their pooling spread over steps.
    return LLM(decoder, num_kv_blocks=64, max_num_batched_tokens=32, **EXACT)


@pytest.fixture(scope="module")
def mean_decoder(decoder, tmp_path_factory) -> Path:
    """The decoder, its sentence-transformers pooling switched to the mean of all tokens."""
    out = tmp_path_factory.mktemp("mean-decoder") / "model"
    shutil.copytree(decoder, out)
    pooling = out / "1_Pooling" / "config.json"
    config = json.loads(pooling.read_text())
    config |= {"pooling_mode_lasttoken": False, "pooling_mode_mean_tokens": True}
    pooling.write_text(json.dumps(config))
    return out


def engine_for(path: Path, **args) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(path), **args))


def vectors(outputs) -> torch.Tensor:
    return torch.stack([output.embedding for output in outputs])


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    cosine = F.cosine_similarity(got, want, dim=-1)
    assert cosine.min() >= 0.9999, cosine
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_bert_equals_sentence_transformers(bert, bert_llm):
    want = SentenceTransformer(str(bert), device="cpu").encode(
        TEXTS, normalize_embeddings=True, convert_to_tensor=True
    )
    outputs = bert_llm.embed(TEXTS)
    got = vectors(outputs)
    assert got.dtype == torch.float32 and got.shape == (len(TEXTS), 128)
    assert_close(got, want)
    # Another text's vector lies far outside the tolerance.
    assert (want[0] - want[1:]).abs().amax(dim=-1).min() > 1e-2
    tokenizer = bert_llm.tokenizer
    first = outputs[0]
    assert first.prompt_token_ids[0] == tokenizer.cls_token_id
    assert first.prompt_token_ids[-1] == tokenizer.sep_token_id
    assert first.finished and first.outputs == [] and first.error is None


@pytest.mark.parametrize("model", ["bert", "mean_decoder"])
def test_bfloat16_matmuls_stay_within_cosine_0_9999_of_sentence_transformers(model, request):
    path = request.getfixturevalue(model)
    llm = LLM(path, num_kv_blocks=64, matmul_precision="bfloat16")
    assert llm.engine.runner.matmul_precision == "bfloat16"
    want = SentenceTransformer(str(path), device="cpu").encode(
        TEXTS, normalize_embeddings=True, convert_to_tensor=True
    )
    got = vectors(llm.embed(TEXTS))
    assert F.cosine_similarity(got, want, dim=-1).min() >= 0.9999
    assert (got - want).abs().max() > 1e-5  # bfloat16's rounding shows: it did run


def test_bert_unnormalized_is_the_mean_of_transformers_hidden_states(bert, bert_llm):
    model = AutoModel.from_pretrained(bert, dtype=torch.float32).eval()
    outputs = bert_llm.embed(TEXTS[:6], PoolingParams(normalize=False))
    for output in outputs:
        with torch.inference_mode():
            hidden = model(torch.tensor([output.prompt_token_ids])).last_hidden_state[0]
        assert_close(output.embedding, hidden.mean(0))
        assert abs(output.embedding.norm().item() - 1.0) > 0.01


def test_batched_equals_one_by_one(bert_llm):
    together = vectors(bert_llm.embed(TEXTS))
    alone = torch.cat([vectors(bert_llm.embed([text])) for text in TEXTS])
    torch.testing.assert_close(together, alone, atol=1e-6, rtol=1e-5)


def test_token_ids_embed_as_their_text_does(bert_llm):
    ids = bert_llm.tokenizer(TEXTS[3])["input_ids"]
    (by_ids,) = bert_llm.embed([ids])
    (by_text,) = bert_llm.embed(TEXTS[3])
    assert by_ids.prompt_token_ids == ids
    assert torch.equal(by_ids.embedding, by_text.embedding)


def test_an_encoder_holds_no_kv_cache_and_its_context_is_the_sentence_transformers_limit(
    bert_llm,
):
    engine = bert_llm.engine
    assert engine.pooling is not None
    assert (engine.pooling.pooling_type, engine.pooling.normalize) == ("mean", True)
    assert engine.pooling.dimensions == 128 and engine.pooling.matryoshka_dimensions is None
    # sentence_bert_config.json's max_seq_length, below the 512 positions.
    assert engine.max_model_len == 256
    stats = engine.get_stats()
    assert stats["total_kv_blocks"] == 0 and engine.runner.kv_caches == []
    (longest,) = bert_llm.embed([[5] * 256])
    assert longest.embedding is not None
    with pytest.raises(ValueError, match="maximum context length is 256 tokens; the input has 257"):
        bert_llm.embed([[5] * 257])


def test_dimensions_only_where_the_model_allows_them(bert_llm, decoder_llm):
    with pytest.raises(ValueError, match="does not support dimensions other than its 128"):
        bert_llm.embed(["a"], PoolingParams(dimensions=64))
    (full,) = bert_llm.embed(["a"], PoolingParams(dimensions=128))
    assert full.embedding.shape == (128,)
    # The decoder lists Matryoshka sizes in config.json.
    assert decoder_llm.engine.pooling.matryoshka_dimensions == (128, 64, 32)
    raw = decoder_llm.embed(TEXTS[:4], PoolingParams(normalize=False))
    cut = decoder_llm.embed(TEXTS[:4], PoolingParams(dimensions=32))
    cut_raw = decoder_llm.embed(TEXTS[:4], PoolingParams(dimensions=64, normalize=False))
    for whole, short, short_raw in zip(raw, cut, cut_raw, strict=True):
        torch.testing.assert_close(short.embedding, F.normalize(whole.embedding[:32], dim=0))
        torch.testing.assert_close(short_raw.embedding, whole.embedding[:64])
    for bad, why in ((48, "must be one of 128, 64, 32"), (256, "exceeds this model's 128")):
        with pytest.raises(ValueError, match=why):
            decoder_llm.embed(["a"], PoolingParams(dimensions=bad))
    with pytest.raises(ValueError, match="dimensions must be a positive integer"):
        PoolingParams(dimensions=0)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_decoder_pooling_equals_transformers_hidden_states(decoder, mean_decoder, pooling):
    path = decoder if pooling == "last" else mean_decoder
    llm = LLM(path, num_kv_blocks=64, max_num_batched_tokens=32, **EXACT)
    assert llm.engine.pooling.pooling_type == pooling
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    texts = TEXTS[:8]  # several longer than a step: prefilled in chunks
    outputs = llm.embed(texts, PoolingParams(normalize=False))
    assert max(len(o.prompt_token_ids) for o in outputs) > 32
    for output in outputs:
        with torch.inference_mode():
            hidden = model(torch.tensor([output.prompt_token_ids])).last_hidden_state[0]
        assert_close(output.embedding, hidden[-1] if pooling == "last" else hidden.mean(0))
    want = SentenceTransformer(str(path), device="cpu").encode(
        texts, normalize_embeddings=True, convert_to_tensor=True
    )
    assert_close(vectors(llm.embed(texts)), want)
    stats = llm.get_stats()
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]


def test_last_token_pooling_reads_the_prefix_cache(decoder_llm):
    text = "Once upon a time, " + " ".join(WORDS * 3)
    (first,) = decoder_llm.embed([text])
    (again,) = decoder_llm.embed([text])
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    torch.testing.assert_close(again.embedding, first.embedding, atol=1e-5, rtol=1e-5)


def test_a_pooling_request_holds_no_kv_blocks_after_its_step(decoder):
    engine = engine_for(decoder, max_num_batched_tokens=256)
    total = engine.get_stats()["total_kv_blocks"]
    engine.add_request("a", TEXTS[4], PoolingParams())
    engine.add_request("b", TEXTS[5], PoolingParams())
    outputs = engine.step()
    assert sorted(o.request_id for o in outputs) == ["a", "b"]
    assert all(o.finished and o.embedding is not None for o in outputs)
    stats = engine.get_stats()
    assert stats["free_kv_blocks"] == total and stats["running"] == 0
    assert stats["kv_blocks_ever_used"] > 0  # it did hold blocks during its step


def test_a_step_takes_at_most_max_num_seqs_and_max_num_batched_tokens(bert):
    engine = engine_for(bert, max_num_seqs=3, max_num_batched_tokens=256)
    for i in range(7):
        engine.add_request(f"r{i}", [7] * 10, PoolingParams())
    finished = [sorted(o.request_id for o in engine.step()) for _ in range(3)]
    assert finished == [["r0", "r1", "r2"], ["r3", "r4", "r5"], ["r6"]]
    # Whole sequences only: 100 + 100 tokens fit a step of 256, a third waits.
    for i in range(3):
        engine.add_request(f"long{i}", [7] * 100, PoolingParams())
    assert len(engine.step()) == 2
    engine.add_request("late", [7] * 5, PoolingParams())  # arrives while one waits: joins it
    assert sorted(o.request_id for o in engine.step()) == ["late", "long2"]


def test_priorities_order_the_steps_and_an_abort_ends_a_request_without_a_vector(bert):
    engine = engine_for(bert, max_num_seqs=2)
    for i in range(4):
        engine.add_request(f"batch{i}", [9] * 20, PoolingParams(), priority=1)
    engine.add_request("realtime", [9] * 20, PoolingParams(), priority=0)
    assert engine.abort_request("batch1")
    # The realtime request runs first, in a step of its own (as a realtime prefill does).
    first = {o.request_id: o for o in engine.step()}
    assert set(first) == {"realtime", "batch1"}
    assert first["batch1"].finished and first["batch1"].embedding is None
    assert first["realtime"].embedding is not None
    assert {o.request_id for o in engine.step()} == {"batch0", "batch2"}
    assert {o.request_id for o in engine.step()} == {"batch3"}
    assert not engine.has_unfinished_requests()


def test_params_of_the_other_kind_are_refused(bert_llm, tiny_llama):
    with pytest.raises(ValueError, match="embedding model: it takes PoolingParams, not Sampling"):
        bert_llm.generate(["hello"], SamplingParams())
    generator = LLM(tiny_llama, num_kv_blocks=16)
    assert generator.engine.pooling is None
    with pytest.raises(ValueError, match="generates text: it takes SamplingParams, not Pooling"):
        generator.embed(["hello"])
    assert not generator.engine.has_unfinished_requests()


def test_pooling_params_are_plain_data():
    params = PoolingParams(dimensions=64)
    assert params.n == 1 and params.output_kind is RequestOutputKind.FINAL_ONLY
    assert replace(params, output_kind=RequestOutputKind.DELTA).dimensions == 64
    with pytest.raises(ValueError, match="normalize must be a boolean"):
        PoolingParams(normalize="yes")


def test_async_llm_yields_one_finished_output_per_request(bert):
    llm = AsyncLLM(bert)

    async def embed(text: str, request_id: str, priority: int = 0):
        # The streaming kinds too: an embedding has one output, the finished one.
        params = PoolingParams(output_kind=RequestOutputKind.DELTA)
        stream = llm.generate(
            text, params, request_id=request_id, priority=priority, cache_salt="tenant"
        )
        return [output async for output in stream]

    async def main():
        return await asyncio.gather(*(embed(t, f"r{i}") for i, t in enumerate(TEXTS[:5])))

    try:
        results = asyncio.run(main())
        for (output,) in results:
            assert output.finished and output.outputs == [] and output.embedding.shape == (128,)

        async def refused():
            with pytest.raises(ValueError, match="takes PoolingParams"):
                async for _ in llm.generate("a", SamplingParams(), request_id="bad"):
                    pass

        asyncio.run(refused())
        stats = asyncio.run(llm.get_stats())
        assert stats["running"] == stats["waiting"] == 0
    finally:
        llm.shutdown()


def test_a_decoder_request_preempted_mid_prompt_pools_it_all_again(mean_decoder):
    # Four prompts of 70-odd tokens in steps of 32, in a pool of 8 blocks (128 tokens): the
    # later ones' chunks take the blocks the first needs, and the worst is preempted.
    llm = LLM(mean_decoder, num_kv_blocks=8, max_num_batched_tokens=32, max_model_len=128, **EXACT)
    texts = [f"{i} " + " ".join(WORDS * 4) for i in range(4)]
    outputs = llm.embed(texts, PoolingParams(normalize=False))
    assert llm.get_stats()["preemptions"] > 0
    model = AutoModel.from_pretrained(mean_decoder, dtype=torch.float32).eval()
    for output in outputs:
        with torch.inference_mode():
            hidden = model(torch.tensor([output.prompt_token_ids])).last_hidden_state[0]
        assert_close(output.embedding, hidden.mean(0))


def test_on_two_threads_a_step_runs_in_shards_side_by_side_with_the_same_vectors(bert, bert_llm):
    torch.set_num_threads(2)  # conftest runs tests on one
    try:
        sharded = LLM(bert, **EXACT)
        assert torch.get_num_threads() == 2  # the shards' threads left the caller's as it was
    finally:
        torch.set_num_threads(1)
    assert sharded.engine.runner.shard_threads.count == 2
    assert bert_llm.engine.runner.shard_threads.count == 1
    got = vectors(sharded.embed(TEXTS))
    assert torch.get_num_threads() == 1
    torch.testing.assert_close(got, vectors(bert_llm.embed(TEXTS)), atol=1e-5, rtol=1e-5)
    (alone,) = sharded.embed(["just one"])
    torch.testing.assert_close(alone.embedding, bert_llm.embed(["just one"])[0].embedding)
    sharded.shutdown()
