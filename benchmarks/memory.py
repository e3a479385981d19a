#!/usr/bin/env python
"""Peak memory of DP training ÷ non-private training at LLM-like shapes (issue #24).

For each cell of {no checkpointing, activation checkpointing} × {full, LoRA, QLoRA} × {non-private, flat,
per-layer} × T, ONE subprocess builds a Llama-style causal LM from the same seed, builds the trainer (HF ``Trainer``
for non-private, ``hf_dp.DPTrainer`` for the DP modes; fixed batches of B random-token rows of length T, AdamW), and
runs two optimizer steps. Reported: the **peak memory the two steps add to the freshly built model and trainer**
(parameters and the quantised base are there before; gradients, optimizer state, activations, per-example state and
temporaries are what the steps add), and the ratio DP ÷ non-private in the same cell.

* Checkpointing is turned on on the model (``model.gradient_checkpointing_enable``, non-reentrant, as
  ``peft.prepare_model_for_kbit_training`` and trl do), for both trainers, so both run the same model.
* QLoRA: the base quantised by bitsandbytes to nf4 (float32 compute on CPU, bfloat16 on GPU) after
  ``prepare_model_for_kbit_training``; LoRA r = 8 on every attention and MLP projection.
* CPU: live tensor bytes (``LiveTensorBytes`` of ``benchmarks/run.py``: every live CPU tensor storage, like a device
  allocator's "max allocated"). GPU (``--preset gpu``): ``torch.cuda.max_memory_allocated``.
* ``--max-batch``: the largest micro-batch B whose two steps fit ``--budget-mib`` (model + what the steps add),
  doubling then bisection, one subprocess per probe.

Examples::

    python benchmarks/memory.py                       # CPU preset: Llama 6 × 256, vocab 2,048, B = 8, T ∈ {512, 2048}
    python benchmarks/memory.py --seq-lens 512 --variants full --modes nonprivate flat    # one slice
    python benchmarks/memory.py --preset gpu --max-batch --budget-mib 20000             # one GPU
    python benchmarks/memory.py --tiny                # every code path in seconds (harness check)
    python benchmarks/memory.py --layers 2 --vocab 128000 --batch-size 2 --seq-lens 1024 --variants full \
        --checkpointing-options on --lm-loss-chunk-size 128   # large vocabularies (issue 24, item 3)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
for path in (_REPO, _HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from run import ListDataset, LiveTensorBytes, environment  # noqa: E402

MODES = ("nonprivate", "flat", "per_layer")
VARIANTS = ("full", "lora", "qlora")
PRESETS = {
    # The CPU shape: Llama-style 6 × 256, vocabulary 2,048, B = 8.
    "cpu": dict(layers=6, width=256, heads=4, vocab=2048, batch_size=8, seq_lens=[512, 2048]),
    # One GPU: a ~1 B-parameter Llama layout (16 × 2048, vocabulary 32 k), B = 8.
    "gpu": dict(layers=16, width=2048, heads=16, vocab=32000, batch_size=8, seq_lens=[512, 2048]),
}


# ====================================================================== one cell, in its own process
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def llama_config(args: argparse.Namespace, seq_len: int, min_positions: int = 1024):
    """The Llama-style causal LM of a cell (also ``benchmarks/gpu_llm.py``'s)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.width, intermediate_size=4 * args.width,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
                       max_position_embeddings=max(seq_len, min_positions), tie_word_embeddings=False,
                       bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False)


def quantized_base(path: str, device: torch.device):
    """The saved base reloaded with bitsandbytes nf4 (bf16 compute on CUDA) and prepared for k-bit training."""
    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    compute = torch.bfloat16 if device.type == "cuda" else torch.float32
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute)
    device_map = {"": device.index or 0} if device.type == "cuda" else "cpu"
    model = LlamaForCausalLM.from_pretrained(path, quantization_config=quant, device_map=device_map,
                                             dtype=torch.float32)
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def adapt(model, variant: str, checkpointing: bool):
    """LoRA r = 8 on every attention and MLP projection (``lora``, ``qlora``); activation checkpointing turned on on
    the model (non-reentrant) when asked; train mode."""
    if variant in ("lora", "qlora"):
        from peft import LoraConfig, TaskType, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type=TaskType.CAUSAL_LM, r=8, lora_alpha=16, lora_dropout=0.0,
                                                 target_modules=LORA_TARGETS))
        model.enable_input_require_grads()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def build_model(args: argparse.Namespace, variant: str, checkpointing: bool, device: torch.device, tmp: str):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(args, args.seq_len))
    if variant == "qlora":
        model.save_pretrained(tmp)
        del model
        model = quantized_base(tmp, device)
    else:
        model = model.to(device)
    return adapt(model, variant, checkpointing)


