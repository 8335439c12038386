"""Audio through the `openai` SDK: chat with `input_audio` parts (realtime, whole and streamed, and
batch lines) and `audio.transcriptions`, each answer the one transformers gives for that clip,
and every bad clip a 400 naming its part."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import openai
import pytest
import soundfile
from audio_oracle import RATE, chat_text, encoded, hf_greedy, input_audio, tone
from test_batches import assert_engine_idle, create, finished, results
from transformers import AutoTokenizer, GenerationConfig

from pagedbatch.protocol.serving.transcription import INSTRUCTION, LANGUAGE

MAX_TOKENS = 10
QUESTION = "What do you hear?"


@pytest.fixture(scope="module")
def qwen2_audio(make_checkpoint) -> Path:
    return make_checkpoint("qwen2_audio")


@pytest.fixture
def audio_server(serve_batches, qwen2_audio):
    return serve_batches(
        model=str(qwen2_audio), served_model_name="audio", max_audio_clips_per_request=2
    )


def messages(*parts: dict, question: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


def decoded(data: bytes) -> np.ndarray:
    """The clip as the server hears a file: decoded (lossy formats as they are), mono."""
    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    assert rate == RATE
    return samples


def hf_answer(model_dir: Path, clips: list[np.ndarray], question: str = QUESTION) -> str:
    """transformers' answer, end to end, to a user turn of `clips` then `question`."""
    tokens = hf_greedy(model_dir, chat_text(model_dir, question, len(clips)), clips, MAX_TOKENS)
    return AutoTokenizer.from_pretrained(model_dir).decode(tokens, skip_special_tokens=True)


def ask(client: openai.OpenAI, parts: list[dict], **kwargs):
    return client.chat.completions.create(
        model="audio",
        messages=messages(*parts),
        max_completion_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
        **kwargs,
    )


