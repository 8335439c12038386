"""schemathesis against the service's own `/openapi.json`, on a live embedded server.

Every operation gets generated requests (valid ones, invalid ones where its parameters admit any,
and valid ones naming objects that exist: files, batches, the served model), and every response
must be no 5xx, have a status the document lists for it, and have the content type and body
schema it documents, errors included.

The pytest plugin's `from_fixture` cannot serve here (it breaks on pytest 9), so each operation's
cases come from its Hypothesis strategy, one subtest per operation and kind of input.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.strategies import SearchStrategy
from schemathesis import Case
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.schemas import APIOperation
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from servers import STORAGES, BatchServer, Server

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
# Per operation and kind of input: about 600 requests in all, well under a minute on two cores.
EXAMPLES = 25
# Generated lengths run to thousands of tokens, which would take the test's time on a CPU;
# a few tokens show the same response shapes.
GENERATION_CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "n": 2, "best_of": 2}
REQUEST_TIMEOUT_SECONDS = 30

# Shrinking would replay failures for minutes; the first failing example is reported as found.
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)


@dataclass
class Known:
    """Objects that exist on the server, so that generated requests reach past the 404s."""

    file_id: str
    batch_id: str
    model: str
    # What the operations that end an object get instead, leaving the others their objects.
    doomed_file_id: str
    doomed_batch_id: str  # a long batch, still running when it is cancelled

    def path_parameters(self, operation: APIOperation) -> dict[str, str]:
        ends = operation.method == "delete" or operation.path.endswith("/cancel")
        known = {
            "file_id": self.doomed_file_id if ends else self.file_id,
            "batch_id": self.doomed_batch_id if ends else self.batch_id,
            "model": self.model,
        }
        return {p.name: known[p.name] for p in operation.path_parameters if p.name in known}

    def in_body(self, case: Case) -> Case:
        """`case` with the objects its body names replaced by known ones."""
        if not isinstance(case.body, dict):
            return case
        body = dict(case.body)
        if "input_file_id" in body:
            body["input_file_id"] = self.file_id
        if "model" in body:
            body["model"] = self.model
            for name, cap in GENERATION_CAPS.items():
                # JSON's 87.0 is a valid n too.
                if isinstance(body.get(name), int | float):
                    body[name] = min(body[name], cap)
            if "max_completion_tokens" not in body:
                body.setdefault("max_tokens", GENERATION_CAPS["max_tokens"])
        case.body = body
        return case


@pytest.mark.parametrize("storage", ["embedded"], indirect=True)
def test_every_operation_keeps_to_the_openapi_document(
    serve_batches: Callable[..., BatchServer], subtests: pytest.Subtests
) -> None:
    server = serve_batches()
    known = _create_objects(server)
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    labels = {operation.label for operation in operations}
    assert {"POST /v1/files", "GET /v1/files/{file_id}/content", "POST /v1/batches"} <= labels

    for operation in operations:
        for kind, strategy in _strategies(operation, known).items():
            with subtests.test(msg=f"{operation.label}: {kind}"):
                _fuzz(strategy)


def _strategies(operation: APIOperation, known: Known) -> dict[str, SearchStrategy[Case]]:
    strategies = {"valid input": operation.as_strategy()}
    # A plain string path parameter accepts anything, so only query, header and body
    # parameters can be sent invalid; asking for invalid input without them cannot succeed.
    if operation.query or operation.headers or operation.body:
        strategies["invalid input"] = operation.as_strategy(GenerationMode.NEGATIVE)
    path_parameters = known.path_parameters(operation)
    if path_parameters or {"input_file_id", "model"} & _json_body_fields(operation):
        strategies["known objects"] = operation.as_strategy(path_parameters=path_parameters).map(
            known.in_body
        )
    return strategies


def _json_body_fields(operation: APIOperation) -> set[str]:
    content = operation.definition.raw.get("requestBody", {}).get("content", {})
    return set(content.get("application/json", {}).get("schema", {}).get("properties", {}))


def _fuzz(strategy: SearchStrategy[Case]) -> None:
    @FUZZ
    @given(case=strategy)
    def check(case: Case) -> None:
        case.call_and_validate(checks=CHECKS, timeout=REQUEST_TIMEOUT_SECONDS)

    check()


def _create_objects(server: BatchServer) -> Known:
    with server.http() as http:

        def upload(lines: int, max_tokens: int) -> str:
            line = {
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "tiny", "prompt": "Hello", "max_tokens": max_tokens},
            }
            content = "".join(
                json.dumps({"custom_id": f"r{i}", **line}) + "\n" for i in range(lines)
            )
            files = {"file": ("input.jsonl", content.encode())}
            return _ok(http.post("/v1/files", data={"purpose": "batch"}, files=files))["id"]

        def create_batch(input_file_id: str) -> str:
            body = {
                "input_file_id": input_file_id,
                "endpoint": "/v1/completions",
                "completion_window": "24h",
            }
            return _ok(http.post("/v1/batches", json=body))["id"]

        file_id = upload(lines=1, max_tokens=2)
        # Minutes of work on two cores, so that the cancel finds it running.
        doomed_batch_id = create_batch(upload(lines=64, max_tokens=512))
        return Known(
            file_id=file_id,
            batch_id=create_batch(file_id),
            model="tiny",
            doomed_file_id=upload(lines=1, max_tokens=2),
            doomed_batch_id=doomed_batch_id,
        )


def _ok(response: Any) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("storage", STORAGES, indirect=True)
def test_a_nul_character_is_a_400_on_every_store(server: Server) -> None:
    """PostgreSQL text cannot hold NUL: such ids, filters and file names were 500s there, while
    SQLite found nothing. Generated strings seldom hold a NUL, so they are sent here by hand."""
    with server.http() as http:
        responses = {
            "file_id": http.get("/v1/files/file-1%00"),
            "batch_id": http.post("/v1/batches/batch_1%00/cancel"),
            "after": http.get("/v1/batches", params={"after": "batch_1\x00"}),
            "purpose": http.get("/v1/files", params={"purpose": "batch\x00"}),
            "input_file_id": http.post(
                "/v1/batches",
                json={
                    "input_file_id": "file-1\x00",
                    "endpoint": "/v1/completions",
                    "completion_window": "24h",
                },
            ),
            # By hand: clients percent-encode a NUL in a file name.
            "file": http.post(
                "/v1/files",
                content=(
                    b"--b\r\n"
                    b'Content-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
                    b"--b\r\n"
                    b'Content-Disposition: form-data; name="file"; filename="in\x00.jsonl"\r\n'
                    b"\r\n{}\n\r\n"
                    b"--b--\r\n"
                ),
                headers={"content-type": "multipart/form-data; boundary=b"},
            ),
        }
    for param, response in responses.items():
        assert response.status_code == 400, (param, response.text)
        assert response.json()["error"]["param"] == param
    assert server.blob_keys() == []


def test_a_method_the_document_does_not_list_is_a_405_allowing_those_it_does(
    server: Server,
) -> None:
    """Found by schemathesis' method checks: the Allow header named only one route's methods."""
    with server.http() as http:
        paths = http.get("/openapi.json").json()["paths"]
        for template, operations in paths.items():
            if "put" in operations:
                continue
            path = re.sub(r"\{[^}]+\}", "x", template)
            response = http.request("PUT", path)
            assert response.status_code == 405, (path, response.text)
            assert response.json()["error"]["code"] == "method_not_allowed"
            allowed = {method.strip() for method in response.headers["allow"].split(",")}
            assert allowed == {method.upper() for method in operations}, path
