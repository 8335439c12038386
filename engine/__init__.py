"""The paged-KV continuous-batching engine and its front doors.

Names load lazily, so importing one submodule (say, sampling_params from the API layer) does not
pull in the whole engine.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "LLM": "llm",
    "AsyncLLM": "async_llm",
    "CompletionOutput": "outputs",
    "EngineArgs": "config",
    "LLMEngine": "llm_engine",
    "PoolingConfig": "config",
    "PoolingParams": "pooling_params",
    "RequestOutput": "outputs",
    "RequestOutputKind": "sampling_params",
    "SamplingParams": "sampling_params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
