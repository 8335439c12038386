"""Upkeep on a real job store: one process at a time, dead workers found by their heartbeats, lost
work queued again, old data purged, outages ridden out."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from batch_worker import batch as finished_batch
from batch_worker import chat_line, file_lines, run_all_shards, submit
from servers import eventually
from services import postgres_schema
from sqlalchemy import func, select, update

from pagedbatch.ids import now
from pagedbatch.service import open_store
from pagedbatch.settings import Settings
from pagedbatch.store.db import make_engine, make_session_factory, transaction
from pagedbatch.store.models import (
    Batch,
    BatchRequest,
    BatchStatus,
    File,
    IdempotencyKey,
    RequestStatus,
    Shard,
    ShardStatus,
    StoredResponse,
    UsageRecord,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEvent,
    WebhookMessage,
    WebhookMessageStatus,
    WorkerHeartbeat,
)
from pagedbatch.store.queue import InProcessQueue
from pagedbatch.store.responses import INLINE_BYTES, ResponseRecord, save_response
from pagedbatch.workers.context import WorkerContext
from pagedbatch.workers.heartbeats import heartbeat
from pagedbatch.workers.periodic import delete_expired_files
from pagedbatch.workers.retention import apply_retention
from pagedbatch.workers.tasks import run_task
from pagedbatch.workers.upkeep import upkeep, upkeep_lock

DAY = 24 * 3600


class Recorder:
    """A real in-process queue whose tasks record themselves; `run_shard` ones wait for `release`,
    so they sit in the queue as a busy worker's would."""

    def __init__(self) -> None:
        self.ran: list[tuple[str, tuple]] = []
        self.release = threading.Event()
        self.queue = InProcessQueue(self._run, lanes={"run_shard": 1})

    def _run(self, name: str, args: tuple) -> None:
        if name == "run_shard":
            self.release.wait()
        self.ran.append((name, args))

    def names(self) -> list[str]:
        return sorted(name for name, _ in self.ran)

    def stop(self) -> None:
        self.release.set()
        self.queue.shutdown()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str | None]:
    if request.param == "sqlite":
        yield None  # open_store's default: SQLite in the data directory
        return
    with postgres_schema(request.getfixturevalue("postgres_url")) as url:
        yield url


@pytest.fixture
def make_ctx(tmp_path: Path, database_url: str | None) -> Iterator:
    made: list[tuple[WorkerContext, Recorder]] = []

    def make(worker_id: str = "me", **settings: object) -> tuple[WorkerContext, Recorder]:
        config = Settings(data_dir=tmp_path / "data", database_url=database_url, **settings)
        session_factory, blobs = open_store(config)
        recorder = Recorder()
        ctx = WorkerContext(config, session_factory, blobs, recorder.queue, worker_id=worker_id)
        made.append((ctx, recorder))
        return ctx, recorder

    yield make
    for ctx, recorder in made:
        recorder.stop()
        ctx.session_factory.kw["bind"].dispose()


def add_batch(ctx: WorkerContext, batch_id: str, status: BatchStatus, **values: object) -> None:
    with transaction(ctx.session_factory) as session:
        session.add(
            Batch(
                id=batch_id,
                owner="default",
                endpoint="/v1/completions",
                input_file_id="file-x",
                completion_window="24h",
                status=status,
                **values,
            )
        )


def add_shard(ctx: WorkerContext, batch_id: str, index: int, **values: object) -> None:
    with transaction(ctx.session_factory) as session:
        session.add(Shard(batch_id=batch_id, owner="default", index=index, **values))


def add_succeeded_lines(ctx: WorkerContext, batch_id: str, lines: int) -> None:
    """`lines` lines of `batch_id` in its shard 0, `r0`..., each succeeded."""
    with transaction(ctx.session_factory) as session:
        session.add_all(
            BatchRequest(
                batch_id=batch_id,
                line=line,
                custom_id=f"r{line}",
                shard_index=0,
                body={},
                status=RequestStatus.SUCCEEDED,
            )
            for line in range(lines)
        )


def shard_states(ctx: WorkerContext) -> dict[int, str]:
    with ctx.session_factory() as session:
        return dict(session.execute(select(Shard.index, Shard.status)).all())


