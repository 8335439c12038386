"""The package list, found rather than kept by hand: every folder that holds Python modules under
one of the design's top-level units installs as `pagedbatch.<unit>.<path>`, so a new subpackage
cannot be left out of the wheel (an editable install would hide that; tests/test_wheel.py builds
and installs a real one). Non-Python files that ship are listed in pyproject.toml's package-data.
"""

from pathlib import Path

from setuptools import setup

# The top-level folders and the names they install under: never as top-level modules, which
# would clash with other installed packages (transformers probes for one named `kernels`).
UNITS = {
    "pagedbatch": "pagedbatch",
    "pagedbatch.api": "api",
    "pagedbatch.engine": "engine",
    "pagedbatch.kernels": "kernels",
    "pagedbatch.migrations": "migrations",
    "pagedbatch.store": "store",
    "pagedbatch.workers": "workers",
}


def packages_in(name: str, folder: str) -> list[str]:
    # Folders without an __init__.py count too (migrations/versions is a namespace package).
    found = {Path(module).parent for module in Path(folder).rglob("*.py")}
    return [".".join((name, *path.relative_to(folder).parts)) for path in found]


setup(
    packages=sorted(p for name, folder in UNITS.items() for p in packages_in(name, folder)),
    package_dir=UNITS,
)
