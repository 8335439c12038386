"""Vision-language models in the engine (LLaVA-1.5 and Qwen2-VL): greedy output token for token
transformers' float32 model, with images encoded once, cached by content, and placed in
prefix-cache hashes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from greedy_checks import assert_pool_whole
from PIL import Image
from vision_oracle import MAX_TOKENS, chat_text, hf_greedy, image

from pagedbatch.engine import LLM, SamplingParams
from pagedbatch.engine.multimodal.inputs import place

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ARCHS = ("llava", "qwen2_vl")


@pytest.fixture(scope="module", params=ARCHS)
def vlm(request, make_checkpoint) -> Path:
    return make_checkpoint(request.param)


@pytest.fixture(scope="module")
def tiny_llava(make_checkpoint) -> Path:
    return make_checkpoint("llava")


def prompt(model_dir: Path, question: str, images: list[Image.Image]) -> dict:
    return {"prompt": chat_text(model_dir, question, len(images)), "images": images}


def test_one_image_matches_transformers(vlm):
    llm = LLM(vlm)
    picture = image(0, 90, 120)
    (out,) = llm.generate(prompt(vlm, "What is in this picture?", [picture]), GREEDY)
    text = chat_text(vlm, "What is in this picture?", 1)
    assert out.outputs[0].token_ids == hf_greedy(vlm, text, [picture])
    assert llm.get_stats()["media_encoded"] == 1
    assert_pool_whole(llm)


def test_one_patch_changes_the_continuation(vlm):
    """The checkpoint's weights are sharp enough that the answer reads the pixels."""
    llm = LLM(vlm)
    pixels = np.asarray(image(1, 56, 56)).copy()
    changed = pixels.copy()
    changed[14:28, 28:42] = 255 - changed[14:28, 28:42]  # one 14x14 patch, inverted
    outs = llm.generate(
        [
            prompt(vlm, "Describe it.", [Image.fromarray(pixels)]),
            prompt(vlm, "Describe it.", [Image.fromarray(changed)]),
        ],
        GREEDY,
    )
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids


def _mixed_prompts(model_dir: Path) -> list[dict]:
    """16 requests: text only, and one to three images of different sizes."""
    sizes = [(40, 40), (200, 80), (64, 300), (120, 120), (33, 57)]
    prompts = []
    for i in range(16):
        count = i % 4
        pictures = [image(100 + i * 3 + j, *sizes[(i + j) % len(sizes)]) for j in range(count)]
        prompts.append(prompt(model_dir, f"Question {i}: what do you see?", pictures))
    return prompts


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        # Chunks of 7 tokens end inside the images' placeholders (4 to 16 of them).
        {"max_num_batched_tokens": 7},
        # 12 blocks of 16 tokens hold two or three of these requests at a time: as they grow,
        # some are preempted.
        {"num_kv_blocks": 12},
        # Room for one image's embeddings at a time: each is evicted for the next.
        {"encoder_cache_size": 16, "max_num_encoder_tokens": 16},
    ],
    ids=["whole", "chunks-inside-images", "preemption", "one-image-cache"],
)
def test_concurrent_mix_matches_transformers(vlm, engine_args):
    llm = LLM(vlm, **engine_args)
    prompts = _mixed_prompts(vlm)
    max_tokens = 40 if "num_kv_blocks" in engine_args else MAX_TOKENS
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for p, out in zip(prompts, outs, strict=True):
        expected = hf_greedy(vlm, p["prompt"], p["images"], max_tokens)
        assert out.outputs[0].token_ids == expected
    stats = llm.get_stats()
    if "num_kv_blocks" in engine_args:
        assert stats["preemptions"] > 0
    # Every image is encoded once: a request holds its images until its prefill is past them.
    assert stats["media_encoded"] == sum(len(p["images"]) for p in prompts)
    assert_pool_whole(llm)


