"""Dependencies point one way (docs/architecture.md): the doors (api) and the workers use the OpenAI
translation (protocol), the store and the engine, and never each other; the engine knows nothing
of HTTP, SQL, Celery or OpenAI; only the entry points (CLI, service assembly, offline batch mode)
see everything. Every import counts, including those inside functions and under TYPE_CHECKING."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Source folder of each unit's modules, as setup.py maps them.
FOLDERS = {
    "pagedbatch.api": "api",
    "pagedbatch.workers": "workers",
    "pagedbatch.store": "store",
    "pagedbatch.engine": "engine",
    "pagedbatch.kernels": "kernels",
    "pagedbatch.migrations": "migrations",
    "pagedbatch": "pagedbatch",
}
ENTRY_POINTS = {"pagedbatch.cli", "pagedbatch.service", "pagedbatch.run_batch"}
# What each unit may import besides itself. "common" is the rest of the pagedbatch package:
# settings, ids, addresses, logs, egress rules, model making.
MAY_IMPORT = {
    "kernels": set(),
    "engine": {"kernels"},
    "common": {"engine", "kernels"},
    "protocol": {"common", "engine"},
    "store": {"common"},
    "migrations": {"common", "store"},
    "api": {"protocol", "store", "engine", "common"},
    "workers": {"protocol", "store", "engine", "common"},
}


def unit(module: str) -> str | None:
    """The unit `module` belongs to; None for the entry points and for outside packages."""
    if module in ENTRY_POINTS or not (module == "pagedbatch" or module.startswith("pagedbatch.")):
        return None
    parts = module.split(".")
    if len(parts) == 1:
        return "common"
    if parts[1] in {"api", "workers", "store", "engine", "kernels", "migrations", "protocol"}:
        return parts[1]
    return "common"


@functools.cache
def modules() -> dict[str, Path]:
    found = {}
    for package, folder in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            relative = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in relative.parts if p != "__init__"]
            name = ".".join([package, *parts])
            found.setdefault(name, path)  # pagedbatch/ is walked last: subpackages win
    return found


def imported(module: str, path: Path) -> set[str]:
    """Every module of ours that `path` imports, resolving relative imports."""
    names = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return {n for n in names if n == "pagedbatch" or n.startswith("pagedbatch.")}


def test_the_layout_is_found():
    found = modules()
    assert {"pagedbatch.api.app", "pagedbatch.engine.llm_engine", "pagedbatch.cli"} <= set(found)
    assert any(unit(name) == "protocol" for name in found)


@pytest.mark.parametrize("module", sorted(modules()))
def test_imports_point_one_way(module: str):
    importer = unit(module)
    if importer is None:
        return
    allowed = MAY_IMPORT[importer] | {importer}
    wrong = sorted(
        name
        for name in imported(module, modules()[module])
        if unit(name) is not None and unit(name) not in allowed
    )
    assert not wrong, f"{module} ({importer}) imports {wrong}"


# Within the engine, as vLLM v1 lays it out: the scheduler and KV cache (core), the model and its
# weights (worker), sampling (sample), metrics and media each a subpackage, under the front doors
# (LLM, AsyncLLM, LLMEngine, EngineCore) at the top, which assemble them. What each subpackage may
# import besides itself; "plain" is the engine's plain-data modules at the top (settings, sampling
# parameters, outputs). No subpackage imports a front door, nor metrics, which only watch.
ENGINE_PLAIN = {"config", "sampling_params", "pooling_params", "outputs"}
ENGINE_MAY_IMPORT = {
    "core": {"multimodal", "plain"},
    # The model runner scores the prompt rows a request asks logprobs of (sample's
    # prompt_logprobs) beside its logits, as vLLM v1's runner holds its sampler.
    # The model runner's linears add the served LoRA adapters' deltas (lora).
    "worker": {"core", "lora", "multimodal", "sample", "plain"},
    "sample": {"core", "plain"},
    "metrics": {"core", "plain"},
    "multimodal": {"plain"},
    "lora": {"core", "plain"},
}


def engine_part(module: str) -> str | None:
    """The engine subpackage `module` belongs to, "plain", "front", or None outside the engine."""
    parts = module.split(".")
    if parts[:2] != ["pagedbatch", "engine"] or len(parts) < 3:
        return None
    if parts[2] in ENGINE_MAY_IMPORT:
        return parts[2]
    return "plain" if parts[2] in ENGINE_PLAIN else "front"


def test_the_engine_is_grouped_into_its_subpackages():
    parts = {engine_part(name) for name in modules()}
    assert set(ENGINE_MAY_IMPORT) <= parts
    # A new engine module goes into the subpackage of its idea, not beside the front doors.
    front = sorted(n for n in modules() if engine_part(n) == "front")
    assert len(front) <= 10, front


@pytest.mark.parametrize(
    "module", sorted(n for n in modules() if engine_part(n) in ENGINE_MAY_IMPORT)
)
def test_engine_subpackages_import_one_way(module: str):
    importer = engine_part(module)
    allowed = ENGINE_MAY_IMPORT[importer] | {importer}
    wrong = sorted(
        name
        for name in imported(module, modules()[module])
        if engine_part(name) is not None and engine_part(name) not in allowed
    )
    assert not wrong, f"{module} ({importer}) imports {wrong}"


def test_a_forbidden_direction_is_caught(tmp_path):
    """The check itself: an api module importing a workers module is reported."""
    path = tmp_path / "bad.py"
    path.write_text("from pagedbatch.workers.context import WorkerContext\n")
    assert unit("pagedbatch.workers.context") not in MAY_IMPORT["api"]
    assert "pagedbatch.workers.context" in imported("pagedbatch.api.bad", path)
    assert engine_part("pagedbatch.engine.llm_engine") not in ENGINE_MAY_IMPORT["core"]


def test_run_from_the_checkout_root_our_folders_hide_no_installed_package():
    # `python -c` puts the checkout's root first on sys.path, where `kernels/` would shadow the
    # installed `kernels` that transformers imports (the serve test of the engine settings died
    # of it); importing pagedbatch takes the root off the path.
    script = (
        "import pagedbatch, importlib.util;"
        "spec = importlib.util.find_spec('kernels');"
        "print(spec.origin if spec else None)"
    )
    found = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert not found.startswith(str(ROOT / "kernels")), found