def dataset(args: argparse.Namespace) -> ListDataset:
    gen = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(4 * args.batch_size):
        ids = torch.randint(0, args.vocab, (args.seq_len,), generator=gen)
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return ListDataset(rows)


def build_trainer(args: argparse.Namespace, mode: str, model, data, outdir: str, device: torch.device):
    from transformers import Trainer, TrainingArguments

    common = dict(output_dir=outdir, per_device_train_batch_size=args.batch_size, max_steps=2, learning_rate=1e-5,
                  lr_scheduler_type="constant", optim="adamw_torch", report_to="none", save_strategy="no",
                  disable_tqdm=True, logging_strategy="no", use_cpu=device.type == "cpu", dataloader_num_workers=0,
                  remove_unused_columns=False)
    if mode == "nonprivate":
        return Trainer(model=model, args=TrainingArguments(**common, max_grad_norm=0.0), train_dataset=data)
    from hf_dp import DPTrainer, DPTrainingArguments

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        passes = {"flat_clipping_passes": args.flat_clipping_passes} if mode == "flat" else {}
        dp = DPTrainingArguments(**common, noise_multiplier=1.0, per_sample_max_grad_norm=1.0, clipping=mode,
                                 poisson_sampling=False, dp_self_check=False, target_delta=1e-5,
                                 lm_loss_chunk_size=args.lm_loss_chunk_size, **passes)
    return DPTrainer(model=model, args=dp, train_dataset=data)


def child(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    out: dict[str, Any] = {"mode": args.mode, "variant": args.variant, "checkpointing": args.checkpointing,
                           "seq_len": args.seq_len, "batch_size": args.batch_size}
    if args.mode == "flat":
        out["flat_clipping_passes"] = args.flat_clipping_passes
    tracker = LiveTensorBytes() if device.type == "cpu" else None
    try:
        with tracker or contextlib.nullcontext(), tempfile.TemporaryDirectory() as tmp:
            model = build_model(args, args.variant, args.checkpointing, device, os.path.join(tmp, "base"))
            trainer = build_trainer(args, args.mode, model, dataset(args), os.path.join(tmp, "out"), device)
            gc.collect()
            if tracker is not None:
                base = tracker.live
                tracker.reset_peak()
            else:
                torch.cuda.synchronize(device)
                base = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer.train()
            out["seconds_two_steps"] = time.perf_counter() - start
            if tracker is not None:
                peak = tracker.peak
            else:
                torch.cuda.synchronize(device)
                peak = torch.cuda.max_memory_allocated(device)
            out.update(ok=True, model_bytes=base, added_bytes=peak - base, peak_bytes=peak)
    except torch.OutOfMemoryError as exc:
        out.update(ok=False, oom=True, error=str(exc).splitlines()[0][:300])
    except Exception as exc:  # noqa: BLE001 - reported in the table, not hidden
        out.update(ok=False, oom="out of memory" in str(exc).lower(), error=f"{type(exc).__name__}: {exc}"[:400],
                   traceback=traceback.format_exc(limit=8))
    return out


def run_cell(args: argparse.Namespace, mode: str, variant: str, checkpointing: bool, seq_len: int,
             batch_size: int | None = None) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--mode", mode, "--variant", variant,
           "--seq-len", str(seq_len), "--device", args.device, "--layers", str(args.layers), "--width",
           str(args.width), "--heads", str(args.heads), "--vocab", str(args.vocab), "--batch-size",
           str(batch_size or args.batch_size), "--flat-clipping-passes", args.flat_clipping_passes] + (
               ["--checkpointing"] if checkpointing else []) + (
        ["--lm-loss-chunk-size", str(args.lm_loss_chunk_size)] if args.lm_loss_chunk_size else [])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "variant": variant, "ok": False, "error": f"timeout after {args.timeout}s"}
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"mode": mode, "variant": variant, "ok": False, "error": f"exit {proc.returncode}: {proc.stderr[-400:]}"}


