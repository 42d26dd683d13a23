"""What one layer asks of attention: a frozen, hashable description passed statically.

A model builds one `AttentionSpec` per layer (from its config) and hands it to the backend's
attention call as `spec=`; it is a static argument of every jitted kernel wrapper, so a
window or a soft-cap is compiled into the kernel, never a branch on data. What a step gives
attention (page tables, lengths, query starts) is the step's metadata, not this.

Semantics (reference.ragged_paged_attention is the oracle):
- scores = (q . k) * sm_scale; with `logit_softcap` c, scores = c * tanh(scores / c) (Gemma 2:
  the scale comes before the cap);
- with `sliding_window` W, a query at position p sees keys at positions p - W + 1 .. p (W keys,
  itself included: transformers' `kv_idx > q_idx - sliding_window`); without one, 0 .. p.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Static per-layer attention description (hashable: a jit static argument)."""

    sm_scale: float  # softmax scale of q . k, usually head_dim ** -0.5
    sliding_window: int | None = None  # W: keys within the last W positions; None: all
    logit_softcap: float | None = None  # c: scores -> c * tanh(scores / c); None: no cap

    def __post_init__(self) -> None:
        if not self.sm_scale > 0:
            raise ValueError(f"sm_scale must be positive, got {self.sm_scale}")
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            raise ValueError(
                f"sliding_window must be a positive int or None, got {self.sliding_window!r}"
            )
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ValueError(f"logit_softcap must be positive or None, got {self.logit_softcap}")

    def features(self) -> tuple[str, ...]:
        """Names of the optional features this spec uses ("sliding_window", "logit_softcap")."""
        return tuple(
            name for name in ("sliding_window", "logit_softcap") if getattr(self, name) is not None
        )


def refuse_unsupported(spec: AttentionSpec, backend: str, supported: tuple[str, ...] = ()) -> None:
    """Raises ValueError naming the feature of `spec` that `backend` does not implement."""
    missing = [f for f in spec.features() if f not in supported]
    if missing:
        raise ValueError(
            f"attention backend {backend!r} does not support {', '.join(missing)} "
            f"({spec}); use attention_backend='reference'"
        )
