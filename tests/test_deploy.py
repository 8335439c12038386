"""The monitoring files of the deployment (deploy/): Prometheus accepts the scrape config, which
scrapes the processes compose.yaml runs, where they serve /metrics; the Grafana dashboard is
valid PromQL on the provisioned data source. That it names only metrics the code exports is
checked against a live scrape, in tests/api/test_metrics_endpoint.py, with `dashboard_metric_names`.

promtool comes from Debian's `prometheus` package (.ci/run installs it).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from pagedbatch.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
SCRAPE_CONFIG = DEPLOY / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboard.json"
PROVISIONING = DEPLOY / "grafana" / "provisioning"
# What Grafana puts in place of the dashboard's variables before Prometheus sees a query.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$model_name": ".*"}
_METRIC = re.compile(r"pagedbatch:[A-Za-z0-9_:]+")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    path = shutil.which("promtool")
    assert path, "promtool is missing: apt-get install prometheus (.ci/run does)"
    return subprocess.run([path, *args], capture_output=True, text=True, timeout=60)


def dashboard_queries() -> list[str]:
    """Every PromQL query of the dashboard: its panels' and its variables'."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [
        target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])
    ]
    for variable in dashboard["templating"]["list"]:
        queries.append(variable["query"]["query"])
    return queries


def dashboard_metric_names() -> set[str]:
    return {name for query in dashboard_queries() for name in _METRIC.findall(query)}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_promtool_accepts_the_scrape_config() -> None:
    result = promtool("check", "config", str(SCRAPE_CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr


def test_it_scrapes_the_api_and_the_worker_where_they_serve_metrics(
    compose: dict[str, Any],
) -> None:
    jobs = {
        job["job_name"]: [t for c in job["static_configs"] for t in c["targets"]]
        for job in yaml.safe_load(SCRAPE_CONFIG.read_text())["scrape_configs"]
    }
    (api_port,) = re.findall(r"PAGEDBATCH_PORT=(\d+)", (ROOT / "docker" / "Dockerfile").read_text())
    assert jobs == {
        "pagedbatch-api": [f"api:{api_port}"],
        "pagedbatch-worker": [f"worker:{Settings.model_fields['worker_metrics_port'].default}"],
    }
    services = compose["services"]
    # Neither process changes the port in compose.yaml.
    for name in ("api", "worker"):
        assert "PAGEDBATCH_WORKER_METRICS_PORT" not in str(services[name])
    prometheus = services["prometheus"]
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    mounts = dict(volume.removesuffix(":ro").split(":", 1) for volume in grafana["volumes"])
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    (source,) = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert (source["type"], source["url"]) == ("prometheus", "http://prometheus:9090")
    (provider,) = yaml.safe_load((PROVISIONING / "dashboards" / "pagedbatch.yml").read_text())[
        "providers"
    ]
    assert Path(mounts["./deploy/grafana/dashboard.json"]).parent == Path(
        provider["options"]["path"]
    )

    dashboard = json.loads(DASHBOARD.read_text())
    panels = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    assert len(panels) >= 15
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": source["uid"]}, panel["title"]
        assert panel["targets"], panel["title"]


def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    rules = []
    for i, query in enumerate(dashboard_queries()):
        for variable, value in GRAFANA_VARIABLES.items():
            query = query.replace(variable, value)
        assert "$" not in query, query
        # Grafana's label_values() is not PromQL: Prometheus sees the metric it names.
        query = re.sub(r"^label_values\((\S+), \w+\)$", r"\1", query)
        rules.append({"record": f"dashboard:query_{i}", "expr": query})
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout
