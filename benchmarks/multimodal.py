"""Chat requests with images through the engine, preprocessing off the engine thread.

    python benchmarks/multimodal.py                     # llava small: 64 requests, ~3 min
    python benchmarks/multimodal.py --arch qwen2_vl     # qwen2_vl small, 448x448 images
    python benchmarks/multimodal.py --size tiny         # a quick look

Three runs on one generated checkpoint (`pagedbatch make-model --arch {llava,qwen2_vl}`), each of
`--requests` chat requests of one image (`--image-side` pixels square, by default 336 for LLaVA,
whose tower reads that size, and 448 for Qwen2-VL; sent as PNG bytes) and a
`--question-len`-token question, `--output-len` tokens out (greedy, ignore_eos):
- distinct: a different image each;
- same_image: one image for all (the encoder cache's hits, and prefix-cache hits);
- text_only: prompts of the same token counts, without images.

As the service does, a pool of `--preprocess-threads` threads decodes, resizes and normalises
each image (transformers' image processor on Pillow) while the engine thread steps; a request
joins the engine once its image is ready. Figures per run: wall seconds, images/s, output
tok/s, `preprocess_wait_share` (the share of wall time the engine had nothing to run while
images were still being prepared: the target is under 5%), and the engine's encoder counters.
One JSON line.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import torch
from PIL import Image

from pagedbatch.engine import LLMEngine, SamplingParams
from pagedbatch.engine.config import EngineArgs
from pagedbatch.engine.multimodal import ImageItem, ImageProcessor
from pagedbatch.make_model import make_model


def png(seed: int, side: int) -> bytes:
    """A photo-like image: smooth colour fields with noise, as PNG bytes."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:side, 0:side] / side
    base = np.stack([np.sin(6 * x + seed), np.cos(5 * y - seed), np.sin(4 * (x + y))], axis=-1)
    pixels = (127 + 100 * base + rng.normal(0, 12, base.shape)).clip(0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def prepare(
    processor: ImageProcessor, prompt: list[int], image: bytes | None
) -> tuple[list[int], tuple[ImageItem, ...]]:
    """What a request's preparing thread does: decode, process and place its image."""
    if image is None:
        return prompt, ()
    picture = Image.open(io.BytesIO(image)).convert("RGB")
    ids, items = processor.place(prompt, [processor(picture)])
    return ids, tuple(items)


def run(engine: LLMEngine, requests: list[tuple[list[int], bytes | None]], args) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    processor = engine.image_processor
    before = engine.get_stats()
    waited = 0.0
    done = 0
    started = time.perf_counter()
    with ThreadPoolExecutor(args.preprocess_threads) as pool:
        pending: set[Future] = {
            pool.submit(prepare, processor, prompt, image) for prompt, image in requests
        }
        while done < len(requests):
            for future in [f for f in pending if f.done()]:
                pending.discard(future)
                ids, images = future.result()
                engine.add_request(None, ids, params, images=images)
            if engine.has_unfinished_requests():
                done += sum(output.finished for output in engine.step())
            elif pending:
                idle_from = time.perf_counter()
                wait(pending, return_when=FIRST_COMPLETED)
                waited += time.perf_counter() - idle_from
    wall = time.perf_counter() - started
    after = engine.get_stats()
    with_images = sum(image is not None for _, image in requests)
    return {
        "wall_s": round(wall, 2),
        "images_per_s": round(with_images / wall, 2),
        "output_tok_s": round(len(requests) * args.output_len / wall, 1),
        "preprocess_wait_share": round(waited / wall, 4),
        "images_encoded": after["images_encoded"] - before["images_encoded"],
        "encoder_cache_hits": after["encoder_cache_hits"] - before["encoder_cache_hits"],
        "prefix_cache_hit_tokens": after["prefix_cache_hits"] - before["prefix_cache_hits"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llava", choices=("llava", "qwen2_vl"))
    parser.add_argument("--size", default="small", choices=("tiny", "small"))
    parser.add_argument("--image-side", type=int, help="default: 336 (llava), 448 (qwen2_vl)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--preprocess-threads", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(tmp, arch=args.arch, size=args.size)

        def fresh() -> LLMEngine:
            """An engine per run: no run finds another's images or prefixes cached."""
            engine_args = EngineArgs(
                model=str(model), max_num_seqs=args.max_num_seqs, kv_cache_memory_gib=2
            )
            return LLMEngine(engine_args)

        engine = fresh()
        processor = engine.image_processor
        side = args.image_side or {"llava": 336, "qwen2_vl": 448}[args.arch]
        template = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q"}]}],
            add_generation_prompt=True,
            tokenize=False,
        )
        head, tail = (engine.tokenizer.encode(t) for t in template.split("Q"))
        rng = random.Random(0)

        def random_tokens(n: int) -> list[int]:
            return [rng.randrange(10, 8000) for _ in range(n)]

        images = [png(i, side) for i in range(args.requests)]
        image_prompts = [head + random_tokens(args.question_len) + tail for _ in images]
        # Text-only prompts: the image token's place taken by as many text tokens.
        image_token = processor.spec.token_id
        tokens = processor(Image.open(io.BytesIO(images[0])).convert("RGB")).num_tokens
        figures = {
            "model": f"{args.arch}-{args.size}",
            "image_side": side,
            "image_tokens": tokens,
            "requests": args.requests,
            "question_len": args.question_len,
            "output_len": args.output_len,
            "distinct": run(engine, list(zip(image_prompts, images, strict=True)), args),
        }
        figures["same_image"] = run(fresh(), [(p, images[0]) for p in image_prompts], args)
        text_prompts = [
            [u for t in p for u in ([t] if t != image_token else random_tokens(tokens))]
            for p in image_prompts
        ]
        figures["text_only"] = run(fresh(), [(p, None) for p in text_prompts], args)
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
