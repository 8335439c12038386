"""Images in chat through the `openai` SDK: realtime (whole and streamed) and batch lines, each
answer the one transformers gives for that image, and every bad image a 400 naming its part."""

from __future__ import annotations

import base64
import http.server
import io
import json
import threading
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image
from test_batches import assert_engine_idle, create, finished, results
from transformers import AutoTokenizer
from vision_oracle import chat_text, data_url, hf_greedy

MAX_TOKENS = 10
IMAGE_TOKENS = 16  # the tiny LLaVA's 56x56 pixels in 14x14 patches


@pytest.fixture(scope="module")
def tiny_llava(make_checkpoint) -> Path:
    return make_checkpoint("llava")


@pytest.fixture
def llava_server(serve_batches, tiny_llava):
    return serve_batches(model=str(tiny_llava), served_model_name="llava", max_images_per_request=2)


def picture(seed: int, height: int = 48, width: int = 80) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}


def messages(*parts: dict, question: str = "What is in this picture?") -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


def hf_answer(model_dir: Path, images: list[Image.Image], question: str) -> str:
    """transformers' answer, end to end, to a user turn of `images` then `question`."""
    text = chat_text(model_dir, question, len(images))
    tokens = hf_greedy(model_dir, text, images, MAX_TOKENS)
    return AutoTokenizer.from_pretrained(model_dir).decode(tokens, skip_special_tokens=True)


def ask(client: openai.OpenAI, parts: list[dict], **kwargs):
    return client.chat.completions.create(
        model="llava",
        messages=messages(*parts),
        max_completion_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
        **kwargs,
    )


def test_realtime_chat_with_an_image_whole_and_streamed(llava_server, tiny_llava):
    client = llava_server.client()
    image = picture(1)
    expected = hf_answer(tiny_llava, [image], "What is in this picture?")
    whole = ask(client, [image_part(data_url(image))])
    assert whole.choices[0].message.content == expected
    assert whole.usage.prompt_tokens_details.image_tokens == IMAGE_TOKENS
    assert whole.usage.prompt_tokens > IMAGE_TOKENS

    chunks = list(
        ask(
            client,
            [image_part(data_url(image))],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert chunks[-1].usage.prompt_tokens_details.image_tokens == IMAGE_TOKENS
    # The same image again: its prefix is cached.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert_engine_idle(llava_server)


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP", "GIF"])
def test_every_format_openai_takes_is_read(llava_server, tiny_llava, fmt):
    image = picture(2)
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    decoded = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")  # lossy formats
    answer = ask(llava_server.client(), [image_part(data_url(image, fmt))])
    assert answer.choices[0].message.content == hf_answer(
        tiny_llava, [decoded], "What is in this picture?"
    )


def test_an_image_to_code_answer_keeps_to_its_schema(llava_server):
    schema = {
        "type": "object",
        # Bounded, so that a random model's strings end within the token budget.
        "properties": {
            "language": {"type": "string", "maxLength": 10},
            "code": {"type": "string", "maxLength": 20},
        },
        "required": ["language", "code"],
        "additionalProperties": False,
    }
    answer = llava_server.client().chat.completions.create(
        model="llava",
        messages=messages(image_part(data_url(picture(3))), question="Write this UI as code."),
        max_completion_tokens=60,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "code", "schema": schema, "strict": True},
        },
    )
    assert answer.choices[0].finish_reason == "stop"
    assert set(json.loads(answer.choices[0].message.content)) == {"language", "code"}


def test_batch_lines_carry_images(llava_server, tiny_llava):
    client = llava_server.client()
    images = [picture(10 + i, 30 + 20 * i, 90 - 10 * i) for i in range(3)]
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "llava",
                "messages": messages(*[image_part(data_url(im)) for im in images[i : i + count]]),
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
        for i, count in enumerate([1, 2, 0])
    ]
    batch = finished(client, create(client, lines).id)
    assert batch.status == "completed", batch
    outputs, errors = results(client, batch)
    assert errors == []
    by_id = {line["custom_id"]: line["response"]["body"] for line in outputs}
    for i, count in enumerate([1, 2, 0]):
        body = by_id[f"line-{i}"]
        expected = hf_answer(tiny_llava, images[i : i + count], "What is in this picture?")
        assert body["choices"][0]["message"]["content"] == expected
        assert body["usage"]["prompt_tokens_details"]["image_tokens"] == IMAGE_TOKENS * count


