"""Commands a test runs in a child of this interpreter, as a user of this environment would."""

from __future__ import annotations

import subprocess
import sys


def python_output(*args: str, timeout: float) -> str:
    """What `python <args>` prints on stdout, run by this interpreter (`sys.executable`, so in
    this environment); a non-zero exit fails the test with everything the child printed."""
    result = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout
