"""A worker whose engine dies leaves at once: its engine host withdraws from the registry, its
heartbeat says it is dead, and the process exits non-zero for its supervisor to restart it."""

from __future__ import annotations

import json
import os
import shutil
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from servers import engine_records, eventually
from sqlalchemy import select
from test_distributed import deployment  # noqa: F401 - a fixture

from pagedbatch.service import ENGINE_DIED_EXIT_CODE
from pagedbatch.store.db import make_engine, make_session_factory
from pagedbatch.store.models import WorkerHeartbeat
from pagedbatch.workers.heartbeats import DEAD


def dying(checkpoint: Path, base: str, tmp_path: Path) -> tuple[Path, Path]:
    """(checkpoint, plugin dir): `checkpoint` as a plugin architecture, a subclass of the model
    class `base` (module:class) whose first step raises, as a bug in a model would: the engine
    thread dies of it."""
    module, _, cls = base.partition(":")
    name = f"Dying{cls}"
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "dying_plugin.py").write_text(
        textwrap.dedent(f"""
        from {module} import {cls}

        class {name}({cls}):
            def forward(self, *args, **kwargs):
                raise RuntimeError("injected: this model dies at its first step")
    """)
    )
    dist = plugins / "dying_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: dying-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[pagedbatch.models]\n{name} = dying_plugin:{name}\n")
    model = tmp_path / "dying"
    shutil.copytree(checkpoint, model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = [name]
    (model / "config.json").write_text(json.dumps(config))
    return model, plugins


@pytest.fixture
def dying_model(tiny_llama: Path, tmp_path: Path) -> tuple[Path, Path]:
    return dying(tiny_llama, "pagedbatch.engine.worker.models.llama:LlamaForCausalLM", tmp_path)


def heartbeats(database_url: str) -> dict[str, float]:
    engine = make_engine(database_url)
    try:
        with make_session_factory(engine)() as session:
            rows = session.execute(select(WorkerHeartbeat.worker_id, WorkerHeartbeat.last_seen))
            return dict(rows.all())
    finally:
        engine.dispose()


def test_a_worker_whose_engine_dies_withdraws_and_exits(deployment, dying_model):  # noqa: F811
    model, plugins = dying_model
    python_path = os.pathsep.join(filter(None, [str(plugins), os.environ.get("PYTHONPATH")]))
    worker = deployment.start_worker("worker", PAGEDBATCH_MODEL=str(model), PYTHONPATH=python_path)
    broker, database_url = (
        deployment.env["PAGEDBATCH_BROKER_URL"],
        deployment.env["PAGEDBATCH_DATABASE_URL"],
    )
    eventually(lambda: len(engine_records(broker)) == 1, timeout=60)
    eventually(lambda: len(heartbeats(database_url)) == 1)
    (host,) = engine_records(broker)

    # A request makes the engine step, and die.
    httpx.post(
        f"{host.address}/v1/completions",
        json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
        timeout=30,
    )
    died = time.monotonic()
    assert worker.wait(15) == ENGINE_DIED_EXIT_CODE, deployment.log("worker")
    assert time.monotonic() - died < 5
    assert engine_records(broker) == []  # withdrawn, not left to lapse
    assert list(heartbeats(database_url).values()) == [DEAD]  # its shards go at the next reap
    assert "the engine died" in deployment.log("worker")


def test_a_worker_whose_embedding_models_engine_dies_exits_too(
    deployment,  # noqa: F811
    make_checkpoint,
    tmp_path,
):
    bert = make_checkpoint("bert")
    model, plugins = dying(bert, "pagedbatch.engine.worker.models.bert:BertModel", tmp_path)
    python_path = os.pathsep.join(filter(None, [str(plugins), os.environ.get("PYTHONPATH")]))
    worker = deployment.start_worker(
        "worker", PAGEDBATCH_EMBEDDING_MODEL=str(model), PYTHONPATH=python_path
    )
    broker = deployment.env["PAGEDBATCH_BROKER_URL"]
    eventually(lambda: len(engine_records(broker)) == 1, timeout=60)
    (host,) = engine_records(broker)

    # An embedding request makes the embedding engine step, and die; the main engine runs on.
    httpx.post(f"{host.address}/v1/embeddings", json={"model": "dying", "input": "Hi"}, timeout=30)
    assert worker.wait(15) == ENGINE_DIED_EXIT_CODE, deployment.log("worker")
    assert engine_records(broker) == []
    assert list(heartbeats(deployment.env["PAGEDBATCH_DATABASE_URL"]).values()) == [DEAD]
    assert "the engine died (dying's" in deployment.log("worker")
