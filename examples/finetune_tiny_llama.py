"""Fine-tune a small random Llama with transformers.Trainer, with and without flce's patch.

The patch is one line before the Trainer: ``flce.apply_flce_patch(model)``. Each variant runs in its
own process, so each peak-memory figure is its own (CUDA: peak allocated; CPU: peak resident set).

    PYTHONPATH=src python examples/finetune_tiny_llama.py            # both variants, table at the end
    PYTHONPATH=src python examples/finetune_tiny_llama.py --steps 3  # shorter

Writes finetune_tiny_llama.json and .md into $OUT (default ./out). On one GPU: bf16 mixed precision,
vocabulary 128256 (Llama-3's), about a minute; on a CPU: float32, vocabulary 32000, a few minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

import flce


def parse_args() -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=["both", "patched", "unpatched"], default="both")
    parser.add_argument("--steps", type=int, default=20 if cuda else 3)
    parser.add_argument("--batch", type=int, default=4 if cuda else 8)
    parser.add_argument("--seq", type=int, default=1024 if cuda else 512)
    parser.add_argument("--vocab", type=int, default=128256 if cuda else 32000)
    parser.add_argument("--hidden", type=int, default=512 if cuda else 64)
    parser.add_argument("--layers", type=int, default=2)
    # The CPU (torch) kernel makes a few float32 temporaries of a chunk, so on the CPU smaller chunks
    # keep the peak low; the Triton kernel works in place, and the default plan suits it.
    parser.add_argument("--chunk-size", type=int, default=None if cuda else 512)
    return parser.parse_args()


def tiny_llama(args: argparse.Namespace) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=args.seq, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def synthetic_dataset(args: argparse.Namespace) -> list[dict]:
    """Random token rows with a learnable pattern (each row repeats a short motif); the first quarter of
    every row is prompt (-100 labels), as in instruction tuning."""
    generator = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(args.batch * args.steps):
        motif = torch.randint(3, args.vocab, (16,), generator=generator)
        input_ids = motif.repeat(args.seq // 16 + 1)[: args.seq]
        labels = input_ids.clone()
        labels[: args.seq // 4] = -100
        rows.append({"input_ids": input_ids, "labels": labels, "attention_mask": torch.ones_like(input_ids)})
    return rows


def run_variant(args: argparse.Namespace) -> dict:
    """Train one variant in this process; return its losses, time and peak memory."""
    cuda = torch.cuda.is_available()
    model = tiny_llama(args)
    if args.variant == "patched":
        flce.apply_flce_patch(model, chunk_size=args.chunk_size)  # the one line, before the Trainer
    with tempfile.TemporaryDirectory() as out_dir:
        training_args = transformers.TrainingArguments(
            output_dir=out_dir, per_device_train_batch_size=args.batch, max_steps=args.steps,
            learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", bf16=cuda, use_cpu=not cuda,
            disable_tqdm=True, seed=0, dataloader_num_workers=0)
        trainer = transformers.Trainer(model=model, args=training_args, train_dataset=synthetic_dataset(args))
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    if cuda:
        peak, what = torch.cuda.max_memory_allocated(), "peak CUDA memory allocated"
    else:  # Linux reports kilobytes
        peak, what = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak resident set (process)"
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    return {"variant": args.variant, "losses": losses, "seconds": seconds, "peak_bytes": peak,
            "peak_what": what, "device": torch.cuda.get_device_name() if cuda else "cpu"}


def run_both(args: argparse.Namespace) -> list[dict]:
    """Each variant in a fresh process, so neither inherits the other's peak."""
    results = []
    for variant in ("unpatched", "patched"):
        sizes = ("steps", "batch", "seq", "vocab", "hidden", "layers")
        argv = [sys.executable, __file__, "--variant", variant] + [f"--{k}={getattr(args, k)}" for k in sizes]
        if args.chunk_size is not None:
            argv.append(f"--chunk-size={args.chunk_size}")
        done = subprocess.run(argv, check=True, capture_output=True, text=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return results


def report(args: argparse.Namespace, results: list[dict]) -> str:
    lines = [f"Trainer fine-tuning of a random Llama ({args.layers} layers, hidden {args.hidden}, vocabulary "
             f"{args.vocab}), batch {args.batch} x {args.seq} tokens, {args.steps} steps on {results[0]['device']}"
             f", flce chunk_size {args.chunk_size or 'planned'}",
             "", f"| variant | {results[0]['peak_what']} | seconds | first loss | last loss |",
             "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['variant']} | {r['peak_bytes'] / 2**20:,.0f} MiB | {r['seconds']:.1f} | "
                     f"{r['losses'][0]:.4f} | {r['losses'][-1]:.4f} |")
    worst = max(abs(a - b) / abs(b) for a, b in zip(results[1]["losses"], results[0]["losses"]))
    lines += ["", f"largest relative difference of a per-step loss, patched vs unpatched: {worst:.2e}"]
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.variant != "both":
        print(json.dumps(run_variant(args)))
        return
    results = run_both(args)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    table = report(args, results)
    (out / "finetune_tiny_llama.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    (out / "finetune_tiny_llama.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
