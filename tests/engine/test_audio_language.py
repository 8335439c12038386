"""An audio-language model in the engine (Qwen2-Audio): greedy output token for token
transformers' float32 model, with clips encoded once, cached by content, and placed in
prefix-cache hashes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from audio_oracle import MAX_TOKENS, RATE, chat_text, hf_greedy, hf_inputs, tone
from greedy_checks import assert_pool_whole

from pagedbatch.engine import LLM, SamplingParams
from pagedbatch.engine.multimodal.inputs import place

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen2_audio(make_checkpoint) -> Path:
    return make_checkpoint("qwen2_audio")


def prompt(model_dir: Path, question: str, clips: list[np.ndarray]) -> dict:
    return {
        "prompt": chat_text(model_dir, question, len(clips)),
        "audio": [(clip, RATE) for clip in clips],
    }


def test_features_and_placeholders_are_the_processors(qwen2_audio):
    """What we keep of a clip is what transformers' processor gives, less the padding past the
    two frames the convolutions read at its end; its placeholders are as many."""
    llm = LLM(qwen2_audio)
    clip = tone(300, 0.73)
    text = chat_text(qwen2_audio, "Hi", 1)
    expected = hf_inputs(qwen2_audio, text, [clip])
    processed = llm.engine.audio_processor(clip, RATE)
    frames = int(expected["feature_attention_mask"].sum())
    assert processed.frames == frames == 73
    assert torch.equal(processed.values, expected["input_features"][0, :, : frames + 2])
    ids, (item,) = place(llm.tokenizer.encode(text), [processed])
    assert ids == expected["input_ids"][0].tolist()
    assert item.length == processed.num_tokens == 18


def test_one_clip_matches_transformers(qwen2_audio):
    llm = LLM(qwen2_audio)
    clip = tone(440, 1.3)
    (out,) = llm.generate(prompt(qwen2_audio, "What do you hear?", [clip]), GREEDY)
    text = chat_text(qwen2_audio, "What do you hear?", 1)
    assert out.outputs[0].token_ids == hf_greedy(qwen2_audio, text, [clip])
    assert out.num_audio_tokens == 32 and out.num_image_tokens == 0
    assert llm.get_stats()["media_encoded"] == 1
    assert_pool_whole(llm)


def test_another_tone_changes_the_continuation(qwen2_audio):
    """The checkpoint's weights are sharp enough that the answer depends on the sound."""
    llm = LLM(qwen2_audio)
    outs = llm.generate(
        [prompt(qwen2_audio, "Describe it.", [tone(hz, 1.0)]) for hz in (440, 880)], GREEDY
    )
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids


def test_a_clip_at_another_rate_is_resampled(qwen2_audio):
    """An 8 kHz clip is heard as transformers hears the same clip resampled to 16 kHz."""
    import soxr

    llm = LLM(qwen2_audio)
    clip = tone(500, 1.0, rate=8_000)
    text = chat_text(qwen2_audio, "Hi", 1)
    (out,) = llm.generate({"prompt": text, "audio": [(clip, 8_000)]}, GREEDY)
    resampled = soxr.resample(clip, 8_000, RATE)
    assert out.outputs[0].token_ids == hf_greedy(qwen2_audio, text, [resampled])


