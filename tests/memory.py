"""How much memory a piece of work takes at its peak, measured in a python process of its own:
the test process's peak RSS is whatever the suite did before, so it cannot tell."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from commands import python_output

TESTS = Path(__file__).parent

# Appended to the child's script, after the `work()` it defines.
_PROBE = """
import json as _json


def _status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


with open("/proc/self/clear_refs", "w") as _f:
    _f.write("5")  # the peak (VmHWM) starts again from the current RSS
_before = _status("VmRSS")
_result = work()
print(_json.dumps({"result": _result, "grown_kib": _status("VmHWM") - _before}))
"""


def peak_rss_growth(script: str, test_file: str, timeout: float = 300) -> tuple[Any, int]:
    """Runs `script` in a python process of its own, which imports as pytest does (`test_file`'s
    folder and tests/ first on its sys.path), then the `work()` it defines between a reset of the
    process's peak RSS (VmHWM) and a reading of it. Returns what `work()` returned (through
    JSON) and by how many KiB the peak grew past the RSS at the reset: what the script's setup
    took does not count."""
    search = [str(Path(test_file).parent), str(TESTS)]
    child = f"import sys\nsys.path[:0] = {search!r}\n{script}\n{_PROBE}"
    measured = json.loads(python_output("-c", child, timeout=timeout).strip().splitlines()[-1])
    return measured["result"], measured["grown_kib"]