def set_last_seen(ctx: WorkerContext, worker_id: str, last_seen: float) -> None:
    with transaction(ctx.session_factory) as session:
        session.merge(WorkerHeartbeat(worker_id=worker_id, last_seen=last_seen))


def test_a_dead_workers_shards_are_re_leased_before_their_lease_lapses(make_ctx):
    ctx, recorder = make_ctx(worker_heartbeat_seconds=0.2, upkeep_interval_seconds=0.2)
    add_batch(ctx, "batch_x", BatchStatus.IN_PROGRESS)
    lease = {"status": ShardStatus.RUNNING, "lease_expires_at": time.time() + 60}
    add_shard(ctx, "batch_x", 0, lease_owner="dead", **lease)
    add_shard(ctx, "batch_x", 1, lease_owner="alive", **lease)
    add_shard(ctx, "batch_x", 2, lease_owner="never-beat", **lease)  # an older worker: its lease
    set_last_seen(ctx, "dead", time.time() - 1)  # five beats missed

    heartbeat(ctx)  # this process's first beat: it cannot yet tell an outage from a death
    set_last_seen(ctx, "alive", time.time())
    upkeep(ctx)
    assert shard_states(ctx) == {i: ShardStatus.RUNNING for i in range(3)}

    time.sleep(0.65)  # three beats of its own, as the live worker's
    heartbeat(ctx)
    set_last_seen(ctx, "alive", time.time())
    upkeep(ctx)
    assert shard_states(ctx) == {
        0: ShardStatus.PENDING,
        1: ShardStatus.RUNNING,
        2: ShardStatus.RUNNING,
    }
    recorder.stop()
    assert "run_shard" in recorder.names()  # the re-leased shard is queued


def test_upkeep_queues_again_the_work_a_broker_restart_lost(make_ctx):
    ctx, recorder = make_ctx(validation_redrive_seconds=60)
    add_batch(ctx, "batch_run", BatchStatus.IN_PROGRESS)
    for index in range(3):
        add_shard(ctx, "batch_run", index)  # pending, their tasks gone with the broker
    add_shard(ctx, "batch_run", 3, status=ShardStatus.DONE)
    add_batch(ctx, "batch_fin", BatchStatus.FINALIZING)
    add_batch(ctx, "batch_cancel", BatchStatus.CANCELLING)
    add_batch(ctx, "batch_done", BatchStatus.IN_PROGRESS)
    add_shard(ctx, "batch_done", 0, status=ShardStatus.DONE)
    add_batch(ctx, "batch_stuck", BatchStatus.VALIDATING, created_at=now() - 120)
    add_batch(ctx, "batch_new", BatchStatus.VALIDATING)  # its validation may well be running

    upkeep(ctx)
    time.sleep(0.2)  # the run_shard tasks start (one) and wait in their lane (two)
    assert sorted(recorder.ran) == sorted(
        [
            ("finalize_batch", ("batch_fin",)),
            ("finalize_batch", ("batch_cancel",)),
            ("finalize_batch", ("batch_done",)),
            ("validate_batch", ("batch_stuck",)),
        ]
    )
    assert recorder.queue.depths()["run_shard"] == 2  # and the third started
    # Queued shard runs are counted: however often upkeep runs, the queue never holds more
    # than there are pending shards.
    for _ in range(5):
        ctx.liveness.last_runs.clear()
        upkeep(ctx)
    assert recorder.queue.depths()["run_shard"] == 3


def test_one_process_at_a_time_runs_upkeep(make_ctx):
    first, first_queue = make_ctx("first")
    second, second_queue = make_ctx("second")
    add_batch(first, "batch_fin", BatchStatus.FINALIZING)
    with upkeep_lock(first.session_factory) as held:
        assert held
        upkeep(second)  # the lock is taken: nothing runs
        time.sleep(0.1)
        assert second_queue.ran == []
    upkeep(second)
    time.sleep(0.1)
    assert second_queue.ran == [("finalize_batch", ("batch_fin",))]


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_the_upkeep_lock_is_free_as_soon_as_its_holders_connection_drops(make_ctx):
    # A holder killed mid-round: PostgreSQL ends its session, and the lock with it.
    ctx, recorder = make_ctx()
    other = make_engine(ctx.settings.resolved_database_url)
    try:
        dead = other.connect()
        dead.execute(select(func.pg_try_advisory_lock(0x7570_6B65_6570)))
        with upkeep_lock(ctx.session_factory) as held:
            assert not held
        dead.invalidate()  # closes the socket, as a killed process's kernel does
        dead.close()
        with upkeep_lock(ctx.session_factory) as held:
            assert held
    finally:
        other.dispose()


