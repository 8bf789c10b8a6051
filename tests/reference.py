"""Float64 reference: F.cross_entropy on materialized logits, plus the z-loss term."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

TOL = {  # relative L2 error allowed against float64, by compute dtype
    torch.float64: 1e-10,
    torch.float32: 2e-5,
    torch.float16: 6e-3,
    torch.bfloat16: 3e-2,
}


def reference_logits(x, weight, linear_bias=None, temperature=1.0, softcap=None):
    """(z, leaves): the logits after temperature and softcap in float64, on float64 copies of the inputs
    (leaves that require grad where the inputs do)."""
    leaves = [None if t is None else t.detach().double().requires_grad_(t.requires_grad)
              for t in (x, weight, linear_bias)]
    x64, w64, b64 = leaves
    logits = x64 @ w64.T
    if b64 is not None:
        logits = logits + b64
    return capped(logits, temperature, softcap), leaves


def capped(logits, temperature=1.0, softcap=None):
    """The logits after temperature, then softcap."""
    z = logits / temperature
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def logits_leaf(x, weight, linear_bias, dtype: torch.dtype) -> torch.Tensor:
    """x @ weight^T + linear_bias (..., V) in float64 as a leaf that requires grad: computed in ``dtype`` and rounded
    once to it, as eager PyTorch has the logits and flce's 16-bit chunks compute from them (float64: exact, as
    flce's float32 logits of a small single chunk, ``function.wide_logits``). ``linear_grads`` carries its gradient
    on."""
    args = (t.detach().to(dtype) if t is not None else None for t in (x, weight, linear_bias))
    return F.linear(*args).double().requires_grad_()


def linear_grads(dz, x, weight) -> tuple:
    """(input, weight, bias) gradients in float64 from dloss/dlogits dz (..., V) of x @ weight^T + bias."""
    dz2, x64 = dz.flatten(0, -2), x.detach().double().flatten(0, -2)
    return (dz2 @ weight.detach().double()).reshape(x.shape), dz2.T @ x64, dz2.sum(0)


def reference_loss(x, weight, target, *, linear_bias=None, weight_cls=None, reduction="mean",
                   ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None, temperature=1.0,
                   num_items_in_batch=None):
    """Loss in float64 on float64 copies of the (leaf) inputs; returns (loss, leaves)."""
    z, leaves = reference_logits(x, weight, linear_bias, temperature, softcap)
    return loss_of_logits(z, target, weight_cls=weight_cls, reduction=reduction, ignore_index=ignore_index,
                          label_smoothing=label_smoothing, z_loss=z_loss, num_items_in_batch=num_items_in_batch), leaves


def loss_of_logits(z, target, *, weight_cls=None, reduction="mean", ignore_index=-100, label_smoothing=0.0,
                   z_loss=0.0, num_items_in_batch=None):
    """``reference_loss`` from float64 logits z (..., V), after temperature and softcap."""
    vocab = z.shape[-1]
    z2, t1 = z.reshape(-1, vocab), target.reshape(-1).long()
    cw = weight_cls.double() if weight_cls is not None else None
    rows = F.cross_entropy(z2, t1, weight=cw, ignore_index=ignore_index, label_smoothing=label_smoothing,
                           reduction="none")
    valid = t1 != ignore_index
    if z_loss:
        rows = rows + z_loss * torch.logsumexp(z2, 1).square() * valid
    if reduction == "none":
        return rows.reshape(target.shape)
    total = rows.sum()
    if num_items_in_batch is not None:
        return total / float(num_items_in_batch)
    if reduction == "sum":
        return total
    denom = cw[t1[valid]].sum() if cw is not None else valid.sum().double()
    return total / denom if denom != 0 else total * 0.0


def peaked_case(n: int, hidden: int, vocab: int, dtype: torch.dtype, device, bias: bool = False,
                temperature: float = 1.0, std: float = 6.0, seed: int = 0, softcap: float | None = None):
    """(x, w, b, target) with logits of std ``std`` (a trained model's spread) and targets drawn from their
    softmax (after temperature and softcap; the Gumbel-max trick in float64); x, w (and b) require grad, b is
    None without ``bias``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, hidden, device=device, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, device=device, generator=gen) * std / hidden**0.5).to(dtype).requires_grad_()
    b = torch.randn(vocab, device=device, generator=gen).to(dtype).requires_grad_() if bias else None
    z, _ = reference_logits(x, w, b, temperature, softcap)
    gumbel = -torch.log(-torch.log(torch.rand(n, vocab, device=device, generator=gen, dtype=torch.float64)))
    return x, w, b, (z.detach() + gumbel).argmax(1)


def poisoned_padded_copy(values: torch.Tensor) -> torch.Tensor:
    """values (n, V) copied into a ``gemm.padded_rows`` buffer (rows as the logits buffers have them) whose padding
    holds NaN: a kernel that lets it into a result shows it."""
    from flce import gemm

    n, vocab = values.shape
    buf = gemm.padded_rows(n, vocab, values.dtype, values.device)
    buf.as_strided((n, buf.stride(0)), buf.stride()).fill_(float("nan"))
    return buf.copy_(values)


def errors_in_roundings(got, exact, dtype: torch.dtype) -> list[float]:
    """Each gradient's relative error against float64 as a multiple of that of the exact gradient rounded once
    to ``dtype`` (1.0: the best a ``dtype`` result can do)."""
    return [rel_err(g, e) / rel_err(e.to(dtype), e) for g, e in zip(got, exact)]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||a - e|| / ||e|| in float64 (absolute error when ||e|| is 0); NaN anywhere gives inf."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if torch.isnan(a).any():
        return float("inf")
    scale = e.norm().item()
    return (a - e).norm().item() / (scale if scale > 0 else 1.0)


