"""Probe (session 5, H200): host cost of one Triton launch by path (the usual launch, our launcher
function, the compiled kernel's own ``run``, a 2-argument kernel), beside torch ops, and a cProfile of
a flce step at BT=16. GPU only: PYTHONPATH=src:benchmark taskset -c 4 python benchmark/probes/host_probe.py.
Result (a slow H200 host): the usual launch 40 us, the compiled kernel's ``run`` 25, a 2-argument kernel
25, torch.mm 37: launching through the compiled handle would save ~15 us of a 670 us step."""
from __future__ import annotations
import cProfile, pstats, statistics, io
import torch, triton, triton.language as tl
import flce
from common import host_us_per_call
from flce.kernels.ce_triton import _ce_kernel, ce_chunk_triton, LaunchConfig
from flce.options import LossOptions

@triton.jit
def _tiny(p, n):
    tl.store(p + tl.arange(0, 16), tl.zeros((16,), tl.float32), mask=tl.arange(0, 16) < n)

dev = torch.device("cuda")
bt, H, V = 16, 4096, 128256
logits = torch.randn(bt, V, device=dev, dtype=torch.bfloat16)
t = torch.randint(0, V, (bt,), device=dev)
loss, lse = torch.empty(bt, device=dev), torch.empty(bt, device=dev)
scale = torch.ones((), device=dev)
opts = LossOptions()
small = torch.empty(16, device=dev)
x = torch.randn(bt, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
w = (torch.randn(V, H, device=dev) * H**-0.5).to(torch.bfloat16).requires_grad_()

def launch_args():
    return (logits, logits.stride(0), t, loss, loss, scale, loss, lse, loss, loss, loss, bt, V, -100, 0.0, 0.0, 1.0, 1.0)
KW = dict(HAS_WEIGHT=False, HAS_SMOOTHING=False, HAS_Z_LOSS=False, HAS_SOFTCAP=False, COMPUTE_GRAD=True,
          SCALE_PER_ROW=False, COMPUTE_ACC=False, MEAN_BY_COUNT=False, BLOCK_V=32768, num_warps=16)
k = _ce_kernel[(bt,)](*launch_args(), **KW)
print("kernel.run signature args:", k.run.__doc__ if hasattr(k.run, "__doc__") else None)

def direct():
    args = launch_args()
    stream = torch.cuda.current_stream().cuda_stream
    k.run(bt, 1, 1, stream, k.function, k.packed_metadata, None, None, None, *args, *KW_CONST)
KW_CONST = (False, False, False, False, True, False, False, False, 32768)

variants = {
    "torch.mm (16 x 4096 x 128256)": lambda: torch.mm(x.detach(), w.detach().t()),
    "torch.empty x3": lambda: (torch.empty(bt, device=dev), torch.empty(bt, device=dev), torch.empty(bt, device=dev)),
    "tiny triton kernel (2 args)": lambda: _tiny[(1,)](small, 16),
    "_ce_kernel[grid] (29 args)": lambda: _ce_kernel[(bt,)](*launch_args(), **KW),
    "ce_chunk_triton": lambda: ce_chunk_triton(logits, t, loss, lse, None, None, None, scale, opts),
    "flce fwd+bwd unchecked": lambda: torch.autograd.grad(flce.linear_cross_entropy(x, w, t, validate_target=False), (x, w)),
    "eager fwd+bwd": lambda: torch.autograd.grad(torch.nn.functional.cross_entropy((x @ w.t()).float(), t), (x, w)),
}
try:
    direct(); torch.cuda.synchronize()
    variants["kernel.run direct"] = direct
except Exception as e:
    print("direct launch failed:", type(e).__name__, e)

times = host_us_per_call(variants)
for n, v in times.items():
    print(f"{n:34s} {statistics.median(v):8.1f} us")

prof = cProfile.Profile()
step = variants["flce fwd+bwd unchecked"]
for _ in range(50): step()
torch.cuda.synchronize()
prof.enable()
for i in range(400):
    if i % 50 == 0:
        torch.cuda.synchronize(); torch.cuda._sleep(200_000_000)
    step()
prof.disable()
torch.cuda.synchronize()
s = io.StringIO()
ps = pstats.Stats(prof, stream=s).sort_stats("tottime"); ps.print_stats(30)
ps.sort_stats("cumulative"); ps.print_stats(40)
print(s.getvalue())
