"""The single-chunk path that stores exp(logits) instead of the logits (Hopper, bf16): no CE pass.

The logits GEMM's epilogue stores e = exp(z), z = (x @ W^T + b) / T unrounded, with its tile statistics
(``kernels/logits_triton.py``, ``store_exp``). bf16 has float32's exponent range, so e keeps every term
that matters to 8 bits while a row's lse lies in ``WINDOWS[dtype]``. A row kernel
(``kernels/exp_rows_triton.py``) takes the loss from the statistics and z at the target, and a coefficient
a_r with softmax_r / T = a_r e_r. The one-hot term of a confident target (p_y >= 1/2) goes into e itself
(no cancellation in p_y - 1); the others stay apart as c_r = w_y / T and are subtracted exactly, so the
dominant term is rounded once. With the reduction's scale g, backward's two GEMMs run on e through cuBLAS:

    grad_input  = g (diag(a) (e @ W) - c * W[y])   float32 out, one rounding into x's dtype
    grad_weight = e^T @ (diag(g a) x) - g onehot(y)^T (c * x)   the second term row by row in float32

Nothing reads or writes the logits between the GEMMs: the CE pass of the standard path (1 read + 1 write of
every logit, ~1.2 ms at 8192 x 128256 on an H200) is gone, and the gradients come from the unrounded
logits (the standard path's softmax is that of the bf16-rounded logits, as eager's is).

Out of the window a row's e may have overflowed or flushed. Forward's loss is right anyway (the statistics
are computed safely); backward queues its GEMMs, then waits for the count of such rows (as the target
check does) and, if any, the gradients are recomputed through the standard path (``function``). The device
then takes the standard path for its next ``COOL_DOWN`` calls. Options that need every logit (label smoothing, z-loss,
softcap, accuracy, a bias gradient) and reduction='none' take the standard path.

Several chunks take the same path chunk by chunk (``grads_chunk``), in forward: grad_input from a float32
product of the chunk, grad_weight summed in float32 from e^T (a x) less the one-hot rows (no bias gradient,
as above). So do the low-memory mode's forward chunks, which want grad_input and at most a share of
grad_weight (and of grad_bias), from float32 products of the columns its plan has memory for
(``ChunkPlan.input_product_cols``). Their window count is copied out after the last such chunk's row kernel
(before its GEMMs, so that backward's wait leaves work queued) and read in backward (``function``,
``low_memory.py``), which on a miss runs forward's loop again on the standard path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import HostCopy
from .gemm import first_cols, mm_into, padded_rows
from .options import LossOptions

# Fewest rows: below, the pass saved is short and the path's own launches weigh more (small batches).
MIN_ROWS = 1024
# lse range per storage dtype in which e = exp(z) holds a row: at lse <= 60 no logit exceeds e^60 (bf16
# and float32 overflow at e^88.7, and e @ W sums V of them), at lse >= -40 the row's largest terms lie far
# above bf16's smallest normal (e^-87). Tests add float16 with its narrow range.
WINDOWS: dict[torch.dtype, tuple[float, float]] = {torch.bfloat16: (-40.0, 60.0)}
COOL_DOWN = 64
_cool_down: dict[torch.device, int] = {}  # device -> calls left on the standard path after a miss


class WindowCheck:
    """The count of rows outside the window, read in backward (``checks.HostCopy``)."""

    def __init__(self, misses: torch.Tensor) -> None:
        self.misses, self.copy = misses, HostCopy(misses)

    def missed(self) -> bool:
        return note_misses(self.misses.device, int(self.copy.wait()[0]))


def note_misses(device: torch.device, count: int) -> bool:
    """Whether rows left the window (a count read on the host); after a miss the device takes the standard path
    for its next ``COOL_DOWN`` calls."""
    if count == 0:
        return False
    _cool_down[device] = COOL_DOWN
    return True


@dataclass
class PendingExp:
    """A single chunk's stored exponentials and row coefficients, kept for backward's two GEMMs (x and w
    travel through ``save_for_backward``, as for ``function.PendingGrads``)."""

    e: torch.Tensor  # (n, V): exp(z), the one-hot term at confident targets
    coefs: torch.Tensor  # (2, n) float32: a_r (0 on ignored rows), then the one-hot term's coefficient where
    #                      not folded into e, else 0
    ints: torch.Tensor  # (n + 1,) int32: the keys (the target where the one-hot coefficient is not 0, else V),
    #                     then the count of rows outside the window
    target: torch.Tensor  # (n,) int64
    x: torch.Tensor | None  # (n, H) in the compute dtype
    w: torch.Tensor | None  # (V, H) in the compute dtype
    scale: torch.Tensor  # 0-d: the reduction's scale
    check: WindowCheck | None  # None where the caller reads the count itself (``loss_op``)
    redo: tuple  # (bias, class_weight, weight_sum): what the standard path needs besides x, w, target, options

    @property
    def coef(self) -> torch.Tensor:
        return self.coefs[0]

    @property
    def target_coef(self) -> torch.Tensor:
        return self.coefs[1]

    @property
    def keys(self) -> torch.Tensor:
        return self.ints[:-1]


def applies(x_c: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, needs: tuple[bool, bool, bool],
            grad_scale: torch.Tensor | None, opts: LossOptions, want_correct: bool, backend: str) -> bool:
    """Whether a single deferred chunk takes this path (see the module docstring); takes a turn of the
    device's cool-down when it does not."""
    if needs[2] or not (needs[0] or needs[1]):
        return False
    return eligible(x_c, w, bias, grad_scale, opts, want_correct, backend) and take_turn(x_c.device)