def test_a_failing_job_is_logged_and_the_others_still_run(make_ctx, caplog):
    ctx, _ = make_ctx()
    # An expired file whose storage key blob storage refuses: deleting it fails every time.
    with transaction(ctx.session_factory) as session:
        session.add(
            File(
                id="file-bad",
                owner="default",
                filename="a",
                purpose="batch",
                bytes=1,
                expires_at=now() - 1,
                storage_key="files/.bad",
            )
        )
        session.add(
            IdempotencyKey(
                owner="default",
                route="batches",
                key="k",
                resource_id="x",
                created_at=now() - 2 * DAY,
            )
        )
    upkeep(ctx)
    assert "upkeep job delete_expired_files failed" in caplog.text
    with ctx.session_factory() as session:  # retention, which runs after it, ran
        assert session.scalar(select(func.count()).select_from(IdempotencyKey)) == 0


def test_upkeep_and_heartbeats_ride_out_a_database_outage(tmp_path, caplog):
    # A database that does not answer: a port nothing listens on.
    settings = Settings(
        data_dir=tmp_path, database_url="postgresql+psycopg://nobody@127.0.0.1:9/none"
    )
    factory = make_session_factory(make_engine(settings.resolved_database_url))
    recorder = Recorder()
    ctx = WorkerContext(settings, factory, blobs=None, queue=recorder.queue, worker_id="w1")
    ctx.liveness.beating_since = time.monotonic()
    try:
        heartbeat(ctx)
        upkeep(ctx)
        upkeep(ctx)  # and again: nothing was held over from the failed round
    finally:
        recorder.stop()
    assert ctx.liveness.beating_since is None  # so it trusts no heartbeat until it beats again
    assert "heartbeat of w1 failed" in caplog.text
    assert "upkeep skipped a round" in caplog.text


def test_retention_deletes_old_data_and_keeps_the_rest(make_ctx):
    ctx, _ = make_ctx()
    old, recent = now() - 31 * DAY, now() - 29 * DAY
    add_batch(ctx, "batch_old", BatchStatus.COMPLETED, completed_at=old)
    add_batch(ctx, "batch_recent", BatchStatus.COMPLETED, completed_at=recent)
    add_batch(ctx, "batch_running", BatchStatus.IN_PROGRESS, created_at=old)
    for batch_id in ("batch_old", "batch_recent", "batch_running"):
        add_succeeded_lines(ctx, batch_id, 3)
    hooks = [
        ("old", now() - 8 * DAY, WebhookMessageStatus.DELIVERED),
        ("pending", now() - 8 * DAY, WebhookMessageStatus.PENDING),
        ("recent", now() - 6 * DAY, WebhookMessageStatus.DELIVERED),
    ]
    for name, _, _ in hooks:
        add_batch(ctx, f"batch_{name}_hook", BatchStatus.COMPLETED, completed_at=now())
    with transaction(ctx.session_factory) as session:
        session.add(WebhookEndpoint(id="we_1", owner="default", url="https://x", secret="s"))
        for name, created, status in hooks:
            session.add(
                WebhookEvent(
                    id=f"evt_{name}",
                    owner="default",
                    type="batch.completed",
                    batch_id=f"batch_{name}_hook",
                    created_at=created,
                )
            )
            session.flush()
            session.add(
                WebhookMessage(
                    id=f"wh_{name}",
                    event_id=f"evt_{name}",
                    endpoint_id="we_1",
                    status=status,
                    next_attempt_at=0,
                )
            )
            session.flush()
            session.add(
                WebhookDelivery(
                    id=f"whd_{name}",
                    message_id=f"wh_{name}",
                    endpoint_id="we_1",
                    attempt=1,
                    outcome="failed",
                    created_at=created,
                )
            )
        for key, created in [("old", now() - 25 * 3600), ("recent", now() - 23 * 3600)]:
            session.add(
                IdempotencyKey(
                    owner="default", route="batches", key=key, resource_id="x", created_at=created
                )
            )
        for model, finished in [("old", now() - 401 * DAY), ("recent", now() - 399 * DAY)]:
            session.add(UsageRecord(owner="default", model=model, finished_at=finished))

    apply_retention(ctx)

    with ctx.session_factory() as session:
        requests = session.execute(
            select(BatchRequest.batch_id, func.count()).group_by(BatchRequest.batch_id)
        ).all()
        assert dict(requests) == {"batch_recent": 3, "batch_running": 3}
        assert session.get(Batch, "batch_old") is not None  # the batch object stays
        assert set(session.scalars(select(WebhookEvent.id))) == {"evt_pending", "evt_recent"}
        assert set(session.scalars(select(WebhookMessage.id))) == {"wh_pending", "wh_recent"}
        # A pending message's old attempts go; its message stays, for its next attempt.
        assert set(session.scalars(select(WebhookDelivery.id))) == {"whd_recent"}
        assert set(session.scalars(select(IdempotencyKey.key))) == {"recent"}
        assert set(session.scalars(select(UsageRecord.model))) == {"recent"}


