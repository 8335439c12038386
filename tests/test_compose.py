"""compose.yaml, the distributed deployment: valid by the Compose Specification's JSON schema, and
consistent with the code it runs: real settings, commands the CLI accepts, addresses and
credentials that agree across services, and the image's torch pin.

No Docker engine is needed: the stack itself is not started here.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from commands import python_output
from sqlalchemy import make_url

from pagedbatch.cli import build_parser, settings_from_args
from pagedbatch.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
# The services that run pagedbatch, and the subcommand each runs.
PAGEDBATCH = {"migrate": "db", "api": "serve", "worker": "worker"}
STORES = ("postgres", "redis", "s3")

# `${NAME}`, `${NAME:-default}` and `${NAME-default}`, as Compose interpolates them.
_VARIABLE = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::?-(?P<default>[^}]*))?\}")


def _with_defaults(node: Any) -> Any:
    """`node` as Compose reads it with none of its variables set: each takes its default."""
    if isinstance(node, str):
        return _VARIABLE.sub(lambda match: match["default"] or "", node)
    if isinstance(node, dict):
        return {key: _with_defaults(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_with_defaults(item) for item in node]
    return node


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return _with_defaults(yaml.safe_load(COMPOSE.read_text()))


def test_it_is_valid_by_the_compose_specification() -> None:
    python_output(
        "-m",
        "check_jsonschema",
        "--builtin-schema",
        "vendor.compose-spec",
        str(COMPOSE),
        timeout=60,
    )


@pytest.mark.parametrize("path", [COMPOSE, DOCKERFILE], ids=lambda path: path.name)
def test_every_pagedbatch_variable_is_a_setting(path: Path) -> None:
    used = set(re.findall(r"PAGEDBATCH_[A-Z0-9_]+", path.read_text()))
    settings = {f"PAGEDBATCH_{name.upper()}" for name in Settings.model_fields}
    assert used
    assert used <= settings, f"not settings: {sorted(used - settings)}"


@pytest.mark.parametrize("service", PAGEDBATCH)
def test_each_process_runs_a_real_command_on_the_distributed_stores(
    service: str, compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    services = compose["services"]
    definition = services[service]
    for name in [name for name in os.environ if name.startswith("PAGEDBATCH_")]:
        monkeypatch.delenv(name)
    for name, value in definition["environment"].items():
        monkeypatch.setenv(name, str(value))

    args = build_parser().parse_args(definition["command"])
    assert args.command == PAGEDBATCH[service]
    settings = settings_from_args(args)
    assert settings.distributed

    database = make_url(settings.resolved_database_url)
    postgres = services["postgres"]["environment"]
    assert database.drivername == "postgresql+psycopg"
    assert (database.host, database.username, database.password, database.database) == (
        "postgres",
        postgres["POSTGRES_USER"],
        postgres["POSTGRES_PASSWORD"],
        postgres["POSTGRES_DB"],
    )
    assert settings.broker_url is not None and urlsplit(settings.broker_url).hostname == "redis"
    assert settings.s3_endpoint_url is not None and settings.s3_bucket
    assert urlsplit(settings.s3_endpoint_url).hostname == "s3"

    # boto3 signs with these; the S3 server must know them.
    identities = json.loads(compose["configs"]["s3-identities"]["content"])["identities"]
    credentials = [c for identity in identities for c in identity["credentials"]]
    environment = definition["environment"]
    assert {
        "accessKey": environment["AWS_ACCESS_KEY_ID"],
        "secretKey": environment["AWS_SECRET_ACCESS_KEY"],
    } in credentials
    assert environment["AWS_DEFAULT_REGION"]


def test_servers_start_once_the_stores_are_healthy_and_migrated(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    for name in ("api", "worker"):
        conditions = {
            dependency: condition["condition"]
            for dependency, condition in services[name]["depends_on"].items()
        }
        assert conditions == {
            **dict.fromkeys(STORES, "service_healthy"),
            "migrate": "service_completed_successfully",
        }
    for name in STORES:
        assert services[name]["healthcheck"]["test"][0] == "CMD"


def test_the_api_is_published_on_the_port_it_listens_on(compose: dict[str, Any]) -> None:
    (mapping,) = compose["services"]["api"]["ports"]
    (image_port,) = re.findall(r"PAGEDBATCH_PORT=(\d+)", DOCKERFILE.read_text())
    assert mapping.rsplit(":", 1)[1] == image_port


def test_the_worker_has_a_gpu_and_no_singleton_role(compose: dict[str, Any]) -> None:
    services = compose["services"]
    # Every worker runs upkeep under a database lock: none may be special, so any can be copied.
    assert services["worker"]["command"] == ["worker"]
    (device,) = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert device == {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}


def test_a_supervisor_restarts_every_long_running_process(compose: dict[str, Any]) -> None:
    # A worker exits when its engine dies (status 70) and whenever Celery gives up; the API and
    # the stores must come back too. Only the one-shot migration is left alone once it is done.
    services = compose["services"]
    for name, service in services.items():
        if name == "migrate":
            assert service["restart"] == "no"
        else:
            assert service["restart"] in {"always", "unless-stopped"}, name


def test_the_worker_command_asks_for_the_supervisor_compose_gives_it() -> None:
    shown = python_output("-m", "pagedbatch.cli", "worker", "--help", timeout=60)
    assert "supervisor" in shown and "restart: unless-stopped" in " ".join(shown.split())


def test_the_image_installs_the_locked_versions() -> None:
    dockerfile = DOCKERFILE.read_text()
    copied = {
        name for line in re.findall(r"^COPY (.+)$", dockerfile, re.M) for name in line.split()
    }
    assert "constraints.txt" in copied
    (install,) = re.findall(r"pip install -c (\S+) \.(?:\s|$)", dockerfile)
    # The lock less triton (the CPU install's; the CUDA torch pins its own), nothing else.
    assert f"grep -v '^triton==' constraints.txt > {install}" in dockerfile


def test_the_image_pins_the_torch_that_pyproject_pins() -> None:
    (pinned,) = re.findall(r'"(torch==[^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert re.findall(r"pip install (torch==\S+)", DOCKERFILE.read_text()) == [pinned]