def eligible(x_c: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, grad_scale: torch.Tensor | None,
             opts: LossOptions, want_correct: bool, backend: str, out: torch.Tensor | None = None) -> bool:
    """Whether a chunk's shapes, dtypes and options suit the path (no bias gradient asked of it), storing e
    into ``out`` if given (``logits_triton.supported``)."""
    scalar_scale = grad_scale is not None and grad_scale.dim() == 0
    return (suited(x_c, w, bias, scalar_scale, opts, want_correct, backend, out=out, check_address=True)
            and not (x_c.is_cuda and torch.cuda.is_current_stream_capturing()))  # backward's wait cannot be captured


def suited(x_c: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, scalar_scale: bool, opts: LossOptions,
           want_correct: bool, backend: str, device: torch.device | None = None, out: torch.Tensor | None = None,
           check_address: bool = False) -> bool:
    """``eligible``'s conditions but CUDA-graph capture; without ``check_address`` on shapes, strides, dtypes and
    options alone (fake and meta tensors answer them too; ``device``: the operands', where they are meta tensors):
    what a custom op's outputs can be laid out by, the operands' addresses and capture deciding the rest when it
    runs. scalar_scale: the reduction's scale is 0-d (not reduction="none")."""
    if backend != "triton" or x_c.shape[0] < MIN_ROWS or x_c.dtype not in WINDOWS or want_correct:
        return False
    if opts.label_smoothing > 0.0 or opts.z_loss > 0.0 or opts.softcap is not None or not scalar_scale:
        return False
    from .kernels import logits_triton

    return logits_triton.supported(x_c, w, bias, out, check_address=check_address, device=device)


def take_turn(device: torch.device) -> bool:
    """False while the device is cooling down after a miss (one call of the COOL_DOWN counted)."""
    left = _cool_down.get(device, 0)
    if left:
        _cool_down[device] = left - 1
        return False
    return True


