"""The chunk planner is a pure function: rows from the memory budget, accumulator from the chunk count."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
import torch

from flce.gemm import padded_width
from flce.planner import DEFAULT_MEMORY_BUDGET, MIN_ROWS, ROW_ALIGN, plan_chunks


def covered(plan):
    rows = [end - start for start, end in plan.bounds()]
    return sum(rows), rows


@pytest.mark.parametrize("n", [0, 1, 7, 1000, 8192, 8193, 32768, 100_003])
@pytest.mark.parametrize("vocab", [1, 32000, 128256, 256000])
def test_chunks_cover_every_row_once(n, vocab):
    plan = plan_chunks(n, vocab, torch.bfloat16, torch.bfloat16)
    total, rows = covered(plan)
    assert total == n and len(rows) == plan.num_chunks
    assert all(r > 0 for r in rows)


def test_budget_sets_rows_for_llama3_head():
    plan = plan_chunks(8192, 128256, torch.bfloat16, torch.bfloat16)
    assert plan.rows * 128256 * 2 <= DEFAULT_MEMORY_BUDGET
    assert plan.rows >= MIN_ROWS and plan.rows % ROW_ALIGN == 0
    assert plan.num_chunks == 8192 // plan.rows


@pytest.mark.parametrize("vocab", [128257, 32001, 1023])
def test_budget_counts_padded_rows(vocab):
    """At V % 8 != 0 the buffer's rows are padded (``gemm.padded_rows``): a budget of k padded rows
    plans at most k rows, where counting V columns a row would plan one chunk of k + 1."""
    width = padded_width(vocab, 2)
    k = max(MIN_ROWS, vocab // (width - vocab) + 1)  # (k + 1) * vocab <= k * width
    plan = plan_chunks(k + 1, vocab, torch.bfloat16, torch.bfloat16, memory_budget=k * width * 2)
    assert plan.rows <= k and plan.num_chunks == 2


def test_chunks_are_balanced():
    plan = plan_chunks(8193, 128256, torch.bfloat16, torch.bfloat16)
    _, rows = covered(plan)
    assert max(rows) - min(rows) <= ROW_ALIGN  # no tiny memory-bound last chunk


@pytest.mark.parametrize("n", [31000, 32000, 32768, 20481, 15000, 65536])
def test_whole_waves_never_leave_a_short_last_chunk(n):
    """Chunks are rounded to 1024-row blocks only where no short, memory-bound last chunk results."""
    plan = plan_chunks(n, 128256, torch.bfloat16, torch.bfloat16, weight_grad_hidden=4096)
    total, rows = covered(plan)
    assert total == n and min(rows) >= min(MIN_ROWS, max(rows) // 2)
    assert plan.rows * 128256 * 2 <= 128256 * 4096 * 2 + DEFAULT_MEMORY_BUDGET


def test_min_rows_keeps_grad_weight_gemm_compute_bound():
    plan = plan_chunks(65536, 1_000_000, torch.float32, torch.float32)
    assert plan.rows >= MIN_ROWS


def test_small_batch_is_one_chunk_in_weight_dtype():
    for n in (1, 16, 64, 256):
        plan = plan_chunks(n, 128256, torch.bfloat16, torch.bfloat16)
        assert plan.num_chunks == 1 and plan.rows == n
        assert plan.accum_dtype == torch.bfloat16  # one GEMM: rounded once anyway


def test_several_chunks_accumulate_in_fp32():
    plan = plan_chunks(32768, 128256, torch.bfloat16, torch.bfloat16)
    assert plan.num_chunks > 1 and plan.accum_dtype == torch.float32
    plan = plan_chunks(32768, 128256, torch.float16, torch.float16)
    assert plan.accum_dtype == torch.float32
    plan = plan_chunks(32768, 128256, torch.bfloat16, torch.float32)  # autocast, fp32 master weight
    assert plan.accum_dtype == torch.float32


def test_float64_keeps_float64_accumulators():
    """Float64 weights: one chunk or many, the accumulator is float64 (never narrowed to float32)."""
    for n in (16, 32768):
        assert plan_chunks(n, 128256, torch.float64, torch.float64).accum_dtype == torch.float64


def test_user_choices_win():
    plan = plan_chunks(1000, 50, torch.bfloat16, torch.bfloat16, chunk_size=64, accum_dtype=torch.bfloat16)
    assert plan.rows == 64 and plan.accum_dtype == torch.bfloat16 and plan.num_chunks == 16
    assert plan_chunks(10, 50, torch.float32, torch.float32, chunk_size=64).rows == 10


def test_smaller_budget_gives_smaller_chunks():
    big = plan_chunks(32768, 128256, torch.bfloat16, torch.bfloat16)
    small = plan_chunks(32768, 128256, torch.bfloat16, torch.bfloat16, memory_budget=DEFAULT_MEMORY_BUDGET // 8)
    assert small.rows <= big.rows


@pytest.mark.parametrize("hidden", [4096, 2048])
def test_one_chunk_when_logits_fit_in_the_chunked_plan_s_forward_memory(hidden):
    llama3 = dict(vocab=128256, compute_dtype=torch.bfloat16, grad_dtype=torch.bfloat16)
    # 8192 rows of bf16 logits (2.1 GB) <= what several chunks hold in forward: the fp32 (V, H) accumulator
    # and a buffer of the budget plus the bf16 gradient's size (3.7 GB at H 4096, 2.1 GB at 2048): one chunk.
    plan = plan_chunks(8192, **llama3, weight_grad_hidden=hidden)
    assert plan.num_chunks == 1 and plan.accum_dtype == torch.bfloat16
    fit = (DEFAULT_MEMORY_BUDGET + 128256 * hidden * (4 + 2)) // (128256 * 2)
    assert plan_chunks(fit, **llama3, weight_grad_hidden=hidden).num_chunks == 1
    chunked = plan_chunks(fit + 1, **llama3, weight_grad_hidden=hidden)
    assert chunked.num_chunks > 1 and chunked.accum_dtype == torch.float32
    # Either way forward holds at most the accumulator, the budget and the gradient's size.
    assert chunked.rows * 128256 * 2 <= DEFAULT_MEMORY_BUDGET + 128256 * hidden * 2
    # No weight gradient, or an explicit accumulator, or an fp32 gradient: nothing is saved.
    assert plan_chunks(8192, **llama3).num_chunks > 1
    assert plan_chunks(8192, **llama3, weight_grad_hidden=4096, accum_dtype=torch.bfloat16).num_chunks > 1
    assert plan_chunks(8192, 128256, torch.bfloat16, torch.float32, weight_grad_hidden=4096).num_chunks > 1
    # Several chunks: the buffer gets the budget on top of the bf16 weight gradient's size (6144 rows
    # here, whole 1024-row blocks), so the peak grows by the budget alone.
    plan = plan_chunks(32768, **llama3, weight_grad_hidden=4096)
    grad_bytes = 128256 * 4096 * 2
    assert plan.accum_dtype == torch.float32 and plan.rows == 6144
    assert grad_bytes < plan.rows * 128256 * 2 <= grad_bytes + DEFAULT_MEMORY_BUDGET
    small_h = plan_chunks(32768, **llama3, weight_grad_hidden=64)
    assert small_h.rows * 128256 * 2 <= 128256 * 64 * 2 + DEFAULT_MEMORY_BUDGET
    # A user's chunk size still wins.
    assert plan_chunks(8192, **llama3, weight_grad_hidden=4096, chunk_size=2048).num_chunks == 4


@given(n=st.integers(1, 200_000), vocab=st.integers(1, 300_000), hidden=st.integers(0, 16384),
       dtypes=st.sampled_from([(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                               (torch.float16, torch.float16), (torch.float32, torch.float32)]),
       budget=st.sampled_from([0, 2**20, DEFAULT_MEMORY_BUDGET]))
def test_forward_memory_never_exceeds_what_chunks_would_hold(n, vocab, hidden, dtypes, budget):
    """Forward holds at most the budget, plus, where several chunks would sum in float32, that accumulator and
    the gradient's size (or MIN_ROWS rows); one chunk exactly when every row fits there."""
    compute, grad = dtypes
    plan = plan_chunks(n, vocab, compute, grad, memory_budget=budget, weight_grad_hidden=hidden)
    row_bytes = padded_width(vocab, compute.itemsize) * compute.itemsize
    accumulator = vocab * hidden * 4 if grad.itemsize < 4 else 0
    buffer = budget + (vocab * hidden * grad.itemsize if accumulator else 0)
    most = max(buffer // row_bytes, MIN_ROWS)
    assert covered(plan)[0] == n
    if n * row_bytes <= buffer + accumulator or n <= most:
        assert plan.num_chunks == 1 and plan.accum_dtype == grad
    else:
        assert plan.num_chunks > 1 and plan.rows <= most
        assert plan.accum_dtype == (torch.float32 if grad.itemsize < 4 else grad)


def test_weight_grad_hidden_follows_requires_grad_and_grad_mode():
    from flce.planner import weight_grad_hidden

    w = torch.randn(7, 5)
    assert weight_grad_hidden(w) == 0
    w.requires_grad_()
    assert weight_grad_hidden(w) == 5
    with torch.no_grad():
        assert weight_grad_hidden(w) == 0


def test_exp_logits_product_where_several_chunks_sum_in_float32():
    """Several chunks get a whole chunk's grad_input product (the exp-logits path), at any vocabulary; one
    chunk, short chunks, a 16-bit accumulator or no product asked for get none."""
    llama3 = dict(vocab=128256, compute_dtype=torch.bfloat16, grad_dtype=torch.bfloat16, product_hidden=4096)
    assert plan_chunks(32768, weight_grad_hidden=4096, **llama3).input_product_cols == 4096
    assert plan_chunks(32768, weight_grad_hidden=0, **llama3).input_product_cols == 4096  # frozen weight
    assert plan_chunks(8192, weight_grad_hidden=4096, **llama3).input_product_cols == 0  # one chunk
    assert plan_chunks(32768, weight_grad_hidden=4096, chunk_size=512, **llama3).input_product_cols == 0
    assert plan_chunks(32768, weight_grad_hidden=4096, accum_dtype=torch.bfloat16, chunk_size=4096,
                       **llama3).input_product_cols == 0
    assert plan_chunks(32768, weight_grad_hidden=4096, **{**llama3, "product_hidden": 0}).input_product_cols == 0
    small = dict(llama3, vocab=32000, product_hidden=1024)
    assert plan_chunks(65536, weight_grad_hidden=1024, **small).num_chunks > 1
    assert plan_chunks(65536, weight_grad_hidden=1024, **small).input_product_cols == 1024
