"""Audio as the doors receive it: a chat request's `input_audio` parts (base64) and a
transcription's uploaded file, decoded into mono waveforms within the engine's limits.

libsndfile (through `soundfile`, whose wheel ships it) reads WAV, FLAC, OGG and MP3 by their
content. Every check runs before the costly step it guards: the base64 text's length before
decoding it, the byte count before opening the file, the header's duration, rate and channels
before decoding the samples, which are read in blocks and mixed down as they come, so that a
hostile file costs at most what the limits allow. Each failure is a 400 naming the part
(`messages[0].content[1].input_audio`) or the field (`file`).
"""

from __future__ import annotations

import io

import numpy as np

from pagedbatch.engine.multimodal.audio import AudioLimits
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.inline_data import decode_base64

FORMATS = ("WAV", "FLAC", "OGG", "MP3")
# Sample rates and channel counts of real recordings; past them, the samples a clip of the
# allowed length decodes to would grow without telling us anything more.
MIN_RATE, MAX_RATE = 4_000, 192_000
MAX_CHANNELS = 8
BLOCK_FRAMES = 65_536


def decode_base64_audio(data: str, param: str, limits: AudioLimits) -> tuple[np.ndarray, int]:
    """The mono waveform and sampling rate of an `input_audio` part's base64 data."""
    raw = decode_base64(data, param, limits.bytes, "audio", "audio_too_large")
    return decode_audio(raw, param, limits)


def decode_audio(raw: bytes, param: str, limits: AudioLimits) -> tuple[np.ndarray, int]:
    """The mono waveform (float32) and sampling rate of a WAV, FLAC, OGG or MP3 file's bytes."""
    import soundfile  # loads libsndfile: only audio requests need it

    if len(raw) > limits.bytes:
        raise _too_large(f"{len(raw)} bytes, more than the {limits.bytes} allowed", param)
    try:
        with soundfile.SoundFile(io.BytesIO(raw)) as f:
            if f.format not in FORMATS:
                raise soundfile.SoundFileError(f"format {f.format}")
            rate, channels = f.samplerate, f.channels
            if not MIN_RATE <= rate <= MAX_RATE or not 1 <= channels <= MAX_CHANNELS:
                raise OpenAIError(
                    f"Unsupported audio: {rate} Hz and {channels} channels; clips of "
                    f"{MIN_RATE} to {MAX_RATE} Hz and at most {MAX_CHANNELS} channels are read.",
                    param=param,
                    code="invalid_audio_format",
                )
            # The header's length first (an MP3's is an estimate: the decoded length is checked
            # again as it comes).
            max_frames = int(limits.seconds * rate)
            if f.frames > max_frames:
                raise _too_long(f.frames / rate, limits, param)
            blocks = []
            decoded = 0
            for block in f.blocks(BLOCK_FRAMES, dtype="float32", always_2d=True):
                decoded += len(block)
                if decoded > max_frames:
                    raise _too_long(decoded / rate, limits, param)
                blocks.append(block.mean(axis=1, dtype=np.float32))
    except (soundfile.SoundFileError, RuntimeError, TypeError, ValueError):
        raise OpenAIError(
            f"The audio is not a {', '.join(FORMATS)} file, or it is damaged.",
            param=param,
            code="invalid_audio_format",
        ) from None
    if not decoded:
        raise OpenAIError("The audio holds no sound.", param=param, code="invalid_audio_format")
    return np.concatenate(blocks), rate


def _too_large(what: str, param: str) -> OpenAIError:
    return OpenAIError(f"The audio is too large: {what}.", param=param, code="audio_too_large")


def _too_long(seconds: float, limits: AudioLimits, param: str) -> OpenAIError:
    return OpenAIError(
        f"The audio is too long: {seconds:.1f} s, more than the {limits.seconds:g} s allowed.",
        param=param,
        code="audio_too_long",
    )
