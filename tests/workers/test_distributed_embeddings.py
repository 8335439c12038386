"""Embeddings in the distributed deployment: every worker runs the embedding model beside its own,
the API (which runs no engine) lists it, forwards its realtime requests to a worker's engine host
and takes `/v1/embeddings` batches, which the worker runs on it; a Matryoshka model's
`dimensions` are honoured through all of that."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import openai
import pytest
from servers import (
    PROCESS_START_SECONDS,
    Deployment,
    distributed_deployment,
    eventually,
    wait_for_batch,
)

TEXTS = ["The cat sat on the mat.", "A second, rather longer sentence about dogs."]


@pytest.fixture
def matryoshka(make_checkpoint):
    return make_checkpoint("bert", matryoshka_dimensions=[16, 32])


@pytest.fixture
def deployment(
    tmp_path, tiny_llama, matryoshka, postgres_url, s3_settings_env
) -> Iterator[Deployment]:
    settings = {"PAGEDBATCH_EMBEDDING_MODEL": str(matryoshka)}
    with distributed_deployment(tmp_path, tiny_llama, postgres_url, settings) as deployment:
        yield deployment


def test_the_workers_embed_realtime_and_batch_requests(deployment, matryoshka):
    client = deployment.client()
    model = matryoshka.name
    assert model in [m.id for m in client.models.list()]
    deployment.start_worker("worker")

    def served() -> bool:
        try:
            client.embeddings.create(model=model, input="ready?")
        except openai.InternalServerError:
            return False
        return True

    eventually(served, timeout=PROCESS_START_SECONDS)
    full = [item.embedding for item in client.embeddings.create(model=model, input=TEXTS).data]
    cut = client.embeddings.create(model=model, input=TEXTS, dimensions=16)
    for vector, short in zip(full, cut.data, strict=True):
        head = np.array(vector[:16])
        np.testing.assert_allclose(short.embedding, head / np.linalg.norm(head), atol=1e-5)
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=model, input=TEXTS, dimensions=8)
    assert caught.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError) as caught:  # the main model embeds nothing
        client.embeddings.create(model="tiny", input=TEXTS)
    assert caught.value.body["param"] == "model"

    lines = [
        {
            "custom_id": f"e{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": model, "input": text, "dimensions": 16, "encoding_format": "float"},
        }
        for i, text in enumerate(TEXTS)
    ]
    upload = ("in.jsonl", "\n".join(json.dumps(line) for line in lines).encode())
    file_id = client.files.create(file=upload, purpose="batch").id
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h"
    )
    batch = wait_for_batch(client, batch.id, lambda b: b.status in {"completed", "failed"})
    assert batch.status == "completed" and batch.request_counts.completed == len(TEXTS)
    output = map(json.loads, client.files.content(batch.output_file_id).text.splitlines())
    by_id = {line["custom_id"]: line["response"]["body"]["data"][0] for line in output}
    batched = [by_id[f"e{i}"]["embedding"] for i in range(len(TEXTS))]
    np.testing.assert_allclose(batched, [item.embedding for item in cut.data], atol=1e-5)