def test_realtime_chat_with_a_clip_whole_and_streamed(audio_server, qwen2_audio):
    client = audio_server.client()
    clip = tone(440, 1.0)
    expected = hf_answer(qwen2_audio, [decoded(encoded(clip))])
    whole = ask(client, [input_audio(clip)])
    assert whole.choices[0].message.content == expected
    assert whole.usage.prompt_tokens_details.audio_tokens == 25  # one per 40 ms
    assert whole.usage.prompt_tokens_details.image_tokens == 0

    chunks = list(
        ask(client, [input_audio(clip)], stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert chunks[-1].usage.prompt_tokens_details.audio_tokens == 25
    # The same clip again: its prefix is cached.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert_engine_idle(audio_server)


def test_an_mp3_clip_is_heard_as_decoded(audio_server, qwen2_audio):
    clip = tone(523, 1.2)
    answer = ask(audio_server.client(), [input_audio(clip, "mp3")])
    expected = hf_answer(qwen2_audio, [decoded(encoded(clip, "MP3"))])
    assert answer.choices[0].message.content == expected


def test_batch_lines_carry_clips(audio_server, qwen2_audio):
    client = audio_server.client()
    clips = [tone(250 + 150 * i, 0.6 + 0.4 * i) for i in range(3)]
    counts = [1, 2, 0]
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "audio",
                "messages": messages(*[input_audio(c) for c in clips[i : i + count]]),
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
        for i, count in enumerate(counts)
    ]
    batch = finished(client, create(client, lines).id)
    assert batch.status == "completed", batch
    outputs, errors = results(client, batch)
    assert errors == []
    by_id = {line["custom_id"]: line["response"]["body"] for line in outputs}
    for i, count in enumerate(counts):
        body = by_id[f"line-{i}"]
        heard = [decoded(encoded(c)) for c in clips[i : i + count]]
        assert body["choices"][0]["message"]["content"] == hf_answer(qwen2_audio, heard)
        tokens = [25 * (6 + 4 * j) // 10 for j in range(i, i + count)]  # 40 ms each
        assert body["usage"]["prompt_tokens_details"]["audio_tokens"] == sum(tokens)


def hf_transcript(model_dir: Path, clip: np.ndarray, instruction: str) -> str:
    """What transformers says to the transcription turn, up to its end token or one token per
    audio embedding, as the server bounds it."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    content = [{"type": "audio"}, {"type": "text", "text": instruction}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    frames = -(-len(clip) // 160)
    limit = ((frames - 1) // 2 + 1 - 2) // 2 + 1
    tokens = hf_greedy(model_dir, text, [clip], limit)
    ends = GenerationConfig.from_pretrained(model_dir).eos_token_id
    ends = {ends} if isinstance(ends, int) else set(ends)
    cut = next((i for i, t in enumerate(tokens) if t in ends), len(tokens))
    return tokenizer.decode(tokens[:cut], skip_special_tokens=True).strip()


@pytest.mark.parametrize("fmt", ["WAV", "MP3"])
def test_transcriptions_of_a_wav_and_an_mp3_file(audio_server, qwen2_audio, fmt):
    client = audio_server.client()
    data = encoded(tone(392, 0.8), fmt)
    result = client.audio.transcriptions.create(
        model="audio", file=(f"clip.{fmt.lower()}", data), language="en", temperature=0
    )
    instruction = INSTRUCTION + LANGUAGE.format(language="en")
    assert result.text == hf_transcript(qwen2_audio, decoded(data), instruction)
    assert result.usage.type == "tokens"
    assert result.usage.input_token_details.audio_tokens == 20
    assert result.usage.total_tokens == result.usage.input_tokens + result.usage.output_tokens
    text = client.audio.transcriptions.create(
        model="audio", file=("clip", data), response_format="text", language="en"
    )
    assert text.strip() == result.text
    assert_engine_idle(audio_server)


def _wav_base64(seconds: float) -> str:
    return base64.b64encode(encoded(tone(440, seconds))).decode()


@pytest.mark.parametrize(
    "parts, param, code",
    [
        (
            [{"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}],
            "content[0].input_audio",
            "invalid_base64",
        ),
        (
            [
                {
                    "type": "input_audio",
                    "input_audio": {
                        "data": base64.b64encode(b"no sound").decode(),
                        "format": "wav",
                    },
                }
            ],
            "content[0].input_audio",
            "invalid_audio_format",
        ),
        (
            [{"type": "input_audio", "input_audio": {"data": _wav_base64(3.0), "format": "wav"}}],
            "content[0].input_audio",
            "audio_too_long",
        ),
        (
            [{"type": "input_audio", "input_audio": {"data": _wav_base64(0.01), "format": "wav"}}],
            "content[0].input_audio",
            "invalid_audio_format",
        ),
        ([input_audio(tone(440, 0.5))] * 3, "messages", "too_many_audio_clips"),
    ],
    ids=["broken-base64", "not-audio", "too-long", "too-short", "too-many"],
)
def test_bad_clips_get_a_400_naming_the_part(serve_batches, qwen2_audio, parts, param, code):
    server = serve_batches(
        model=str(qwen2_audio),
        served_model_name="audio",
        max_audio_clips_per_request=2,
        max_audio_seconds=2.0,
    )
    with pytest.raises(openai.BadRequestError) as caught:
        ask(server.client(), parts)
    error = caught.value.body
    assert error["code"] == code
    assert error["param"] == (param if param == "messages" else f"messages[0].{param}")
    assert_engine_idle(server)


def test_a_clip_larger_than_the_byte_limit_is_refused(serve_batches, qwen2_audio):
    server = serve_batches(model=str(qwen2_audio), served_model_name="audio", max_audio_bytes=1000)
    with pytest.raises(openai.BadRequestError) as caught:
        ask(server.client(), [input_audio(tone(440, 0.5))])
    assert caught.value.body["code"] == "audio_too_large"
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().audio.transcriptions.create(
            model="audio", file=("clip.wav", encoded(tone(440, 0.5)))
        )
    assert (caught.value.body["code"], caught.value.body["param"]) == ("audio_too_large", "file")
    assert_engine_idle(server)


def test_audio_to_a_text_only_model_is_refused(serve_batches):
    server = serve_batches()
    client = server.client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny", messages=messages(input_audio(tone(440, 0.5))), max_tokens=4
        )
    assert caught.value.body["param"] == "messages[0].content[0]"
    assert caught.value.body["code"] == "unsupported_content_type"
    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.transcriptions.create(model="tiny", file=("clip.wav", encoded(tone(440, 0.5))))
    assert caught.value.body["param"] == "model"
    assert_engine_idle(server)


def test_a_transcription_of_a_file_that_is_not_audio_is_refused(audio_server):
    client = audio_server.client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.transcriptions.create(model="audio", file=("notes.txt", b"hello there"))
    assert (caught.value.body["code"], caught.value.body["param"]) == (
        "invalid_audio_format",
        "file",
    )
    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.transcriptions.create(
            model="audio", file=("clip.wav", encoded(tone(440, 0.5))), language="English"
        )
    assert caught.value.body["param"] == "language"
    assert_engine_idle(audio_server)
