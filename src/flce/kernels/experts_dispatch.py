"""Which implementation runs each stage of the experts layer, chosen per shape by measuring.

GEMM paths (see ``experts_triton`` / ``experts_torch``):

- ``"triton"``: flce's grouped GEMM kernels (CUDA; the CPU interpreter when asked for by name).
- ``"triton_tma"``: the same with TMA loads for the row-grouped GEMMs (Hopper+; the weight-gradient
  GEMMs, whose rows are cut at expert boundaries, stay on ``"triton"``).
- ``"grouped_mm"``: torch's grouped GEMM (CUTLASS on sm90/sm100, bfloat16 only on CUDA).
- ``"loop"``: one ``mm`` per expert after reading the offsets on the host (exact, any dtype; a host sync
  on CUDA, once per layer call, so not graph-safe; the CPU default and the CUDA fallback for other dtypes).
- ``"auto"``: on CUDA, every graph-safe path that can run is timed once per problem (role, dtypes,
  sizes, rows rounded to a power of two) and the fastest is kept: cuBLAS-style grouped GEMMs are known
  to pick poor tile plans at some shapes, so nothing is assumed. A GEMM of at least ``LOOP_MIN_FLOP``
  per expert and ``LOOP_MIN_WIDTH`` in both its output width and its reduction runs the ``loop``
  instead: there cuBLAS's dense GEMMs beat the grouped ones in the layer and the one host sync per
  layer call is small beside the work (layer timings on an H200 in benchmark/NOTES.md, Experts).
  While a CUDA graph is being captured (torch.compile's ``mode="reduce-overhead"`` included), while dynamo
  traces, or with ``torch.cuda.set_sync_debug_mode`` on, no host sync is made: the fastest graph-safe path
  measured, else the first candidate, runs (nothing is timed then). Under torch.compile the layer is a custom
  op whose body runs as it does eagerly, so a compiled graph's call measures and may sync as an eager one.
  Run one step before capturing (Triton's own autotuning needs that too).

Elementwise stages (the activation, combine, the biases' per-expert sums) use Triton on CUDA and torch elsewhere
unless told otherwise.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Callable

import torch

from . import experts_torch as twin
from . import nvidia_major, triton_available

GEMM_PATHS = ("auto", "triton", "triton_tma", "grouped_mm", "loop")
ELEMENTWISE_BACKENDS = ("auto", "triton", "torch")
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TIMING_ROUNDS = 7
LOOP_MIN_FLOP = 2.5e10  # per expert: ~40 us on an H200
LOOP_MIN_WIDTH = 4096
_choices: dict[tuple, str] = {}
_loop_keys: set[tuple] = set()
_auto_candidates: dict[tuple, list[str]] = {}


def clear_choices() -> None:
    """Forget the measured GEMM choices (they are kept for the life of the process)."""
    _choices.clear()
    _loop_keys.clear()


def chosen_paths() -> dict[tuple, str]:
    """The GEMM path ``auto`` ran last per problem key (a copy, for reports and benchmarks)."""
    return {**_choices, **dict.fromkeys(_loop_keys, "loop")}


# ------------------------------------------------------------------------------------ availability

def _triton_ok(device: torch.device, dtype: torch.dtype) -> bool:
    return dtype in _TRITON_DTYPES and triton_available(device)


def _grouped_mm_ok(device: torch.device, dtype: torch.dtype, operands: tuple[torch.Tensor, ...],
                   kind: str = "rows") -> bool:
    """torch's grouped GEMM without a host sync: CUTLASS kernels (sm90/sm100, bf16) and 16-byte strides.

    Weight gradients only on sm90: on sm100 an expert without rows gets a non-zero gradient
    (pytorch/pytorch#172439).
    """
    if not twin.has_grouped_mm():
        return False
    if device.type == "cuda":
        arch = nvidia_major(device)
        if dtype != torch.bfloat16 or arch not in ((9,) if kind == "wgrad" else (9, 10)):
            return False
    elif dtype not in _TRITON_DTYPES:
        return False
    align = 16 // dtype.itemsize
    return all(t.data_ptr() % 16 == 0 and all(s % align == 0 for s in t.stride() if s != 1) for t in operands)


def _tma_ok(device: torch.device, dtype: torch.dtype, operands: tuple[torch.Tensor, ...]) -> bool:
    if not _triton_ok(device, dtype):
        return False
    from .experts_triton import tma_ok

    return tma_ok(*operands)


def check_choice(name: str, value, choices: tuple) -> None:
    """A ValueError naming the argument unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def gemm_path(gemm: str | None) -> str:
    """The GEMM path asked for: ``gemm``, else ``FLCE_EXPERTS_GEMM``, else "auto"."""
    gemm = gemm if gemm is not None else os.environ.get("FLCE_EXPERTS_GEMM", "auto")
    check_choice("gemm", gemm, GEMM_PATHS)
    return gemm


def _candidates(path: str, kind: str, device: torch.device, dtype: torch.dtype,
                operands: tuple[torch.Tensor, ...]) -> list[str]:
    check_choice("gemm", path, GEMM_PATHS)
    if path == "triton_tma" and kind == "wgrad":
        path = "triton"
    if path == "triton_tma" and not _tma_ok(device, dtype, operands):
        raise ValueError(f"gemm='triton_tma' cannot run {dtype} on {device.type} here (needs triton 3.4+, a "
                         "Hopper GPU or the CPU interpreter, float16/bfloat16, and 16-byte aligned operands)")
    if path in ("triton", "triton_tma") and not _triton_ok(device, dtype):
        raise ValueError(f"gemm='triton' cannot run {dtype} on {device.type} here (needs CUDA, or "
                         "TRITON_INTERPRET=1 on the CPU, and a float16/bfloat16/float32 dtype)")
    if path == "grouped_mm" and not _grouped_mm_ok(device, dtype, operands, kind):
        raise ValueError(f"gemm='grouped_mm' cannot run {dtype} on {device.type} here (needs torch's grouped_mm, "
                         "bfloat16 on an sm90/sm100 GPU, and 16-byte aligned strides)")
    if path != "auto":
        return [path]
    if device.type != "cuda":
        return ["loop"]
    # the checks cost ~14 us per GEMM, a host-bound small layer's time: kept per layout (rows aside)
    layout = (kind, device, dtype, tuple((t.shape[1:], t.stride(), t.data_ptr() % 16) for t in operands))
    found = _auto_candidates.get(layout)
    if found is None:
        found = [name for name, ok in (("triton", _triton_ok(device, dtype)),
                                       ("triton_tma", kind == "rows" and _tma_ok(device, dtype, operands)),
                                       ("grouped_mm", _grouped_mm_ok(device, dtype, operands, kind))) if ok]
        found = _auto_candidates[layout] = found or ["loop"]
    return found


# ------------------------------------------------------------------------------------ measuring

def _can_measure(device: torch.device) -> bool:
    """Outside CUDA-graph capture and torch.compile, where a timing (and a host sync) is allowed."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return False
    compiler = getattr(torch, "compiler", None)
    return not (compiler is not None and compiler.is_compiling())


def _may_sync(device: torch.device) -> bool:
    return _can_measure(device) and torch.cuda.get_sync_debug_mode() == 0


def _time_all(fns: dict[str, Callable[[], object]], key: tuple) -> dict[str, float]:
    """Median milliseconds of each function, timed in interleaved rounds so that clock and power drift
    during the measurement does not favour whichever runs first; a function that fails is left out."""
    for name, fn in list(fns.items()):
        try:
            fn()  # compiles and autotunes outside the timing
        except Exception as exc:  # noqa: BLE001 - a path that cannot run this problem is just not a candidate
            warnings.warn(f"flce experts: GEMM path {name!r} failed on {key}: {exc}", stacklevel=4)
            del fns[name]
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(_TIMING_ROUNDS):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def _loop_sized(rows: int, k: int, n: int, experts: int) -> bool:
    """Per-expert GEMMs large in every dimension, where cuBLAS's dense GEMMs beat the grouped ones in the layer
    (on an H200: Mixtral's H 4096 / I 14336 from T = 512 tokens, not H 1024 / I 3584 even at T = 16384;
    per-GEMM timings alone did not tell them apart reliably; benchmark/NOTES.md, Experts)."""
    return 2.0 * rows * k * n >= LOOP_MIN_FLOP * experts and min(k, n) >= LOOP_MIN_WIDTH


def _pick(key: tuple, candidates: list[str], run: Callable[[str], torch.Tensor], device: torch.device,
          loop_sized: bool) -> str:
    if len(candidates) == 1:
        return candidates[0]
    if key not in _choices and _can_measure(device):  # also under the loop: capture and compile need it
        timings = _time_all({name: (lambda n=name: run(n)) for name in candidates}, key)
        _choices[key] = min(timings, key=timings.get) if timings else candidates[0]
    if loop_sized and _may_sync(device):
        _loop_keys.add(key)
        return "loop"
    _loop_keys.discard(key)
    return _choices.get(key, candidates[0])


def _key(role: str, *tensors: torch.Tensor, experts: int) -> tuple:
    rows = tensors[0].shape[0]
    bucket = 1 << max(0, (rows - 1).bit_length())
    layout = tuple((t.dtype, tuple(t.shape[1:]), tuple(s == 1 for s in t.stride())) for t in tensors)
    return (role, tensors[0].device, experts, bucket, layout)


# ------------------------------------------------------------------------------------ GEMMs

_ROWS = {"triton": "grouped_rows_triton", "triton_tma": "grouped_rows_tma_triton", "grouped_mm": twin.grouped_rows_mm,
         "loop": twin.grouped_rows_loop}
_WGRAD = {"triton": "grouped_wgrad_triton", "grouped_mm": twin.grouped_wgrad_mm, "loop": twin.grouped_wgrad_loop}


def _impl(table: dict, name: str):
    fn = table[name]
    if isinstance(fn, str):  # Triton is imported only when it runs
        from . import experts_triton

        fn = getattr(experts_triton, fn)
    return fn


def rows_mm(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, path: str = "auto") -> torch.Tensor:
    """out[r] = a[r] @ w[e] for the rows of each expert e: a (S, K), w (E, K, N) (any strides) -> (S, N).

    ``offsets`` (E + 1,) int32: expert e owns rows [offsets[e], offsets[e+1]); rows past offsets[E] of
    the result are unspecified.
    """
    cands = _candidates(path, "rows", a.device, a.dtype, (a, w))
    if a.shape[0] == 0:
        return a.new_empty(0, w.shape[2])
    name = _pick(_key("rows", a, w, experts=w.shape[0]), cands, lambda n: _impl(_ROWS, n)(a, w, offsets), a.device,
                 _loop_sized(a.shape[0], a.shape[1], w.shape[2], w.shape[0]))
    return _impl(_ROWS, name)(a, w, offsets)


def wgrad_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, path: str = "auto") -> torch.Tensor:
    """out[e] = a[rows of e]^T @ b[rows of e]: a (S, M), b (S, N) -> (E, M, N); zeros for empty experts."""
    experts = offsets.numel() - 1
    cands = _candidates(path, "wgrad", a.device, a.dtype, (a, b))
    if a.shape[0] == 0:  # no rows at all (torch's grouped_mm rejects a zero-length reduction)
        return a.new_zeros(experts, a.shape[1], b.shape[1])
    name = _pick(_key("wgrad", a, b, experts=experts), cands, lambda n: _impl(_WGRAD, n)(a, b, offsets), a.device,
                 _loop_sized(a.shape[0], a.shape[1], b.shape[1], experts))
    return _impl(_WGRAD, name)(a, b, offsets)


# ------------------------------------------------------------------------------------ elementwise

def resolve_elementwise(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """'auto' is Triton on CUDA for float16/bfloat16/float32 and torch otherwise."""
    check_choice("elementwise", backend, ELEMENTWISE_BACKENDS)
    if backend == "auto":
        return "triton" if device.type == "cuda" and _triton_ok(device, dtype) else "torch"
    if backend == "triton" and not _triton_ok(device, dtype):
        raise ValueError(f"elementwise='triton' cannot run {dtype} on {device.type} here")
    return backend


@functools.cache  # one dict per backend: read at every layer call's forward and backward
def elementwise_ops(backend: str) -> dict[str, Callable]:
    """activation, activation_backward, combine, combine_backward, expert_sums for a resolved backend."""
    if backend == "triton":
        from . import experts_triton as k

        return {"activation": k.activation_triton, "activation_backward": k.activation_backward_triton,
                "combine": k.combine_triton, "combine_backward": k.combine_backward_triton,
                "expert_sums": k.expert_sums_triton}
    return {"activation": twin.activation_torch, "activation_backward": twin.activation_backward_torch,
            "combine": twin.combine_torch, "combine_backward": twin.combine_backward_torch,
            "expert_sums": twin.expert_sums_torch}