def add_file(ctx: WorkerContext, file_id: str, purpose: str, created: int, **values: object) -> str:
    key = f"files/{file_id}"
    ctx.blobs.put(key, iter([b"{}\n"]))
    with transaction(ctx.session_factory) as session:
        session.add(
            File(
                id=file_id,
                owner="default",
                filename=f"{file_id}.jsonl",
                purpose=purpose,
                bytes=3,
                created_at=created,
                storage_key=key,
                **values,
            )
        )
    return key


def test_retention_expires_batch_outputs_and_their_blobs(make_ctx):
    ctx, _ = make_ctx()
    old, recent, later = now() - 31 * DAY, now() - 29 * DAY, now() + DAY
    keys = {
        "file-old-output": add_file(ctx, "file-old-output", "batch_output", old),
        "file-recent-output": add_file(ctx, "file-recent-output", "batch_output", recent),
        # The batch's output_expires_after set its own expiry; an upload has none and stays.
        "file-own-expiry": add_file(ctx, "file-own-expiry", "batch_output", old, expires_at=later),
        "file-upload": add_file(ctx, "file-upload", "user_data", old),
    }

    apply_retention(ctx)
    delete_expired_files(ctx)

    with ctx.session_factory() as session:
        expiry = dict(session.execute(select(File.id, File.expires_at)).all())
    assert expiry == {
        "file-recent-output": recent + 30 * DAY,  # shown to clients as the File's expires_at
        "file-own-expiry": later,
        "file-upload": None,
    }
    assert not ctx.blobs.exists(keys["file-old-output"])
    assert all(ctx.blobs.exists(keys[f]) for f in expiry)


def test_retention_purges_batches_long_finished(make_ctx):
    ctx, _ = make_ctx()
    ancient, old = now() - 401 * DAY, now() - 31 * DAY
    add_batch(ctx, "batch_ancient", BatchStatus.COMPLETED, completed_at=ancient)
    add_batch(ctx, "batch_cancelled", BatchStatus.CANCELLED, cancelled_at=ancient)
    add_batch(ctx, "batch_old", BatchStatus.COMPLETED, completed_at=old)
    add_batch(ctx, "batch_running", BatchStatus.IN_PROGRESS, created_at=ancient)
    for batch_id in ("batch_ancient", "batch_running"):
        add_shard(ctx, batch_id, 0, status=ShardStatus.DONE)
    add_succeeded_lines(ctx, "batch_ancient", 3)

    apply_retention(ctx)

    with ctx.session_factory() as session:
        assert set(session.scalars(select(Batch.id))) == {"batch_old", "batch_running"}
        assert session.scalar(select(func.count()).select_from(BatchRequest)) == 0
        assert set(session.scalars(select(Shard.batch_id))) == {"batch_running"}