def _too_big_png() -> str:
    return data_url(Image.new("RGB", (5000, 4000)))


def _strip(width: int, height: int) -> str:
    return data_url(Image.new("1", (width, height)))


@pytest.mark.parametrize(
    "parts, param, code",
    [
        (
            [image_part("data:image/png;base64,%%%notbase64")],
            "content[0].image_url",
            "invalid_base64",
        ),
        (
            [image_part("data:image/png;base64," + base64.b64encode(b"no image here").decode())],
            "content[0].image_url",
            "invalid_image_format",
        ),
        ([image_part("data:text/plain;base64,aGk=")], "content[0].image_url", "invalid_image_url"),
        ([image_part("https://example.com/cat.png")], "content[0].image_url", "invalid_image_url"),
        ([image_part("http://[::1/x.png")], "content[0].image_url", "invalid_image_url"),
        ([image_part(_too_big_png())], "content[0].image_url", "image_too_large"),
        ([image_part(data_url(picture(4)))] * 3, "messages", "too_many_images"),
        # Inside the pixel limit, 2 KB of PNG each; resized, 2.5 GB and a MemoryError (a 500).
        ([image_part(_strip(1_048_576, 16))], "content[0].image_url", "invalid_image_shape"),
        ([image_part(_strip(16_777_216, 1))], "content[0].image_url", "invalid_image_shape"),
    ],
    ids=[
        "broken-base64",
        "not-an-image",
        "not-an-image-url",
        "url-not-allowed",
        "url-malformed",
        "too-many-pixels",
        "too-many",
        "wide-strip",
        "one-pixel-row",
    ],
)
def test_bad_images_get_a_400_naming_the_part(llava_server, parts, param, code):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(llava_server.client(), parts)
    error = caught.value.body
    assert error["code"] == code
    assert error["param"] == (param if param == "messages" else f"messages[0].{param}")
    assert_engine_idle(llava_server)


def test_an_image_larger_than_the_byte_limit_is_refused(serve_batches, tiny_llava):
    server = serve_batches(model=str(tiny_llava), served_model_name="llava", max_image_bytes=100)
    with pytest.raises(openai.BadRequestError) as caught:
        ask(server.client(), [image_part(data_url(picture(5)))])
    assert caught.value.body["code"] == "image_too_large"


def test_an_image_sent_to_a_text_only_model_is_refused(serve_batches):
    server = serve_batches()
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(
            model="tiny", messages=messages(image_part(data_url(picture(6)))), max_tokens=4
        )
    assert caught.value.body["param"] == "messages[0].content[0]"
    assert caught.value.body["code"] == "unsupported_content_type"
    assert_engine_idle(server)


def test_the_image_token_typed_as_text_is_refused(llava_server):
    with pytest.raises(openai.BadRequestError) as caught:
        llava_server.client().chat.completions.create(
            model="llava",
            messages=[{"role": "user", "content": "Look: <image>"}],
            max_tokens=4,
        )
    assert caught.value.body["param"] == "messages"
    assert_engine_idle(llava_server)


# Image URLs


class _ImageHost(http.server.BaseHTTPRequestHandler):
    """Serves one PNG, redirects to it (or off the allowed host), and an endless body."""

    png = b""

    def do_GET(self) -> None:  # noqa: N802 - the base class's name
        port = self.server.server_address[1]
        redirects = {
            "/hop": "/cat.png",
            "/away": f"http://localhost:{port}/cat.png",  # a host not on the list
        }
        if self.path in redirects:
            self.send_response(302)
            self.send_header("Location", redirects[self.path])
            self.end_headers()
        elif self.path == "/cat.png":
            self.send_response(200)
            self.send_header("Content-Length", str(len(self.png)))
            self.end_headers()
            self.wfile.write(self.png)
        elif self.path == "/huge.png":
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"\0" * 300_000)
        else:
            self.send_response(404)
            self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def image_host():
    image = picture(20)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    _ImageHost.png = buffer.getvalue()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ImageHost)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", image
    server.shutdown()


