"""The project as a user installs it: a wheel built from a clean export, installed outside the
checkout, runs without the source tree.

An editable install (what the tests otherwise run) imports from the checkout, so a package or
data file missing from the wheel goes unnoticed there; these tests run the installed copy alone.
The installed copy runs under `python -S` with the environment's site-packages on PYTHONPATH:
the dependencies come from there, but its `.pth` files, among them the editable install's
finder, are never read, so nothing can be imported from the checkout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from harness import start_process, stop_processes
from servers import free_port, wait_for_health

ROOT = Path(__file__).resolve().parent.parent

# What ships beside the modules, and the module that reads it.
PACKAGE_DATA = [
    "api/static/index.html",  # the status page
    "kernels/cpu_attention.c",  # the CPU kernels, compiled on first use
    "kernels/cpu_rotary.c",
    "kernels/quant_formats.h",  # included by quant_matmul.c and quant_gemm.c
    "migrations/env.py",  # Alembic's, found as a file rather than imported
    "migrations/script.py.mako",
    "migrations/versions/0001_initial.py",
]

IMPORT_EVERY_MODULE = """
import importlib, pathlib, sys
import pagedbatch
root = pathlib.Path(pagedbatch.__file__).parent
assert root.parent == pathlib.Path(sys.argv[1]), root
names = sorted(
    ".".join(("pagedbatch", *path.relative_to(root).with_suffix("").parts))
    .removesuffix(".__init__")
    for path in root.rglob("*.py")
    if "versions" not in path.parts and path.name != "env.py"  # Alembic runs these, in its context
)
for name in names:
    importlib.import_module(name)
print(len(names))
"""


def export(destination: Path) -> None:
    """The files a clean clone of this working tree holds: tracked and untracked-not-ignored."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, listed):
        source = ROOT / os.fsdecode(name)
        if source.is_file():  # a tracked file deleted in the working tree is not exported
            target = destination / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of a clean export, installed (without dependencies) into an empty folder."""
    tmp = tmp_path_factory.mktemp("wheel")
    export(tmp / "src")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    # The build runs with the environment's setuptools: an isolated build would fetch one.
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp / "dist", tmp / "src"],
        check=True,
    )
    (wheel,) = (tmp / "dist").glob("pagedbatch-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", tmp / "site", wheel], check=True)
    return tmp / "site"


def isolated_env(site: Path, tmp: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]]),
        # The kernels compile from the wheel's C sources, not from a cache of the checkout's.
        "XDG_CACHE_HOME": str(tmp / "cache"),
    }


def test_the_wheel_holds_every_package_and_its_data_files(installed: Path) -> None:
    for name in PACKAGE_DATA:
        assert (installed / "pagedbatch" / name).is_file(), name
    # Every folder of modules in the checkout's units is a package in the wheel.
    units = ["pagedbatch", "api", "engine", "kernels", "migrations", "store", "workers"]
    for unit in units:
        for module in (ROOT / unit).rglob("*.py"):
            relative = module.relative_to(ROOT / unit)
            inside = relative if unit == "pagedbatch" else Path(unit) / relative
            assert (installed / "pagedbatch" / inside).is_file(), f"{unit}/{relative}"


def test_every_module_of_the_installed_wheel_imports(installed: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-S", "-c", IMPORT_EVERY_MODULE, str(installed)],
        env=isolated_env(installed, tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert int(done.stdout) > 100


def test_the_installed_wheel_serves_a_chat(installed: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    argv = [sys.executable, "-S", "-m", "pagedbatch.cli", "serve", "--port", str(port)]
    argv += ["--data-dir", str(tmp_path / "data")]
    server = start_process(argv, isolated_env(installed, tmp_path), log, cwd=tmp_path)
    try:
        wait_for_health(url, server, log)
        import openai

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        (model,) = client.models.list().data
        chat = client.chat.completions.create(
            model=model.id, messages=[{"role": "user", "content": "Hello"}], max_tokens=4
        )
        assert chat.choices[0].message.content
        assert chat.usage.completion_tokens > 0
    finally:
        stop_processes([server])
    assert "Traceback" not in log.read_text(errors="replace")
