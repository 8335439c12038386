"""The wheel folder a device call carries: the project's dependencies that the device image lacks.

The device machine has no network. Its image holds torch, triton, transformers and much else
(image_packages.txt); what the project needs beyond that is found here by walking the project's
requirements from its installed metadata, stopping at anything the image has (its own version is
used, and its dependencies are its own business). Each missing distribution comes at the version
this environment holds (the lock's), as a wheel for the image's Python (CPython 3.12, manylinux
x86-64), downloaded by pip; one with no such wheel is built here, which only works for pure Python.

The folder keeps a manifest of what it holds: a second build with the same needs downloads nothing.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

HERE = Path(__file__).resolve().parent
IMAGE_PACKAGES = HERE / "image_packages.txt"
MANIFEST = "wheels.json"
CARRY_LIMIT_BYTES = 64 * 2**20  # the device call's limit on all it carries, the tree included
# The image's interpreter and the platforms its pip accepts (as the device README gives them).
PYTHON_VERSION = "3.12"
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
TARGET_TAGS = [
    "--python-version", PYTHON_VERSION,
    "--implementation", "cp",
    "--abi", "cp312",
    *(arg for platform in PLATFORMS for arg in ("--platform", platform)),
]  # fmt: skip


class WheelsUnavailable(RuntimeError):
    """pip could not fetch or build a wheel (offline, or no wheel for the image's Python)."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages() -> set[str]:
    lines = IMAGE_PACKAGES.read_text().splitlines()
    return {canonical(line) for line in lines if line.strip() and not line.startswith("#")}


def missing_from_image(project: str = "pagedbatch") -> dict[str, str]:
    """{distribution: version here} for every runtime dependency of `project`, direct or not,
    that the image lacks."""
    try:
        metadata.distribution(project)
    except metadata.PackageNotFoundError:
        raise WheelsUnavailable(
            f"{project} is not installed in {sys.prefix}: build the wheels with the project's "
            "environment (.venv/bin/python scripts/gpu-check --build-wheels)"
        ) from None
    have = image_packages()
    found: dict[str, str] = {}

    def walk(name: str, extras: tuple[str, ...]) -> None:
        dist = metadata.distribution(name)
        for line in dist.requires or []:
            req = Requirement(line)
            # Extras' requirements count only where the requirer asked for that extra
            # (celery[redis], psycopg[binary]); the project's own extras (dev) never.
            if req.marker is not None and not any(
                req.marker.evaluate({"extra": extra}) for extra in ("", *extras)
            ):
                continue
            key = canonical(req.name)
            if key in have or key in found:
                continue
            found[key] = metadata.version(req.name)
            walk(req.name, tuple(sorted(req.extras)))

    walk(project, ())
    return dict(sorted(found.items()))


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.glob("*.whl"))


def build(folder: Path) -> dict[str, object]:
    """Fills `folder` with the wheels the image lacks; returns what it holds and its size."""
    needs = missing_from_image()
    folder.mkdir(parents=True, exist_ok=True)
    manifest = folder / MANIFEST
    held = json.loads(manifest.read_text()) if manifest.is_file() else None
    if held != needs:
        for stale in folder.glob("*.whl"):
            stale.unlink()
        manifest.unlink(missing_ok=True)
        _fetch(needs, folder)
        manifest.write_text(json.dumps(needs, indent=1) + "\n")
    size = folder_bytes(folder)
    if size > CARRY_LIMIT_BYTES:
        raise WheelsUnavailable(f"{folder} holds {size / 2**20:.1f} MiB, over the carry limit")
    return {"wheels": needs, "wheel_count": len(needs), "wheels_mib": round(size / 2**20, 1)}


def _pip(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet", *args]
    return subprocess.run(argv, capture_output=True, text=True)


def _fetch(needs: dict[str, str], folder: Path) -> None:
    pins = [f"{name}=={version}" for name, version in needs.items()]
    download = ["download", "--no-deps", "--only-binary=:all:", *TARGET_TAGS, "-d", str(folder)]
    if _pip(*download, *pins).returncode == 0:
        return
    # One call fails whole when any pin has no binary wheel: fetch one by one, building those.
    for pin in pins:
        got = _pip(*download, pin)
        if got.returncode == 0:
            continue
        built = _pip("wheel", "--no-deps", "-w", str(folder), pin)
        if built.returncode != 0:
            raise WheelsUnavailable(f"{pin}: {got.stderr.strip()[-500:]}\n{built.stderr[-500:]}")
        (wheel,) = folder.glob(f"{canonical(pin.split('==')[0]).replace('-', '_')}-*.whl")
        if not wheel.name.endswith("-none-any.whl"):
            raise WheelsUnavailable(f"{pin} has no wheel for the image, and is not pure Python")


def check_installable(folder: Path, target: Path) -> None:
    """Installs the folder's wheels into `target` as the image's pip would (its Python and
    platforms): a wheel the image could not take fails here, on this machine."""
    wheels = sorted(str(path) for path in folder.glob("*.whl"))
    done = _pip(
        "install", "--no-index", "--no-deps", "--no-compile", "--only-binary=:all:",
        *TARGET_TAGS, "--target", str(target), *wheels,
    )  # fmt: skip
    if done.returncode != 0:
        raise WheelsUnavailable(f"the wheels do not install for the image: {done.stderr[-2000:]}")
