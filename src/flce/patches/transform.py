"""What a model does to its logits between the output projection and the loss, folded into flce's options.

flce computes ``z = c * tanh(r / c)`` (or ``z = r`` without a softcap) with ``r = (x @ W.T + b) / T``. A
model's chain of positive scalings, added (V,) biases, one ``tanh``, vocabulary slices and dtype casts
maps onto that exactly:

    a * (x @ W.T + b)                  ->  temperature 1 / a, linear_bias b
    m * tanh(a * (x @ W.T + b))        ->  softcap m, temperature 1 / (a * m), linear_bias b

Anything else (a negative or learned scale, a second tanh, a bias after the tanh) has no such form, and
:class:`LogitTransform` raises :class:`Unfusable` with the operation's name.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


ADVICE = "pass materialize_logits=True to apply_flce_patch to train it unfused"


class Unfusable(Exception):
    """An operation on the logits that flce cannot carry into the fused loss; the message names it."""


@dataclass(frozen=True)
class LogitTransform:
    """``scale * (x @ W[vocab].T + b[vocab] + bias)``, then ``cap * tanh(...)`` when ``capped``.

    scale: a > 0 (the tanh's inner scale once capped). cap: m > 0 multiplying the tanh (capped only).
    bias: (width,) added before the tanh, in units of the projection, or None.
    vocab: (start, stop) of the projection's output columns kept (None: all).
    """

    scale: float = 1.0
    capped: bool = False
    cap: float = 1.0
    bias: torch.Tensor | None = None
    vocab: tuple[int, int] | None = None

    def scaled(self, factor: float, op: str) -> LogitTransform:
        if not factor > 0 or factor == float("inf"):
            raise Unfusable(f"{op} by {factor!r} (only finite positive scales fold into a temperature)")
        if self.capped:
            return replace(self, cap=self.cap * factor)
        return replace(self, scale=self.scale * factor)

    def plus(self, bias: torch.Tensor, op: str) -> LogitTransform:
        if self.capped:
            raise Unfusable(f"{op} after the tanh (only a bias before a softcap folds into the linear bias)")
        term = bias / self.scale
        return replace(self, bias=term if self.bias is None else self.bias + term)

    def tanh(self) -> LogitTransform:
        if self.capped:
            raise Unfusable("a second tanh")
        return replace(self, capped=True, cap=1.0)

    def sliced(self, start: int, stop: int, width: int) -> LogitTransform:
        """Keep columns [start, stop) of the current ``width`` columns."""
        offset = self.vocab[0] if self.vocab else 0
        bias = None if self.bias is None else self.bias[start:stop]
        return replace(self, bias=bias, vocab=(offset + start, offset + stop))

    def with_options(self, temperature: float | None, softcap: float | None) -> LogitTransform:
        """The user's ``temperature`` divides, and ``softcap`` caps, the model's final logits."""
        transform = self if temperature is None else self.scaled(1.0 / temperature, "temperature option")
        if softcap is not None:
            if transform.capped:
                raise Unfusable(f"softcap option cannot cap logits the model already caps at {transform.cap:g}")
            transform = replace(transform.scaled(1.0 / softcap, "softcap option").tanh(), cap=softcap)
        return transform

    def loss_options(self) -> dict:
        """``softcap`` and ``temperature`` for flce.linear_cross_entropy."""
        if not self.capped:
            return {"softcap": None, "temperature": 1.0 / self.scale}
        return {"softcap": self.cap, "temperature": 1.0 / (self.scale * self.cap)}