def largest_batch(args: argparse.Namespace, mode: str, variant: str, checkpointing: bool, seq_len: int) -> int:
    """Largest B whose model + two steps fit ``--budget-mib``: doubling, then bisection (0: not even B = 1)."""
    budget = args.budget_mib * 2**20

    def fits(b: int) -> bool:
        r = run_cell(args, mode, variant, checkpointing, seq_len, batch_size=b)
        return bool(r.get("ok")) and r["peak_bytes"] <= budget

    lo, hi = 0, 1
    while hi <= args.max_batch_limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, args.max_batch_limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# ====================================================================== the table
def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:,.0f}"


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    chunked = f", DP loss in chunks of {args.lm_loss_chunk_size} positions" if args.lm_loss_chunk_size else ""
    lines = [f"Llama-style {args.layers} × {args.width}, vocabulary {args.vocab:,}, B = {args.batch_size}{chunked}, "
             f"{'CPU live tensor bytes' if args.device == 'cpu' else 'torch.cuda.max_memory_allocated'}: "
             "MiB the two steps add to the built model (DP ÷ non-private in the same cell)", "",
             "| T | checkpointing | variant | non-private | flat | per-layer | largest B (non-private / flat / "
             "per-layer) |", "|---:|---|---|---:|---:|---:|---|"]
    cells: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        cells.setdefault((r["seq_len"], r["checkpointing"], r["variant"]), {})[r["mode"]] = r
    for (t, ckpt, variant), by_mode in cells.items():
        ref = by_mode.get("nonprivate", {})
        parts = []
        for mode in MODES:
            r = by_mode.get(mode)
            if r is None:
                parts.append("-")
            elif not r.get("ok"):
                parts.append("OOM" if r.get("oom") else f"error: {r.get('error', '')[:60]}")
            elif mode == "nonprivate" or not ref.get("ok"):
                parts.append(_mib(r["added_bytes"]))
            else:
                parts.append(f"{_mib(r['added_bytes'])} ({r['added_bytes'] / ref['added_bytes']:.2f}×)")
        largest = " / ".join(str(by_mode.get(m, {}).get("largest_batch", "-")) for m in MODES)
        lines.append(f"| {t:,} | {'on' if ckpt else 'off'} | {variant} | " + " | ".join(parts) + f" | {largest} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="cpu (default on CPU) or gpu")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--checkpointing-options", nargs="+", choices=["off", "on"], default=["off", "on"])
    p.add_argument("--seq-lens", nargs="+", type=int, default=None)
    p.add_argument("--flat-clipping-passes", choices=["auto", "one", "two"], default="auto",
                   help="DPTrainingArguments.flat_clipping_passes of the flat cells (auto: two with checkpointing)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--lm-loss-chunk-size", type=int, default=None,
                   help="DP modes: DPTrainingArguments.lm_loss_chunk_size (the LM head in chunks of positions)")
    p.add_argument("--tiny", action="store_true", help="2 × 64, vocabulary 128, B = 2, T = 32: a harness check")
    p.add_argument("--max-batch", action="store_true", help="also the largest B within --budget-mib")
    p.add_argument("--budget-mib", type=float, default=4096)
    p.add_argument("--max-batch-limit", type=int, default=256)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--json", default=None, help="write all results here")
    p.add_argument("--markdown", default=None, help="write the table here")
    # child process
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    p.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    preset = dict(PRESETS[args.preset or ("gpu" if args.device.startswith("cuda") else "cpu")])
    if args.tiny:
        preset.update(layers=2, width=64, heads=2, vocab=128, batch_size=2, seq_lens=[32])
    for key in ("layers", "width", "heads", "vocab", "batch_size", "seq_lens"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        torch.set_num_threads(max(1, torch.get_num_threads()))
        print(json.dumps(child(args)))
        return 0
    rows = []
    for t in args.seq_lens:
        for ckpt in args.checkpointing_options:
            for variant in args.variants:
                for mode in args.modes:
                    r = run_cell(args, mode, variant, ckpt == "on", t)
                    if args.max_batch and r.get("ok"):
                        r["largest_batch"] = largest_batch(args, mode, variant, ckpt == "on", t)
                    rows.append(r)
                    status = _mib(r.get("added_bytes")) + " MiB" if r.get("ok") else r.get("error", "")[:120]
                    print(f"T={t} checkpointing={ckpt} {variant} {mode}: {status}", flush=True)
    table = markdown(rows, args)
    print("\n" + table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(), "args": vars(args), "rows": rows}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
