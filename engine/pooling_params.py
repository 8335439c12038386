"""How one embedding request is pooled: the counterpart of SamplingParams for pooling models.

A pooling model (an encoder such as BERT, or a decoder with a pooling config) runs a request's
prompt once and hands back one vector: its tokens' hidden states pooled as the model's
`PoolingConfig` says, then cut to `dimensions` and normalized as these params ask.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedbatch.engine.sampling_params import RequestOutputKind


@dataclass
class PoolingParams:
    # Matryoshka truncation: keep the first `dimensions` values (renormalized where the output
    # is normalized). None: the model's full size. The engine refuses a size the model does
    # not allow (see PoolingConfig.check_dimensions).
    dimensions: int | None = None
    # None: what the model's config says (a sentence-transformers Normalize module).
    normalize: bool | None = None
    # A pooling request has one output, when it finishes; DELTA and CUMULATIVE give the same.
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"dimensions must be a positive integer, got {d!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a boolean or None, got {self.normalize!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

    @property
    def n(self) -> int:
        """One output per request, always (callers count sequences as `params.n`)."""
        return 1