def forward_chunk(x_c: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                  loss: torch.Tensor, lse: torch.Tensor, total: torch.Tensor | None,
                  class_weight: torch.Tensor | None, weight_sum: torch.Tensor | None, grad_scale: torch.Tensor,
                  opts: LossOptions, counts: torch.Tensor | None) -> PendingExp:
    """The single deferred chunk: exp(z) stored and the row kernel run (``_store_exp_and_rows``), the rest
    kept for backward. x_c (n, H), w (V, H), bias (V,) or None, target (n,); ``counts``/``total``/
    ``grad_scale`` as in ``kernels.ce_chunk`` (with counts the kernel writes grad_scale and the mean)."""
    n = x_c.shape[0]
    e = padded_rows(n, w.shape[0], x_c.dtype, x_c.device)
    ints = torch.zeros(n + 1, dtype=torch.int32, device=x_c.device)  # the keys, then the window's count
    keys, misses = ints[:n], ints[n:]
    coef = _store_exp_and_rows(x_c, w, bias, target, class_weight, opts, e, loss, lse, keys, misses, counts, total,
                               grad_scale if counts is not None else None)
    return PendingExp(e, coef, ints, target, x_c, w, grad_scale, WindowCheck(misses), (bias, class_weight, weight_sum))


def grads_chunk(x_c: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                loss: torch.Tensor, lse: torch.Tensor, class_weight: torch.Tensor | None, scale: torch.Tensor,
                opts: LossOptions, e: torch.Tensor, misses: torch.Tensor, grad_input: torch.Tensor | None,
                product_cols: int, weight_sum: torch.Tensor | None = None, accumulate: bool = False,
                bias_sum: torch.Tensor | None = None, sums_scale: torch.Tensor | None = None,
                check: bool = False) -> WindowCheck | None:
    """A chunk whose gradients forward computes (one of several, or of the low-memory mode's forward): exp(z)
    stored into ``e`` and the row kernel run (``_store_exp_and_rows``; rows outside the window added to
    ``misses``, (1,) int32), then grad_input
    (m, H), any row stride, times ``scale`` (0-d), from float32 products of ``product_cols`` columns
    (``input_grad``), and the chunk's part of grad_weight's first k rows added to (or, without
    ``accumulate``, written into) ``weight_sum`` (k, H) (``weight_grad``), and of grad_bias's first k added to
    ``bias_sum`` (k,), both times ``sums_scale`` (0-d; None: ``scale``). x_c (m, H), w (V, H), e (m, V) with
    unit-stride rows. ``check``: returns the ``WindowCheck`` of ``misses`` as it stands after this chunk's row
    kernel, copied out before the chunk's GEMMs (the last chunk of the path: the count is then final)."""
    keys = torch.empty(x_c.shape[0], dtype=torch.int32, device=e.device)  # grad_weight's sort keys
    coef = _store_exp_and_rows(x_c, w, bias, target, class_weight, opts, e, loss, lse, keys, misses)
    window = WindowCheck(misses) if check else None
    if grad_input is not None:
        input_grad(e, w, coef[0], target, coef[1], scale, grad_input, product_cols)
    if weight_sum is not None:
        weight_grad(e, x_c, coef[0], keys, coef[1], scale if sums_scale is None else sums_scale, weight_sum,
                    accumulate, bias_sum)
    return window


def _store_exp_and_rows(x_c, w, bias, target, class_weight, opts: LossOptions, e, loss, lse, keys, misses,
                        counts=None, total=None, grad_scale=None) -> torch.Tensor:
    """The logits GEMM storing exp(z) into e (m, V), then the row kernel (``exp_rows``: loss, lse and keys
    (m,) written, rows outside the window added to misses). Returns (2, m) float32: each row's coefficient
    a and its one-hot term's coefficient (0 where folded into e)."""
    from .kernels import logits_triton
    from .kernels.exp_rows_triton import exp_rows

    m, vocab = e.shape
    stats = torch.empty(2, m, logits_triton.num_tiles(vocab), dtype=torch.float32, device=e.device)
    logits_triton.logits_with_tile_stats(x_c, w, bias, e, stats[0], stats[1], opts, store_exp=True)
    coef = torch.empty(2, m, dtype=torch.float32, device=e.device)
    exp_rows(e, x_c, w, bias, target, class_weight, (stats[0], stats[1]), loss, lse, coef[0], coef[1], keys, misses,
             opts, WINDOWS[e.dtype], counts, total, grad_scale)
    return coef