def test_urls_of_allowed_hosts_are_fetched(serve_batches, tiny_llava, image_host):
    base, image = image_host
    server = serve_batches(
        model=str(tiny_llava),
        served_model_name="llava",
        media_allowed_hosts="127.0.0.1",
        max_image_bytes=200_000,
    )
    client = server.client()
    expected = hf_answer(tiny_llava, [image], "What is in this picture?")
    for path in ("/cat.png", "/hop"):
        answer = ask(client, [image_part(base + path)])
        assert answer.choices[0].message.content == expected
    for path, message in [
        ("/away", "only the hosts"),
        ("/missing.png", "HTTP 404"),
        ("/huge.png", "too large"),
    ]:
        with pytest.raises(openai.BadRequestError, match=message) as caught:
            ask(client, [image_part(base + path)])
        assert caught.value.body["param"] == "messages[0].content[0].image_url"
    assert_engine_idle(server)


def test_an_allowed_name_that_resolves_to_a_private_address_is_refused(
    serve_batches, tiny_llava, image_host
):
    """Listing a name vouches for the host, not for whatever the name comes to resolve to:
    only a listed address may be private."""
    base, _ = image_host
    port = base.rsplit(":", 1)[1]
    server = serve_batches(
        model=str(tiny_llava), served_model_name="llava", media_allowed_hosts="localhost"
    )
    with pytest.raises(openai.BadRequestError, match="not at a public address") as caught:
        ask(server.client(), [image_part(f"http://localhost:{port}/cat.png")])
    assert caught.value.body["code"] == "invalid_image_url"


def test_qwen2_vl_reads_each_image_at_its_own_size(serve_batches, make_checkpoint):
    model_dir = make_checkpoint("qwen2_vl")
    server = serve_batches(model=str(model_dir), served_model_name="llava")
    client = server.client()
    # 56x112 pixels: 4x8 patches, 8 embeddings; 112x112: 8x8 patches, 16 (tiny's most).
    for (height, width), tokens in [((56, 112), 8), ((112, 112), 16)]:
        image = picture(30 + tokens, height, width)
        answer = ask(client, [image_part(data_url(image))])
        assert answer.usage.prompt_tokens_details.image_tokens == tokens
        expected = hf_answer(model_dir, [image], "What is in this picture?")
        assert answer.choices[0].message.content == expected
    assert_engine_idle(server)


def test_an_image_past_the_text_field_bound_still_meets_the_image_limit(serve_batches, tiny_llava):
    """Inline images are bounded by max_image_bytes, not by the 2 MiB of a text field."""
    server = serve_batches(
        model=str(tiny_llava),
        served_model_name="llava",
        max_request_body_bytes=8 * 2**20,
        max_image_bytes=2**20,
    )
    noise = np.random.default_rng(0).integers(0, 256, (1100, 1100, 3), dtype=np.uint8)
    url = data_url(Image.fromarray(noise))  # about 3.6 MB of PNG: 4.8 million characters
    assert len(url) > 2**21
    with pytest.raises(openai.BadRequestError) as caught:
        ask(server.client(), [image_part(url)])
    assert caught.value.body["code"] == "image_too_large"


def test_transparency_is_laid_over_white_as_transformers_does(llava_server, tiny_llava):
    rgba = np.asarray(picture(50).convert("RGBA")).copy()
    rgba[:, :40, 3] = 0  # the left half transparent
    image = Image.fromarray(rgba, "RGBA")
    answer = ask(llava_server.client(), [image_part(data_url(image))])
    assert answer.choices[0].message.content == hf_answer(
        tiny_llava, [image], "What is in this picture?"
    )
