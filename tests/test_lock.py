"""The lock, constraints.txt: the versions CI passed with. Every install takes them (the Makefile,
and with it `.ci/run`; docker/Dockerfile is checked in test_compose.py), and the virtual
environment the tests run in holds exactly them, so what passes here is what a fresh install
gets. After a deliberate change of versions, `make lock` writes the lock anew."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from commands import python_output

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "constraints.txt"


def pins(lines: Iterable[str]) -> dict[str, str]:
    """`{name: version}` of `name==version` lines, names normalized as pip compares them and
    versions without a local label (torch's `+cpu`: the lock matches the CUDA build too)."""
    found: dict[str, str] = {}
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-e "):
            continue
        name, exact, version = line.partition("==")
        assert exact and version, f"not an exact pin: {raw!r}"
        found[re.sub(r"[-_.]+", "-", name).lower()] = version.split("+", 1)[0]
    return found


def test_the_virtual_environment_holds_exactly_the_locked_versions() -> None:
    freeze = python_output("-m", "pip", "freeze", "--exclude-editable", timeout=120)
    installed = pins(freeze.splitlines())
    installed.pop("pagedbatch", None)  # the project itself, when installed as a wheel
    locked = pins(LOCK.read_text().splitlines())
    differences = {
        name: {"locked": locked.get(name), "installed": installed.get(name)}
        for name in sorted(locked.keys() | installed.keys())
        if locked.get(name) != installed.get(name)
    }
    assert not differences, (
        f"the virtual environment is not the lock: {differences}. Install from the lock "
        "(`make install`; a package the lock lacks: `pip uninstall` it), or, to change versions "
        "on purpose, `make lock` after a passing `make test`"
    )


def test_the_lock_pins_the_torch_that_pyproject_pins() -> None:
    (pinned,) = re.findall(r'"torch==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert pins(LOCK.read_text().splitlines())["torch"] == pinned


def test_every_install_in_the_makefile_takes_the_lock() -> None:
    makefile = (ROOT / "Makefile").read_text()
    installs = re.findall(r"^\t.*pip install.*$", makefile, re.MULTILINE)  # recipe lines
    assert installs
    assert all(" -c $(LOCK) " in install for install in installs), installs
    assert re.search(r"^LOCK := constraints\.txt$", makefile, re.MULTILINE)
