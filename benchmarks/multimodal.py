"""Chat requests with an image or an audio clip through the engine, preprocessing off the
engine thread.

    python benchmarks/multimodal.py                       # llava small: 64 requests, ~3 min
    python benchmarks/multimodal.py --arch qwen2_vl       # qwen2_vl small, 448x448 images
    python benchmarks/multimodal.py --arch qwen2_audio    # qwen2_audio small: 32 clips of 10 s
    python benchmarks/multimodal.py --size tiny           # a quick look

Three runs on one generated checkpoint (`pagedbatch make-model --arch ...`), each of
`--requests` chat requests (64 by default; 32 for audio) of one image or clip and a
`--question-len`-token question, `--output-len` tokens out (greedy, ignore_eos). An image is
`--image-side` pixels square (by default 336 for LLaVA, whose tower reads that size, and 448 for
Qwen2-VL), sent as PNG bytes; a clip is `--clip-seconds` of a speech-like signal, sent as a 16-bit
stereo WAV at 44.1 kHz (so that mixing down and resampling are part of the work):
- distinct: a different image or clip each;
- same_media: one image or clip for all (the encoder cache's hits, and prefix-cache hits);
- text_only: prompts of the same token counts, without media.

As the service does, a pool of `--preprocess-threads` threads decodes each image or clip and
computes what the encoder reads (transformers' image processor on Pillow; libsndfile, soxr and
the Whisper feature extractor) while the engine thread steps; a request joins the engine once
its media is ready. Figures per run: wall seconds, images or clips a second, output tok/s,
`preprocess_wait_share` (the share of wall time the engine had nothing to run while media were
still being prepared: the target is under 5%), and the engine's encoder counters. One JSON line.
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
import soundfile
import torch
from PIL import Image

from pagedbatch.engine import LLMEngine, SamplingParams
from pagedbatch.engine.config import EngineArgs
from pagedbatch.engine.multimodal.inputs import MediaItem, place
from pagedbatch.make_model import make_model
from pagedbatch.protocol.audio import decode_audio

WAV_RATE = 44_100


def png(seed: int, side: int) -> bytes:
    """A photo-like image: smooth colour fields with noise, as PNG bytes."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:side, 0:side] / side
    base = np.stack([np.sin(6 * x + seed), np.cos(5 * y - seed), np.sin(4 * (x + y))], axis=-1)
    pixels = (127 + 100 * base + rng.normal(0, 12, base.shape)).clip(0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def wav(seed: int, seconds: float) -> bytes:
    """A speech-like clip: a wandering pitch with harmonics, syllable-rate loudness and noise,
    as a 16-bit stereo WAV at 44.1 kHz."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * WAV_RATE)) / WAV_RATE
    pitch = 120 + 40 * np.sin(2 * np.pi * 0.5 * t + seed)
    phase = 2 * np.pi * np.cumsum(pitch) / WAV_RATE
    voice = sum(np.sin(k * phase) / k for k in range(1, 6))
    loudness = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t + rng.uniform(0, 6)) ** 2
    mono = 0.2 * voice * loudness + rng.normal(0, 0.01, t.size)
    buffer = io.BytesIO()
    soundfile.write(buffer, np.stack([mono, 0.9 * mono], axis=1), WAV_RATE, format="WAV")
    return buffer.getvalue()


def prepare(
    engine: LLMEngine, prompt: list[int], media: bytes | None
) -> tuple[list[int], tuple[MediaItem, ...]]:
    """What a request's preparing thread does: decode its image or clip, process it, place it."""
    if media is None:
        return prompt, ()
    audio = engine.audio_processor
    if audio is not None:
        processed = audio(*decode_audio(media, "benchmark", audio.limits))
    else:
        processed = engine.image_processor(Image.open(io.BytesIO(media)).convert("RGB"))
    ids, items = place(prompt, [processed])
    return ids, tuple(items)


def run(engine: LLMEngine, requests: list[tuple[list[int], bytes | None]], args) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    before = engine.get_stats()
    waited = 0.0
    done = 0
    started = time.perf_counter()
    with ThreadPoolExecutor(args.preprocess_threads) as pool:
        pending: set[Future] = {
            pool.submit(prepare, engine, prompt, media) for prompt, media in requests
        }
        while done < len(requests):
            for future in [f for f in pending if f.done()]:
                pending.discard(future)
                ids, media = future.result()
                engine.add_request(None, ids, params, media=media)
            if engine.has_unfinished_requests():
                done += sum(output.finished for output in engine.step())
            elif pending:
                idle_from = time.perf_counter()
                wait(pending, return_when=FIRST_COMPLETED)
                waited += time.perf_counter() - idle_from
    wall = time.perf_counter() - started
    after = engine.get_stats()
    with_media = sum(media is not None for _, media in requests)
    return {
        "wall_s": round(wall, 2),
        "media_per_s": round(with_media / wall, 2),
        "output_tok_s": round(len(requests) * args.output_len / wall, 1),
        "preprocess_wait_share": round(waited / wall, 4),
        "media_encoded": after["media_encoded"] - before["media_encoded"],
        "encoder_cache_hits": after["encoder_cache_hits"] - before["encoder_cache_hits"],
        "prefix_cache_hit_tokens": after["prefix_cache_hits"] - before["prefix_cache_hits"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llava", choices=("llava", "qwen2_vl", "qwen2_audio"))
    parser.add_argument("--size", default="small", choices=("tiny", "small"))
    parser.add_argument("--image-side", type=int, help="default: 336 (llava), 448 (qwen2_vl)")
    parser.add_argument("--clip-seconds", type=float, default=10.0)
    parser.add_argument("--requests", type=int, help="default: 64; 32 for audio")
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
        audio = engine.audio_processor is not None
        requests = args.requests or (32 if audio else 64)
        kind = "audio" if audio else "image"
        template = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": "Q"}]}],
            add_generation_prompt=True,
            tokenize=False,
        )
        head, tail = (engine.tokenizer.encode(t) for t in template.split("Q"))
        rng = random.Random(0)

        def random_tokens(n: int) -> list[int]:
            return [rng.randrange(10, 8000) for _ in range(n)]

        if audio:
            media = [wav(i, args.clip_seconds) for i in range(requests)]
            shape = {"clip_seconds": args.clip_seconds}
        else:
            side = args.image_side or {"llava": 336, "qwen2_vl": 448}[args.arch]
            media = [png(i, side) for i in range(requests)]
            shape = {"image_side": side}
        media_prompts = [head + random_tokens(args.question_len) + tail for _ in media]
        # Text-only prompts: the placeholder's place taken by as many text tokens.
        ids, (item,) = prepare(engine, media_prompts[0], media[0])
        figures = {
            "model": f"{args.arch}-{args.size}",
            **shape,
            "media_tokens": item.length,
            "requests": requests,
            "question_len": args.question_len,
            "output_len": args.output_len,
            "distinct": run(engine, list(zip(media_prompts, media, strict=True)), args),
        }
        figures["same_media"] = run(fresh(), [(p, media[0]) for p in media_prompts], args)
        placeholder = ids[item.offset]
        text_prompts = [
            [u for t in p for u in ([t] if t != placeholder else random_tokens(item.length))]
            for p in media_prompts
        ]
        figures["text_only"] = run(fresh(), [(p, None) for p in text_prompts], args)
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
