"""Images for the tests, and transformers as the oracle of vision-language models: its own
processing and float32 model.

A module of its own (not conftest.py) so test modules can import these names unambiguously.
"""

from __future__ import annotations

import base64
import io
import json
from functools import cache
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import (
    AutoImageProcessor,
    AutoProcessor,
    AutoTokenizer,
    LlavaForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
)

MAX_TOKENS = 12


def _is_qwen2_vl(model_dir: Path) -> bool:
    return json.loads((model_dir / "config.json").read_text())["model_type"] == "qwen2_vl"


@cache
def _hf_model(model_dir: Path):
    qwen2_vl = _is_qwen2_vl(model_dir)
    cls = Qwen2VLForConditionalGeneration if qwen2_vl else LlavaForConditionalGeneration
    model = cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def image(seed: int, height: int = 64, width: int = 64) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def data_url(picture: Image.Image, fmt: str = "PNG") -> str:
    """The image as a chat request's image_url sends it."""
    buffer = io.BytesIO()
    picture.save(buffer, format=fmt)
    mime = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp", "GIF": "gif"}[fmt]
    return f"data:image/{mime};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def chat_text(model_dir: Path, question: str, num_images: int, system: str | None = None) -> str:
    """A user turn with `num_images` images before the question (after a system turn, if any),
    through the model's template."""
    content = [{"type": "image"}] * num_images + [{"type": "text", "text": question}]
    messages = [{"role": "user", "content": content}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def hf_inputs(model_dir: Path, text: str, images: list[Image.Image]) -> dict:
    """What transformers' processor gives the model. LLaVA's is AutoProcessor itself; Qwen2-VL's
    cannot be built without torchvision (its video half), so its image processor runs alone
    and each <|image_pad|> is expanded as Qwen2VLProcessor does, one per 2x2 patches."""
    if not _is_qwen2_vl(model_dir):
        processor = AutoProcessor.from_pretrained(model_dir)
        return processor(images=images or None, text=text, return_tensors="pt")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    ids = tokenizer.encode(text)
    pixels = {}
    if images:
        pixels = dict(
            AutoImageProcessor.from_pretrained(model_dir)(images=images, return_tensors="pt")
        )
        grids = iter(pixels["image_grid_thw"].tolist())
        ids = [
            u for t in ids for u in ([t] * (int(np.prod(next(grids))) // 4) if t == pad else [t])
        ]
    input_ids = torch.tensor([ids])
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": (input_ids == pad).int(),  # which tokens M-RoPE places on a grid
        **pixels,
    }


@torch.inference_mode()
def hf_greedy(
    model_dir: Path, text: str, images: list[Image.Image], max_tokens: int = MAX_TOKENS
) -> list[int]:
    """transformers' own processing and model, end to end."""
    inputs = hf_inputs(model_dir, text, images)
    out = _hf_model(model_dir).generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()