def input_grad(e: torch.Tensor, w: torch.Tensor, coef: torch.Tensor, target: torch.Tensor, target_coef: torch.Tensor,
               scale: torch.Tensor, out: torch.Tensor, product_cols: int) -> torch.Tensor:
    """out (m, H) = scale (diag(coef) (e @ W) - target_coef * W[target]), ``product_cols`` columns at a
    time: each a float32 product, rows scaled and rounded once into out's dtype."""
    from .kernels.exp_rows_triton import row_scale

    m, hidden = out.shape
    product = torch.empty(m, min(product_cols, hidden), dtype=torch.float32, device=e.device)
    for start in range(0, hidden, product.shape[1]):
        end = min(start + product.shape[1], hidden)
        part = product.view(-1)[: m * (end - start)].view(m, end - start)  # contiguous, whatever its width
        mm_into(part, e, w[:, start:end], accumulate=False)
        row_scale(part, coef, scale, out[:, start:end], (w[:, start:end], target, target_coef))
    return out


def weight_grad(e: torch.Tensor, x_c: torch.Tensor, coef: torch.Tensor, keys: torch.Tensor, target_coef: torch.Tensor,
                scale: torch.Tensor, out: torch.Tensor, accumulate: bool = False,
                bias_out: torch.Tensor | None = None) -> torch.Tensor:
    """out (k, H) (+)= scale (e^T @ (diag(coef) x_c) - onehot(keys)^T (target_coef * x_c)) for the first k
    vocabulary rows (k <= V), the second term row by row in float32 (``subtract_target_rows``); with
    ``bias_out`` (k,), the same of a column of ones added to it (grad_bias: a bias is a weight on 1)."""
    from .kernels.exp_rows_triton import row_scale, subtract_target_rows

    e_k = first_cols(e, out.shape[0])
    xs = row_scale(x_c, coef, scale, torch.empty(x_c.shape, dtype=x_c.dtype, device=x_c.device))
    mm_into(out, e_k.t(), xs, accumulate=accumulate)
    del xs
    subtract_target_rows(out, x_c, keys, target_coef, scale)
    if bias_out is not None:
        ones = torch.ones(x_c.shape[0], 1, dtype=x_c.dtype, device=x_c.device)
        mm_into(bias_out[:, None], e_k.t(), row_scale(ones, coef, scale, torch.empty_like(ones)), accumulate=True)
        subtract_target_rows(bias_out[:, None], ones, keys, target_coef, scale)
    return out


def finish(p: PendingExp, x_c: torch.Tensor, w: torch.Tensor, g: torch.Tensor, needs: tuple[bool, bool, bool],
           dtypes: tuple) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """Backward: (grad_input, grad_weight) in ``dtypes`` (None where not needed) for grad_output g (0-d),
    or None if rows left the window (``function`` then runs the standard path). x_c, w: the forward's GEMM
    operands, from ``ctx.saved_tensors``."""
    g_total = (g * p.scale).float()
    grad_x = grad_w = None
    if needs[0]:  # first: its float32 product is freed before grad_weight is allocated
        grad_x = input_grad(p.e, w, p.coef, p.target, p.target_coef, g_total,
                            torch.empty(x_c.shape, dtype=dtypes[0], device=x_c.device), x_c.shape[1])
    if needs[1]:
        grad_w = weight_grad(p.e, x_c, p.coef, p.keys, p.target_coef, g_total,
                             torch.empty(w.shape, dtype=dtypes[1], device=w.device))
    if p.check is not None and p.check.missed():  # None: the caller has read the count already
        return None  # rows left the window: the caller recomputes through the standard path
    return grad_x, grad_w