def _mixed_prompts(model_dir: Path) -> list[dict]:
    """8 requests: text only, one clip, or two of different lengths."""
    lengths = [0.5, 1.3, 2.0, 0.8, 1.1]
    prompts = []
    for i in range(8):
        count = i % 3
        clips = [
            tone(200 + 97 * i + 31 * j, lengths[(i + j) % len(lengths)], seed=i)
            for j in range(count)
        ]
        prompts.append(prompt(model_dir, f"Question {i}: what do you hear?", clips))
    return prompts


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        # Chunks of 7 tokens end inside the clips' placeholders (12 to 50 of them).
        {"max_num_batched_tokens": 7},
        # 16 blocks of 16 tokens hold two or three of these requests at a time: as they grow,
        # some are preempted.
        {"num_kv_blocks": 16},
    ],
    ids=["whole", "chunks-inside-clips", "preemption"],
)
def test_concurrent_mix_matches_transformers(qwen2_audio, engine_args):
    llm = LLM(qwen2_audio, **engine_args)
    prompts = _mixed_prompts(qwen2_audio)
    max_tokens = 40 if "num_kv_blocks" in engine_args else MAX_TOKENS
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for p, out in zip(prompts, outs, strict=True):
        clips = [clip for clip, _ in p["audio"]]
        assert out.outputs[0].token_ids == hf_greedy(qwen2_audio, p["prompt"], clips, max_tokens)
    stats = llm.get_stats()
    if "num_kv_blocks" in engine_args:
        assert stats["preemptions"] > 0
    # Every clip is encoded once: a request holds its clips until its prefill is past them.
    assert stats["media_encoded"] == sum(len(p["audio"]) for p in prompts)
    assert_pool_whole(llm)


def test_same_clip_again_hits_both_caches(qwen2_audio):
    llm = LLM(qwen2_audio)
    clip = tone(330, 1.0)
    question = "What is it? Tell me all that you can hear in it, in a few plain words."
    first = llm.generate(prompt(qwen2_audio, question, [clip]), GREEDY)[0]
    again = llm.generate(prompt(qwen2_audio, question, [clip.copy()]), GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens >= 32  # past the clip's 25 placeholders
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.get_stats()["media_encoded"] == 1


def test_different_clip_same_text_never_hits(qwen2_audio):
    llm = LLM(qwen2_audio)
    llm.generate(prompt(qwen2_audio, "What is it?", [tone(600, 1.0)]), GREEDY)
    other = tone(600, 1.0, seed=1)  # the same tone, other noise
    (out,) = llm.generate(prompt(qwen2_audio, "What is it?", [other]), GREEDY)
    assert out.num_cached_tokens == 0
    assert llm.get_stats()["media_encoded"] == 2
    text = chat_text(qwen2_audio, "What is it?", 1)
    assert out.outputs[0].token_ids == hf_greedy(qwen2_audio, text, [other])


def test_bad_clips_are_refused_before_the_engine_holds_anything(qwen2_audio, tiny_llama):
    llm = LLM(qwen2_audio)
    engine, processor = llm.engine, llm.engine.audio_processor
    ids = llm.tokenizer.encode(chat_text(qwen2_audio, "Hi", 1))
    placed, (item,) = place(ids, [processor(tone(440, 1.0), RATE)])
    with pytest.raises(ValueError, match="longer than the 30 s"):
        processor(tone(440, 31.0), RATE)
    with pytest.raises(ValueError, match="too short to hear"):
        processor(np.zeros(160, np.float32), RATE)
    with pytest.raises(ValueError, match="not all finite"):
        processor(np.full(1600, np.nan, np.float32), RATE)
    with pytest.raises(ValueError, match="audio placeholder tokens that nothing fills"):
        engine.add_request(None, placed, GREEDY)
    with pytest.raises(ValueError, match=r"shape \(128, 102\); 48 frames need \(128, 50\)"):
        engine.add_request(None, placed, GREEDY, media=(replace(item, frames=48),))
    with pytest.raises(ValueError, match="has 24 placeholders"):
        engine.add_request(None, placed, GREEDY, media=(replace(item, length=24),))
    with pytest.raises(ValueError, match="takes no image input"):
        engine.add_request(None, placed, GREEDY, media=(replace(item, modality="image"),))
    with pytest.raises(ValueError, match="takes no audio input"):
        LLM(tiny_llama).engine.add_request(None, [1, 2, 3], GREEDY, media=(item,))
    with pytest.raises(ValueError, match="takes no audio"):
        LLM(tiny_llama).generate({"prompt": "Hi", "audio": [(tone(440), RATE)]}, GREEDY)
    assert not engine.has_unfinished_requests()
    assert_pool_whole(llm)
