"""An image's shape is bounded before the model's processor runs: a strip inside the pixel limit
(1,048,576x16, 16,777,216x1: PNGs of 2 KB) is a 400 naming its part, not gigabytes of resized
pixels or a MemoryError; an image the processor would resize past the pixel limit is refused
too; and the size checked is the one the processor makes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from memory import peak_rss_growth
from PIL import Image
from vision_oracle import data_url

from pagedbatch.engine.config import ModelConfig
from pagedbatch.engine.multimodal.images import ImageLimits, ImageProcessor
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.images import decode_image_url, process_image

PARAM = "messages[0].content[1].image_url"
LIMITS = ImageLimits(per_request=4, bytes=20 * 2**20, pixels=4096 * 4096)
STRIPS = [(1_048_576, 16), (16_777_216, 1)]  # each at most 4096x4096 pixels


@pytest.fixture(scope="module")
def llava(make_checkpoint) -> Path:
    return make_checkpoint("llava")


def processor(model_dir: Path, limits: ImageLimits = LIMITS) -> ImageProcessor:
    return ImageProcessor(ModelConfig.load(model_dir), limits)


def strip(width: int, height: int) -> str:
    """A blank image of that size as a data URL: 2 KB of PNG."""
    return data_url(Image.new("1", (width, height)))


@pytest.mark.parametrize(("width", "height"), STRIPS)
def test_a_strip_inside_the_pixel_limit_is_a_400_naming_its_part(llava, width, height):
    image = decode_image_url(strip(width, height), PARAM, LIMITS)
    with pytest.raises(OpenAIError) as caught:
        process_image(processor(llava), image, PARAM)
    error = caught.value
    assert error.status_code == 400
    body = error.body()["error"]
    assert (body["param"], body["code"]) == (PARAM, "invalid_image_shape")
    assert f"{width}x{height}" in body["message"] and "200 times" in body["message"]


def test_an_image_resized_past_the_pixel_limit_is_refused(llava):
    """CLIP's processor scales the shorter side to 56 here: 3000x20 becomes 8400x56, 470,400
    pixels, past a limit of 300,000 that the image as sent (60,000) is well within."""
    small = ImageLimits(per_request=4, bytes=2**20, pixels=300_000)
    image = decode_image_url(data_url(Image.new("RGB", (3000, 20))), PARAM, small)
    with pytest.raises(OpenAIError) as caught:
        process_image(processor(llava, small), image, PARAM)
    body = caught.value.body()["error"]
    assert (body["param"], body["code"]) == (PARAM, "image_too_large")
    assert "resized to 8400x56" in body["message"]


def test_the_size_checked_is_the_one_qwen2_vl_resizes_to(make_checkpoint):
    qwen = processor(make_checkpoint("qwen2_vl"))
    for width, height in [(300, 100), (57, 2000), (1000, 1000)]:
        image = Image.fromarray(np.zeros((height, width, 3), dtype=np.uint8))
        _, grid_height, grid_width = qwen(image).grid
        patch = 14
        assert qwen.resized_size(width, height) == (grid_width * patch, grid_height * patch)


MEASURE = """
from pagedbatch.engine.config import ModelConfig
from pagedbatch.engine.multimodal.images import ImageProcessor
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.images import decode_image_url, process_image
from test_image_bounds import LIMITS, PARAM, STRIPS, strip
processor = ImageProcessor(ModelConfig.load({checkpoint!r}), LIMITS)
urls = [strip(width, height) for width, height in STRIPS]
def work():
    codes = []
    for url in urls:
        try:
            process_image(processor, decode_image_url(url, PARAM, LIMITS), PARAM)
        except OpenAIError as e:
            codes.append(e.body()["error"]["code"])
    return codes
"""


def test_refusing_the_strips_takes_no_more_memory_than_decoding_them(llava):
    """Peak RSS of a process of its own (VmHWM, reset first): the strips decode to 50 MB of RGB
    each, within the pixel limit; resized by CLIP's processor, the first took 2.5 GB and the
    second raised MemoryError."""
    codes, grown_kib = peak_rss_growth(MEASURE.format(checkpoint=str(llava)), __file__)
    assert codes == ["invalid_image_shape"] * 2
    assert grown_kib < 256 * 1024