def assert_close(actual, expected, tol, what=""):
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


def assert_loss_close(actual, expected, tol, unit=1.0, what="loss"):
    """Loss values (any shape) within tol * (|expected| + unit) each. The absolute part covers a row whose
    loss is far smaller than its terms: lse - z_y of a confident row cancels in float32 arithmetic
    (eager float32 too), an error of a few ulps of lse. ``unit``: the loss's scale for O(1) rows (1 for a
    mean or one row, the valid count for a sum)."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    bound = tol * (e.abs() + unit)
    worst = ((a - e).abs() - bound).max().item() if a.numel() else 0.0
    assert not a.isnan().any() and worst <= 0, f"{what}: off by more than {tol:.3g} * (|expected| + {unit})"


def chunked_reference_grads(x, weight, target, chunk=1024, ignore_index=-100):
    """Mean cross-entropy over the non-ignored rows and its (grad_input, grad_weight) in float64, chunk by
    chunk (GPU-sized shapes).

    x: (n, H), weight: (V, H), target: (n,); rows whose target is ignore_index add nothing.
    """
    n = x.shape[0]
    n_valid = max(int((target != ignore_index).sum()), 1)
    w64 = weight.double()
    grad_w = torch.zeros_like(w64)
    grad_x = torch.empty(x.shape, dtype=torch.float64, device=x.device)
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for start in range(0, n, chunk):
        x_c = x[start:start + chunk].double()
        t_c = target[start:start + chunk]
        valid = t_c != ignore_index
        rows, t_safe = torch.arange(len(t_c), device=x.device), t_c.where(valid, 0)
        logits = x_c @ w64.T
        lse = torch.logsumexp(logits, 1)
        total += ((lse - logits[rows, t_safe]) * valid).sum()
        logits.sub_(lse[:, None]).exp_()
        logits[rows, t_safe] -= 1.0
        logits *= (valid.double() / n_valid)[:, None]
        grad_x[start:start + chunk] = logits @ w64
        grad_w.addmm_(logits.T, x_c)
        del logits
    return total / n_valid, grad_x, grad_w


class DropGrad(torch.autograd.Function):
    """Identity whose backward returns None: the tensor before it gets an undefined (None) gradient."""

    @staticmethod
    def forward(ctx, a):
        return a.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


# Options of the Hopper row-kernel paths (the exp-logits path, the loss without gradients), as cases for
# ``split_options``: what ``row_case`` builds into the inputs, the rest the loss's own keywords.
ROW_PATH_OPTIONS = [
    {},
    {"temperature": 1.3},
    {"weight_cls": True},
    {"ignore": 0.25, "ignore_index": 3},
    {"bias": True, "weight_cls": True, "ignore": 0.3, "temperature": 0.8},
]
_INPUT_OPTIONS = ("bias", "weight_cls", "ignore")


def split_options(opts: dict) -> tuple[dict, dict]:
    """(keywords of ``row_case``, keywords of the loss) of one option case."""
    inputs = {k: v for k, v in opts.items() if k in _INPUT_OPTIONS}
    inputs["ignore_index"] = opts.get("ignore_index", -100)
    return inputs, {k: v for k, v in opts.items() if k not in _INPUT_OPTIONS}


def row_case(n=40, hidden=32, vocab=120, scale=1.0, bias=False, weight_cls=False, ignore=0.0, ignore_index=-100,
             *, dtype, device, requires_grad=True):
    """Fresh random (x, w, bias, target, class weights) with logits of about ``scale`` standard deviations
    (vocab 120: a partial last tile of the small test tiles). x and w are leaves that require grad unless
    ``requires_grad`` is False; the bias never does (a bias gradient takes the standard path)."""
    x = torch.randn(n, hidden, device=device).to(dtype).requires_grad_(requires_grad)
    w = (torch.randn(vocab, hidden, device=device) * scale / hidden**0.5).to(dtype).requires_grad_(requires_grad)
    b = (torch.randn(vocab, device=device) * 0.5).to(dtype) if bias else None
    t = torch.randint(0, vocab, (n,), device=device)
    if ignore:
        t[torch.rand(n, device=device) < ignore] = ignore_index
    cw = torch.rand(vocab, device=device) + 0.2 if weight_cls else None
    return x, w, b, t, cw


def count_172_case(backend, device):
    """bf16 x (200, 64), w (8192, 64), targets, and which 172 of the rows count (1 / 172 lies near a bf16
    rounding tie): where a mean's scale folded into 16-bit dlogits shows. Skips the interpreter, whose
    16-bit casts truncate where CUDA rounds."""
    if backend == "triton" and device.type == "cpu":
        pytest.skip("the interpreter truncates 16-bit casts where CUDA rounds: covered on a GPU")
    n, vocab, hidden = 200, 8192, 64
    x = torch.randn(n, hidden, device=device).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, hidden, device=device) * hidden**-0.5 * 0.5).to(torch.bfloat16).requires_grad_()
    kept = torch.ones(n, dtype=torch.bool, device=device)
    kept[torch.randperm(n, device=device)[:28]] = False
    return x, w, torch.randint(0, vocab, (n,), device=device), kept