def test_same_image_again_hits_both_caches(vlm):
    llm = LLM(vlm)
    picture = image(7, 100, 100)
    question = "What is it? Tell me all that you can see in it, in a few plain words."
    first = llm.generate(prompt(vlm, question, [picture]), GREEDY)[0]
    again = llm.generate(prompt(vlm, question, [picture.copy()]), GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens >= 32  # past the image's placeholders, 4 to 20 at most
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    stats = llm.get_stats()
    assert stats["media_encoded"] == 1
    # The second request's prefix hit covers the image: it needs no embeddings at all.
    assert stats["encoder_cache_hits"] == 0


def test_same_image_after_different_text_is_encoded_once(vlm):
    """No prefix hit (the text before the image differs), but the encoder cache has it."""
    llm = LLM(vlm)
    picture = image(8)
    for system in ("One.", "Two, longer, so that the image starts in another block."):
        text = chat_text(vlm, "Hi", 1, system)
        (out,) = llm.generate({"prompt": text, "images": [picture]}, GREEDY)
        assert out.outputs[0].token_ids == hf_greedy(vlm, text, [picture])
    stats = llm.get_stats()
    assert (stats["media_encoded"], stats["encoder_cache_hits"]) == (1, 1)


def test_different_image_same_text_never_hits(vlm):
    llm = LLM(vlm)
    llm.generate(prompt(vlm, "What is it?", [image(9)]), GREEDY)
    other = image(10)
    (out,) = llm.generate(prompt(vlm, "What is it?", [other]), GREEDY)
    assert out.num_cached_tokens == 0
    text = chat_text(vlm, "What is it?", 1)
    assert out.outputs[0].token_ids == hf_greedy(vlm, text, [other])
    assert llm.get_stats()["media_encoded"] == 2


def test_bad_images_are_refused_before_the_engine_holds_anything(tiny_llava, tiny_llama):
    llm = LLM(tiny_llava)
    processor = llm.engine.image_processor
    text = chat_text(tiny_llava, "Hi", 1)
    ids = llm.tokenizer.encode(text)
    placed, (item,) = place(ids, [processor(image(11))])
    engine = llm.engine
    with pytest.raises(ValueError, match=r"holds 1 placeholder tokens \(\d+\) for 2 items"):
        place(ids, [processor(image(11))] * 2)
    with pytest.raises(ValueError, match="image placeholder tokens that nothing fills"):
        engine.add_request(None, placed, GREEDY)
    wrong_shape = replace(item, values=torch.zeros(3, 8, 8), content_hash=b"x" * 16)
    with pytest.raises(ValueError, match=r"pixel values of shape \(3, 8, 8\)"):
        engine.add_request(None, placed, GREEDY, media=(wrong_shape,))
    not_finite = replace(
        item, values=torch.full_like(item.values, float("nan")), content_hash=b"y" * 16
    )
    with pytest.raises(ValueError, match="not finite"):
        engine.add_request(None, placed, GREEDY, media=(not_finite,))
    off_place = replace(item, offset=item.offset - 1)
    with pytest.raises(ValueError, match="does not lie on its placeholder tokens"):
        engine.add_request(None, placed, GREEDY, media=(off_place,))
    with pytest.raises(ValueError, match="takes no image input"):
        LLM(tiny_llama).engine.add_request(None, [1, 2, 3], GREEDY, media=(item,))
    small_cache = LLM(tiny_llava, encoder_cache_size=8).engine
    with pytest.raises(ValueError, match="more than the encoder's budget"):
        small_cache.add_request(None, placed, GREEDY, media=(item,))
    assert not engine.has_unfinished_requests()
    assert_pool_whole(llm)


def test_a_grid_unlike_its_pixel_values_is_refused(make_checkpoint):
    llm = LLM(make_checkpoint("qwen2_vl"))
    processor = llm.engine.image_processor
    ids = llm.tokenizer.encode(chat_text(make_checkpoint("qwen2_vl"), "Hi", 1))
    placed, (item,) = place(ids, [processor(image(12, 56, 112))])
    assert item.grid == (1, 4, 8) and item.length == 8
    for grid, message in [
        ((1, 8, 4), None),  # the same patches, another shape: accepted, as the caller's choice
        ((1, 4, 4), "grid .* needs"),
        ((1, 3, 8), "multiples of 2"),
        (None, "a grid of"),
    ]:
        other = replace(item, grid=grid)
        if message is None:
            llm.engine.abort_request(llm.engine.add_request(None, placed, GREEDY, media=(other,)))
            continue
        with pytest.raises(ValueError, match=message):
            llm.engine.add_request(None, placed, GREEDY, media=(other,))
    llm.engine.step()
    assert_pool_whole(llm)


def test_blank_images_of_transposed_shapes_are_different_images(make_checkpoint):
    """Their patches are alike, one grid the other's transpose: neither cache may confuse them."""
    model_dir = make_checkpoint("qwen2_vl")
    llm = LLM(model_dir)
    wide, tall = Image.new("RGB", (112, 56), "white"), Image.new("RGB", (56, 112), "white")
    outs = [llm.generate(prompt(model_dir, "Shape?", [p]), GREEDY)[0] for p in (wide, tall)]
    assert outs[1].num_cached_tokens == 0
    text = chat_text(model_dir, "Shape?", 1)
    for picture, out in zip((wide, tall), outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, text, [picture])
    assert llm.get_stats()["media_encoded"] == 2
