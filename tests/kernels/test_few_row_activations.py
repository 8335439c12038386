"""The few-row products' default activations: int16 where it is clearly the faster on this CPU,
float32 elsewhere, measured once per build of the C kernels and kept beside it."""

from __future__ import annotations

import json
import logging

import pytest
from test_quant_matmul import build_portable, needs_compiler

from pagedbatch.kernels import few_row_activations, native, quant_linear
from pagedbatch.kernels.quant_blocks import Format

pytestmark = needs_compiler


@pytest.fixture
def lib():
    built = native.library()
    assert built is not None, "the C kernels did not build; see the warning"
    return built


def both_streamed(lib) -> set[Format]:
    return {
        f
        for f in Format
        if lib.quant_int16_streamed(f.ggml_type) and lib.quant_float_streamed(f.ggml_type)
    }


def test_int16_only_where_it_takes_at_most_nine_tenths_of_float32s_time():
    assert few_row_activations.faster(1.0, 0.9) == "int16"
    assert few_row_activations.faster(1.0, 0.91) == "float32"
    assert few_row_activations.faster(1.0, 1.2) == "float32"


def test_each_format_streamed_both_ways_is_measured_once_and_the_answer_kept(lib, tmp_path):
    saved = tmp_path / "kernels.activations.json"
    answer = few_row_activations._chosen(lib, saved)
    assert set(answer) == both_streamed(lib)
    assert set(answer.values()) <= {"int16", "float32"}
    assert json.loads(saved.read_text()) == {f.name: value for f, value in answer.items()}


def test_a_kept_answer_is_taken_as_it_is_and_a_broken_one_measured_anew(lib, tmp_path):
    """Every process on the machine takes what the first one measured; a file that is not a
    whole answer (another build's formats, a value no kernel has, not JSON) is replaced."""
    formats = both_streamed(lib)
    if not formats:
        pytest.skip("this build streams no format both ways")
    kept = tmp_path / "kept.activations.json"
    ordered = sorted(formats, key=lambda f: f.ggml_type)
    flipped = {f.name: "int16" if i % 2 else "float32" for i, f in enumerate(ordered)}
    kept.write_text(json.dumps(flipped))
    answer = few_row_activations._chosen(lib, kept)
    assert {f.name: value for f, value in answer.items()} == flipped
    for broken in (
        "{not json",
        json.dumps({"Q4_1": "int16"}),
        json.dumps(dict.fromkeys(flipped, "int4")),
    ):
        path = tmp_path / f"broken-{len(broken)}.activations.json"
        path.write_text(broken)
        answer = few_row_activations._chosen(lib, path)
        assert set(answer) == formats
        assert json.loads(path.read_text()) == {f.name: value for f, value in answer.items()}


def test_an_answer_that_cannot_be_kept_is_still_given(lib, tmp_path, caplog):
    path = tmp_path / "no-such-folder" / "kernels.activations.json"
    with caplog.at_level(logging.WARNING, logger=few_row_activations.__name__):
        answer = few_row_activations._chosen(lib, path)
    assert set(answer) == both_streamed(lib) and not path.exists()
    if answer:
        assert "could not keep" in caplog.text


def test_a_build_without_the_int16_path_has_nothing_to_choose(tmp_path):
    portable = build_portable(tmp_path)
    assert few_row_activations._chosen(portable, tmp_path / "portable.activations.json") == {}


def test_auto_takes_the_measured_answer(lib, monkeypatch):
    monkeypatch.setenv(quant_linear.ACTIVATIONS_SETTING, "auto")
    measured = few_row_activations.chosen(lib)
    for fmt in both_streamed(lib):
        assert quant_linear.activations_for(fmt) == measured[fmt]
