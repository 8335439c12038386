"""Audio clips for an audio-language model (Qwen2-Audio): what it reads of one (`AudioSpec`) and
the processor that makes a waveform ready for it.

A Whisper-style encoder reads log-mel frames, 10 ms each, at most a 30 s window, through two
convolutions (the second halving the frames) and a 2x average pool: one embedding per 40 ms.
transformers pads every clip to the whole window and masks the padding's keys in attention; we
keep only the clip's frames and the two past its end that the convolutions read at its edge, so
that a short clip costs what it holds, not 30 s of encoder work, with the same embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from pagedbatch.engine.config import ModelConfig
from pagedbatch.engine.multimodal.inputs import MediaItem, Modality, ProcessedMedia, content_hash

# Mel frames past a clip's end that its last embeddings depend on: the first convolution's
# kernel reaches one frame on, the second's (stride 2) one of the first's outputs on.
EDGE_FRAMES = 2


@dataclass(frozen=True)
class AudioLimits:
    """What one request may send: the doors check these before decoding anything."""

    per_request: int
    bytes: int
    seconds: float


@dataclass(frozen=True)
class AudioSpec:
    token_id: int  # the placeholder token
    mel_bins: int
    window: int  # mel frames the encoder reads at most
    modality: Modality = "audio"

    @staticmethod
    def tokens(frames: int) -> int:
        """Embeddings for `frames` mel frames: after the strided convolution, then the pool."""
        convolved = (frames - 1) // 2 + 1
        return (convolved - 2) // 2 + 1

    def values_shape(self, frames: int) -> tuple[int, int]:
        return self.mel_bins, min(frames + EDGE_FRAMES, self.window)

    def tokens_for(self, item: MediaItem | ProcessedMedia) -> int:
        values, frames = item.values, item.frames
        if not isinstance(values, torch.Tensor):
            raise ValueError("audio features must be a tensor")
        if not isinstance(frames, int) or not 1 <= frames <= self.window:
            raise ValueError(f"a clip has 1 to {self.window} mel frames, not {frames}")
        if tuple(values.shape) != self.values_shape(frames):
            raise ValueError(
                f"features of shape {tuple(values.shape)}; {frames} frames need "
                f"{self.values_shape(frames)}"
            )
        tokens = self.tokens(frames)
        if tokens < 1:
            raise ValueError(f"a clip of {frames} mel frames is too short to hear")
        return tokens


def audio_spec(cfg: ModelConfig) -> AudioSpec | None:
    """None for a model without audio."""
    top = cfg.multimodal
    token = cfg.audio_token_id
    if top is None or token is None:
        return None
    audio = top["audio_config"]
    # Two convolutions, the second of stride 2, give one position per two frames.
    window = 2 * audio.get("max_source_positions", 1500)
    return AudioSpec(token, audio.get("num_mel_bins", 128), window)


class AudioProcessor:
    """An audio-language model's feature extraction, safe to call from many threads."""

    def __init__(self, cfg: ModelConfig, limits: AudioLimits):
        from transformers import AutoFeatureExtractor  # only audio models need its imports

        spec = audio_spec(cfg)
        if spec is None:
            raise ValueError(f"{cfg.architecture} takes no audio")
        self.spec = spec
        self._extractor = AutoFeatureExtractor.from_pretrained(Path(cfg.metadata_dir))
        self.sampling_rate: int = self._extractor.sampling_rate
        hop = self._extractor.hop_length
        self.max_seconds = spec.window * hop / self.sampling_rate
        if limits.seconds > self.max_seconds:
            raise ValueError(
                f"max_audio_seconds {limits.seconds:g} exceeds the {self.max_seconds:g} s "
                "this model hears at once"
            )
        self.limits = limits

    def __call__(self, waveform: np.ndarray, sampling_rate: int) -> ProcessedMedia:
        """A mono waveform (float samples in [-1, 1]) at any rate made ready for the engine;
        ValueError if it is empty, longer than the model's window, or too short to hear."""
        samples = np.asarray(waveform, dtype=np.float32)
        if samples.ndim != 1 or samples.size == 0:
            raise ValueError("a clip is a non-empty mono waveform")
        if not np.isfinite(samples).all():
            raise ValueError("the clip's samples are not all finite")
        if sampling_rate != self.sampling_rate:
            import soxr  # only audio models need it

            samples = soxr.resample(samples, sampling_rate, self.sampling_rate)
        seconds = samples.size / self.sampling_rate
        if seconds > self.max_seconds:
            raise ValueError(
                f"a clip of {seconds:.1f} s is longer than the {self.max_seconds:g} s this "
                "model hears at once"
            )
        out = self._extractor(
            samples,
            sampling_rate=self.sampling_rate,
            return_attention_mask=True,
            padding="max_length",
            return_tensors="np",
        )
        frames = int(out["attention_mask"][0].sum())
        kept = self.spec.values_shape(frames)[1]
        values = torch.from_numpy(np.ascontiguousarray(out["input_features"][0][:, :kept]))
        processed = ProcessedMedia(
            "audio",
            self.spec.token_id,
            values,
            content_hash("audio", values, frames),
            0,
            frames=frames,
        )
        return replace(processed, num_tokens=self.spec.tokens_for(processed))
