"""What the check runs on: the versions of the image's packages it relies on, the device, and
where `pagedbatch` is imported from (the check's install, never the checkout). Prints one JSON
line; exits 1 when the device asked for (`cuda` or `cpu`, the first argument) is not there.

Imported as the steps import it: from a folder outside the checkout, with PYTHONPATH holding the
check's site folder.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import sys

import torch

import pagedbatch

device = sys.argv[1]
figures = {
    "python": sys.version.split()[0],
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    "pagedbatch": pagedbatch.__file__,
}
for name in ("triton", "transformers"):
    try:
        figures[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        figures[name] = None
print(json.dumps(figures))
sys.exit(1 if device == "cuda" and not torch.cuda.is_available() else 0)
