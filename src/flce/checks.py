"""Argument and tensor checks shared by every front end (plain, grouped, vocab-parallel).

Each raises a Python error that names the argument and what it accepts, at the call, before any work.
They run on every training step, so they read only tensor metadata (no device work, no host sync),
except where a target check must look at values (``check_and_compact``, ``raise_bad_targets``).
"""

from __future__ import annotations

import torch

INT64_MAX = 2**63 - 1


def check_tensors(input, linear_weight, target, bias, class_weight, *, min_vocab: int = 1) -> None:
    """input (..., H) floating; linear_weight (V, H) floating with V >= min_vocab (0 for a vocabulary
    shard); target (...) integer with input's leading shape; bias (V,) or None; class_weight (V,) or
    None; one device, not meta."""
    for name, t in (("input", input), ("linear_weight", linear_weight), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not input.is_floating_point():
        raise TypeError(f"input must be a floating-point tensor, got {input.dtype}")
    if not linear_weight.is_floating_point():
        raise TypeError(f"linear_weight must be a floating-point tensor, got {linear_weight.dtype}")
    if linear_weight.dim() != 2:
        raise ValueError(f"linear_weight must be a 2-D tensor (V, H), got shape {tuple(linear_weight.shape)}")
    vocab = linear_weight.shape[0]
    if vocab < min_vocab:
        raise ValueError(f"linear_weight must have at least one row (V >= 1), got shape {tuple(linear_weight.shape)}")
    if input.dim() < 1 or input.shape[-1] != linear_weight.shape[1]:
        raise ValueError(f"hidden size mismatch: input has {tuple(input.shape)}, linear_weight (V, H) has "
                         f"{tuple(linear_weight.shape)}")
    if target.dtype == torch.bool or target.is_floating_point() or target.is_complex():
        raise TypeError(f"target must hold integer class indices, got {target.dtype}")
    if target.shape != input.shape[:-1]:
        raise ValueError(f"target shape {tuple(target.shape)} must equal input's leading shape "
                         f"{tuple(input.shape[:-1])}")
    if bias is not None:
        check_vector("linear_bias", bias, vocab)
    if class_weight is not None:
        check_class_weight(class_weight, vocab)
    check_devices(("input", input), ("linear_weight", linear_weight), ("target", target), ("linear_bias", bias),
                  ("weight", class_weight))


def check_vector(name: str, t, size: int) -> None:
    """A floating (size,) tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a floating tensor of shape ({size},) or None, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor of shape ({size},), got dtype {t.dtype}")
    if t.dim() != 1 or t.shape[0] != size:
        raise ValueError(f"{name} must be a floating tensor of shape ({size},), got shape {tuple(t.shape)}")


def check_class_weight(weight, vocab: int | None, device: torch.device | None = None) -> None:
    """Class weights: a floating (V,) tensor (any length when ``vocab`` is None) that needs no gradient,
    on ``device`` if given.

    F.cross_entropy is not differentiable with respect to its class weights and raises when they
    require grad; so does flce (dropping that gradient silently would be a wrong answer)."""
    if vocab is None:
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != 1:
            what = (f"{weight.dtype} {tuple(weight.shape)}" if isinstance(weight, torch.Tensor)
                    else type(weight).__name__)
            raise TypeError(f"weight (class weights) must be a 1-D floating tensor (V,) or None, got {what}")
    else:
        check_vector("weight (class weights)", weight, vocab)
    if device is not None and weight.device != device:
        raise ValueError(f"all tensors must be on one device, got input on {device}, weight on {weight.device}")
    if weight.requires_grad and torch.is_grad_enabled():
        raise ValueError("weight (class weights) requires grad, but the loss is not differentiable with respect "
                         "to the class weights (as in torch.nn.functional.cross_entropy): pass weight.detach()")


def check_devices(*named: tuple[str, torch.Tensor | None]) -> None:
    """(name, tensor or None) pairs: every tensor on the first one's device, which is not the meta device
    (no data to compute on)."""
    device = named[0][1].device
    if device.type == "meta":
        raise ValueError(f"flce needs tensors with data: {named[0][0]} is on the meta device (materialize the "
                         "module, e.g. with to_empty() and its initializer, before computing a loss)")
    if any(t is not None and t.device != device for _, t in named):
        raise ValueError("all tensors must be on one device, got " +
                         ", ".join(f"{n} on {t.device}" for n, t in named if t is not None))


def compute_dtype(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  names: tuple[str, str, str] = ("input", "linear_weight", "linear_bias")) -> torch.dtype:
    """The GEMMs' dtype, as F.linear chooses it: under autocast every floating operand except a float64
    one is cast to autocast's dtype (autocast leaves float64 alone); outside, the operands' shared dtype.
    ``names``: the three arguments' names, for the error."""
    if input.dtype == weight.dtype and (bias is None or bias.dtype == weight.dtype):
        shared = weight.dtype
        device_type = input.device.type
        if shared == torch.float64 or not torch.is_autocast_enabled(device_type):
            return shared
        return torch.get_autocast_dtype(device_type)
    names = tuple(zip(names, (input, weight, bias)))
    device_type = input.device.type
    if torch.is_autocast_enabled(device_type):
        fast = torch.get_autocast_dtype(device_type)
        cast = {n: (t.dtype if t.dtype == torch.float64 else fast) for n, t in names if t is not None}
        if len(set(cast.values())) == 1:
            return next(iter(cast.values()))
        raise TypeError("under autocast, float64 operands stay float64 (as in F.linear), so all operands must "
                        "be float64 or none of them; got " +
                        ", ".join(f"{n} {t.dtype}" for n, t in names if t is not None))
    raise TypeError(f"{', '.join(n for n, t in names if t is not None)} must share a dtype outside autocast, got " +
                    ", ".join(f"{n} {t.dtype}" for n, t in names if t is not None))


def flat_targets(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """target as a contiguous (n,) int64 tensor (itself when it already is one: no dispatcher calls).

    uint64 values from 2**63 on would wrap to negative int64 values, and one of them could equal
    ignore_index: they become -1 (-2 if that is ignore_index), outside [0, V) like the values they are."""
    if target.dim() == 1 and target.dtype == torch.int64 and target.is_contiguous():
        return target
    t = target.reshape(-1).long()
    if target.dtype == torch.uint64:
        t = torch.where(t < 0, -1 if ignore_index != -1 else -2, t)
    return t.contiguous()


def raise_bad_targets(t: torch.Tensor, vocab: int, ignore_index: int, n_bad: int, original: torch.Tensor) -> None:
    """Raise the ValueError for ``n_bad`` targets of t (int64, original's shape or flat) outside [0, V);
    the first one is read from ``original``, the caller's target (a uint64 value is shown as it is)."""
    bad = (t != ignore_index) & ((t < 0) | (t >= vocab))
    first = int(bad.reshape(-1).nonzero()[0, 0])
    value = original.reshape(-1)[first].item()
    raise ValueError(f"target holds {n_bad} value(s) outside [0, {vocab}) that are not ignore_index={ignore_index} "
                     f"(first: {value})")


def check_and_compact(t: torch.Tensor, vocab: int, ignore_index: int, counts: torch.Tensor,
                      original: torch.Tensor) -> tuple[torch.Tensor | None, int]:
    """Raise on targets outside [0, V); return the valid rows' indices (None if every row is valid) and
    their number. ``counts``: ``count_targets``' counts of t (one host sync reads them)."""
    n_valid, n_bad = counts.tolist()[:2]
    if n_bad:
        raise_bad_targets(t, vocab, ignore_index, n_bad, original)
    if n_valid == t.numel():
        return None, n_valid
    return (t != ignore_index).nonzero_static(size=n_valid).squeeze(1), n_valid  # sized: no second sync


class HostCopy:
    """A small device tensor copied to the host in the background (pinned memory, then an event): reading
    it waits only for the kernels queued before the copy, and ``done`` asks without waiting."""

    def __init__(self, t: torch.Tensor) -> None:
        self.host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)  # whatever the default
        self.host.copy_(t, non_blocking=True)
        self.event = torch.cuda.Event() if t.is_cuda else None
        if self.event is not None:
            self.event.record()

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> torch.Tensor:
        """The host tensor, once the copy has landed."""
        if self.event is not None:
            self.event.synchronize()
        return self.host