def test_retention_set_to_zero_keeps_outputs_and_batches(make_ctx):
    ctx, _ = make_ctx(batch_output_retention_days=0, batch_retention_days=0)
    add_file(ctx, "file-old-output", "batch_output", now() - 999 * DAY)
    add_batch(ctx, "batch_ancient", BatchStatus.COMPLETED, completed_at=now() - 999 * DAY)

    apply_retention(ctx)
    delete_expired_files(ctx)

    with ctx.session_factory() as session:
        assert session.get(File, "file-old-output").expires_at is None
        assert session.get(Batch, "batch_ancient") is not None


def test_retention_deletes_expired_responses_and_their_blobs(make_ctx):
    ctx, _ = make_ctx()
    large = [{"id": "msg_big", "type": "message", "role": "user", "content": "x" * INLINE_BYTES}]
    for response_id, days_ago, retention in [
        ("resp_old", 31, 30),
        ("resp_recent", 29, 30),
        ("resp_kept", 999, 0),
    ]:
        record = ResponseRecord(
            id=response_id,
            owner="default",
            model="tiny",
            created_at=now() - days_ago * DAY,
            request={"model": "tiny"},
            input_items=large,
            body={"id": response_id, "status": "completed", "output": []},
        )
        save_response(ctx.session_factory, ctx.blobs, record, retention)
    with ctx.session_factory() as session:
        keys = dict(session.execute(select(StoredResponse.id, StoredResponse.blob_keys)).all())

    apply_retention(ctx)

    with ctx.session_factory() as session:
        assert set(session.scalars(select(StoredResponse.id))) == {"resp_recent", "resp_kept"}
    assert not ctx.blobs.exists(keys["resp_old"]["input_items"])
    assert all(ctx.blobs.exists(keys[r]["input_items"]) for r in ("resp_recent", "resp_kept"))


def running_tasks(ctx: WorkerContext) -> InProcessQueue:
    """A queue that runs each task for real, in `ctx`: the worker upkeep is part of."""
    return InProcessQueue(lambda name, args: run_task(ctx, name, args))


def test_a_batch_whose_lines_are_all_done_is_finalized_by_upkeep_when_its_finalization_was_lost(
    make_batch_worker,
):
    worker = make_batch_worker(shard_size=2)
    batch_id = submit(worker, [chat_line(f"r{i}") for i in range(4)])
    run_all_shards(worker, batch_id)
    # The last shard queued the finalization; the queue was lost (a broker restart, the worker
    # that took the task killed) and nothing ran it.
    assert ("finalize_batch", (batch_id,)) in worker.queued
    assert finished_batch(worker, batch_id).status == BatchStatus.IN_PROGRESS
    lost, worker.ctx.queue = worker.ctx.queue, running_tasks(worker.ctx)
    lost.shutdown()

    upkeep(worker.ctx)

    eventually(lambda: finished_batch(worker, batch_id).status == BatchStatus.COMPLETED, timeout=60)
    assert sorted(file_lines(worker, batch_id)) == sorted(f"r{i}" for i in range(4))


def test_a_batch_whose_worker_died_after_its_last_line_is_finalized_by_upkeep(make_batch_worker):
    worker = make_batch_worker(
        shard_size=2, worker_heartbeat_seconds=0.2, upkeep_interval_seconds=0.2
    )
    ctx = worker.ctx
    batch_id = submit(worker, [chat_line(f"r{i}") for i in range(4)])
    run_all_shards(worker, batch_id)
    # As a worker killed -9 after writing its shard's last result, before marking the shard done
    # or queueing the finalization: the shard is still leased to it, for a minute more.
    with transaction(ctx.session_factory) as session:
        session.execute(
            update(Shard)
            .where(Shard.batch_id == batch_id, Shard.index == 1)
            .values(status=ShardStatus.RUNNING, lease_owner="dead", lease_expires_at=now() + 60)
        )
    set_last_seen(ctx, "dead", time.time() - 10)
    lost, ctx.queue = ctx.queue, running_tasks(ctx)
    lost.shutdown()
    heartbeat(ctx)  # this process judges others' heartbeats once its own went through 3 beats
    time.sleep(0.65)
    heartbeat(ctx)

    upkeep(ctx)  # re-leases the dead worker's shard; its run finds every line done, finalizes

    eventually(lambda: finished_batch(worker, batch_id).status == BatchStatus.COMPLETED, timeout=60)
    assert sorted(file_lines(worker, batch_id)) == sorted(f"r{i}" for i in range(4))
