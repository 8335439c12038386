"""Sounds for the tests, and transformers as the oracle of Qwen2-Audio: its own processor
(AutoProcessor) and float32 model.

A module of its own (not conftest.py) so test modules can import these names unambiguously.
"""

from __future__ import annotations

import base64
import io
from functools import cache
from pathlib import Path

import numpy as np
import soundfile
import torch
from transformers import AutoProcessor, AutoTokenizer, Qwen2AudioForConditionalGeneration

MAX_TOKENS = 12
RATE = 16_000


@cache
def _hf_model(model_dir: Path):
    model = Qwen2AudioForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    model = model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def tone(hz: float, seconds: float = 1.0, rate: int = RATE, seed: int = 0) -> np.ndarray:
    """A sine at `hz` with a little noise (so no two clips share their features by accident)."""
    t = np.arange(int(seconds * rate)) / rate
    noise = np.random.default_rng(seed).normal(0, 0.01, t.size)
    return (0.5 * np.sin(2 * np.pi * hz * t) + noise).astype(np.float32)


def encoded(waveform: np.ndarray, fmt: str = "WAV", rate: int = RATE) -> bytes:
    """The clip as a file of `fmt` (WAV, FLAC, OGG or MP3)."""
    buffer = io.BytesIO()
    subtype = {"WAV": "PCM_16", "FLAC": "PCM_16", "OGG": "VORBIS", "MP3": "MPEG_LAYER_III"}[fmt]
    soundfile.write(buffer, waveform, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


def input_audio(waveform: np.ndarray, fmt: str = "wav") -> dict:
    """The clip as a chat request's `input_audio` part."""
    data = base64.b64encode(encoded(waveform, fmt.upper())).decode()
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}


def chat_text(model_dir: Path, question: str, num_clips: int) -> str:
    """A user turn with `num_clips` clips before the question, through the model's template."""
    content = [{"type": "audio"}] * num_clips + [{"type": "text", "text": question}]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )


def hf_inputs(model_dir: Path, text: str, clips: list[np.ndarray]) -> dict:
    processor = AutoProcessor.from_pretrained(model_dir)
    return processor(text=text, audio=clips or None, sampling_rate=RATE, return_tensors="pt")


@torch.inference_mode()
def hf_greedy(
    model_dir: Path, text: str, clips: list[np.ndarray], max_tokens: int = MAX_TOKENS
) -> list[int]:
    """transformers' own processing and model, end to end."""
    inputs = hf_inputs(model_dir, text, clips)
    out = _hf_model(model_dir).generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()
