"""flce.import_hooks: ``import flce`` stays light, and the transformers backend, the patches and the
torch.compile graph break work whichever of flce, transformers and torch._dynamo is imported first.

The import-order tests run in fresh interpreters (a pytest process has imported everything already)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import flce
from flce import import_hooks

SRC = str(Path(flce.__file__).resolve().parents[1])
TESTS = str(Path(__file__).resolve().parent)


def run_python(code: str) -> str:
    """Run ``code`` in a fresh interpreter that imports this flce and tests/ helpers; returns stdout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, TESTS, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_import_flce_leaves_transformers_accelerate_dynamo_and_triton_out():
    out = run_python("""
        import sys
        import flce
        heavy = ("transformers", "accelerate", "triton", "torch._dynamo", "flce.patches")
        print(sorted(m for m in sys.modules if m in heavy or m.startswith(tuple(h + "." for h in heavy))))
    """)
    assert out.strip() == "[]"


def test_public_patch_names_and_submodules_load_on_first_use():
    from flce import distributed, patches
    from flce.patches import apply_flce_patch, remove_flce_patch

    assert flce.apply_flce_patch is apply_flce_patch and flce.remove_flce_patch is remove_flce_patch
    assert flce.patches is patches and flce.distributed is distributed
    assert {"apply_flce_patch", "remove_flce_patch", "patches", "distributed"} <= set(dir(flce))
    with pytest.raises(AttributeError, match="no_such_name"):
        flce.no_such_name  # noqa: B018


HF_ORDER = """
    import sys
    if {transformers_first}:
        import transformers.modeling_utils  # imports transformers.integrations.moe
        assert "transformers.integrations.moe" in sys.modules and "flce" not in sys.modules
    import flce
    import flce.experts
    if not {transformers_first}:
        assert "transformers" not in sys.modules
    import torch
    import hf_tiny

    calls = []
    fused = flce.experts.experts_forward
    def counting(*args, **kwargs):
        calls.append(1)
        return fused(*args, **kwargs)
    flce.experts.experts_forward = counting

    mixtral = hf_tiny.tiny_model("mixtral")
    mixtral.set_experts_implementation("flce")
    batch = hf_tiny.tiny_batch()
    loss = mixtral(**batch).loss
    loss.backward()
    assert len(calls) == mixtral.config.num_hidden_layers, calls
    assert torch.isfinite(loss)

    llama = hf_tiny.tiny_model("llama")
    hf_tiny.assert_patched_matches(llama, batch, 1e-5, 1e-4)
    print("ok")
"""


@pytest.mark.parametrize("transformers_first", [True, False], ids=["transformers-first", "flce-first"])
def test_experts_backend_and_patch_work_in_either_import_order(transformers_first):
    assert run_python(HF_ORDER.format(transformers_first=transformers_first)).strip().endswith("ok")


COMPILE = """
    import sys
    import torch
    if {dynamo_first}:
        import torch._dynamo
    import flce
    import flce.distributed
    assert ("torch._dynamo" in sys.modules) == {dynamo_first}
    import torch._dynamo
    import torch.distributed as dist
    from torch._dynamo.testing import CompileCounter

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    flat = ((13, 16), (50, 16), (13,))
    # linear_cross_entropy traces into its custom ops (flce/loss_op.py): no break, one graph
    for loss_fn, (shape_x, shape_w, shape_t), breaks in [
        (flce.linear_cross_entropy, flat, 0),
        (flce.grouped_linear_cross_entropy, ((5, 2, 16), (2, 50, 16), (5, 2)), 1),
        (flce.distributed.vocab_parallel_linear_cross_entropy, flat, 1),
    ]:
        x = torch.randn(shape_x, dtype=torch.float64, requires_grad=True)
        w = torch.randn(shape_w, dtype=torch.float64, requires_grad=True)
        t = torch.randint(0, 50, shape_t)

        def step(x, w, t):
            return loss_fn(x * 2.0, w, t, backend="torch") + 1.0

        want = step(x, w, t)
        want_grads = torch.autograd.grad(want, (x, w))
        torch._dynamo.reset()
        explained = torch._dynamo.explain(step)(x, w, t)
        assert explained.graph_break_count == breaks, (loss_fn.__name__, explained.break_reasons)
        assert not breaks or "disable" in str(explained.break_reasons[0].reason), loss_fn.__name__
        torch._dynamo.reset()
        counter = CompileCounter()
        got = torch.compile(step, backend=counter)(x, w, t)
        got_grads = torch.autograd.grad(got, (x, w))
        assert counter.frame_count == 1 + breaks, (loss_fn.__name__, counter.frame_count)  # x * 2, then + 1
        # the same eager code runs on both sides of the graph break (or inside the custom op)
        assert torch.equal(got, want), loss_fn.__name__
        assert all(torch.equal(g, h) for g, h in zip(got_grads, want_grads)), loss_fn.__name__
    dist.destroy_process_group()
    print("ok")
"""


@pytest.mark.parametrize("dynamo_first", [True, False], ids=["dynamo-first", "flce-first"])
def test_compiled_loss_calls_trace_or_break_once_with_the_eager_result(dynamo_first):
    assert run_python(COMPILE.format(dynamo_first=dynamo_first)).strip().endswith("ok")


def test_when_imported_runs_after_a_later_import_and_at_once_for_an_earlier_one(tmp_path, monkeypatch):
    (tmp_path / "flce_hook_probe.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flce_hook_probe", raising=False)
    seen = []
    import_hooks.when_imported("flce_hook_probe", lambda m: seen.append(m.VALUE))
    assert seen == []
    import flce_hook_probe

    assert seen == [42]
    assert type(flce_hook_probe.__loader__).__module__ != import_hooks.__name__  # its own loader again
    assert import_hooks._FINDER not in sys.meta_path or "flce_hook_probe" not in import_hooks._pending
    import_hooks.when_imported("flce_hook_probe", lambda m: seen.append(-m.VALUE))
    assert seen == [42, -42]


def test_compile_disabled_keeps_the_function_signature_and_result():
    def add(a: int, b: int = 1) -> int:
        """Doc."""
        return a + b

    wrapped = import_hooks.compile_disabled(add)
    assert wrapped(2, b=3) == 5 and wrapped.__doc__ == "Doc." and wrapped.__wrapped__ is add
