"""pagedbatch: an OpenAI-compatible batch and realtime service on a paged-KV-cache engine.

The source folders beside this one (engine/, kernels/, api/, store/, ...) install as subpackages
of pagedbatch, never as top-level modules (docs/architecture.md). But run from the checkout's root
(`python -m pagedbatch.cli`, `python -c ...`), Python puts that root first on sys.path, and they
become top-level modules too: our `kernels` then hides the installed package of that name, which
transformers imports when it loads a model config. The root comes off the path here, before
anything of ours imports transformers.
"""

import os
import sys
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent
# Only a source checkout: installed, this file's grandparent is site-packages, which must stay.
if (_CHECKOUT / "engine" / "llm_engine.py").is_file():
    sys.path[:] = [entry for entry in sys.path if Path(entry or os.curdir).resolve() != _CHECKOUT]
