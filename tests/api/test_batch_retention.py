"""Retention as a client sees it (workers/retention.py): a finished batch's output file shows when
it expires, and is gone, bytes included, once it has; a batch purged long after it ended is a 404.
Time is moved by backdating the job store's rows, not by waiting."""

from __future__ import annotations

import openai
import pytest
from servers import STORAGES, chat_lines, wait_for_batch
from sqlalchemy import update

from pagedbatch.store.db import transaction
from pagedbatch.store.models import Batch, File
from pagedbatch.workers.periodic import delete_expired_files
from pagedbatch.workers.retention import apply_retention

DAY = 24 * 3600


@pytest.mark.parametrize("storage", STORAGES, indirect=True)
def test_outputs_expire_and_purged_batches_are_gone(serve_batches):
    server = serve_batches()
    ctx = server.embedded.context
    client = server.client()
    upload = client.files.create(file=("in.jsonl", chat_lines(2, 2)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = wait_for_batch(client, batch.id, lambda b: b.status == "completed")
    output = client.files.retrieve(batch.output_file_id)
    assert any(key.startswith(f"batches/{batch.id}/") for key in server.blob_keys())
    # Shown from the moment the file is written, not from upkeep's next round.
    assert output.expires_at == output.created_at + 30 * DAY

    apply_retention(ctx)
    assert client.files.retrieve(output.id).expires_at == output.created_at + 30 * DAY

    with transaction(ctx.session_factory) as session:  # 31 days on
        session.execute(
            update(File).where(File.id == output.id).values(expires_at=File.expires_at - 31 * DAY)
        )
    delete_expired_files(ctx)
    with pytest.raises(openai.NotFoundError):
        client.files.content(output.id)
    assert not any(key.startswith(f"batches/{batch.id}/") for key in server.blob_keys())
    assert client.batches.retrieve(batch.id).id == batch.id  # the batch itself stays

    with transaction(ctx.session_factory) as session:  # 401 days on
        session.execute(
            update(Batch)
            .where(Batch.id == batch.id)
            .values(completed_at=Batch.completed_at - 401 * DAY)
        )
    apply_retention(ctx)
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve(batch.id)
    assert client.batches.list().data == []
