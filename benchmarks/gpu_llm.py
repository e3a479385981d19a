#!/usr/bin/env python
"""Peak GPU memory and step time of DP training ÷ non-private training at LLM scale, on one GPU (issue 24).

The GPU counterpart of ``benchmarks/memory.py`` (which measures live CPU tensor bytes and runs one subprocess per
cell): here every cell runs in ONE process, one after another, so that a short lease on a GPU fits the whole grid.
For each cell of T × {no checkpointing, activation checkpointing} × {full, LoRA, QLoRA} × {non-private, flat, ...}:

* a random-init Llama-style causal LM (default ≈ 1.2 B parameters: 16 layers × 2048, MLP 8192, vocabulary 32,000,
  untied head) is built **on the device** from the same seed (QLoRA: saved once in bf16, then reloaded per cell with
  bitsandbytes nf4, bf16 compute, ``peft.prepare_model_for_kbit_training``; LoRA r = 8 on every attention and MLP
  projection, as in memory.py);
* checkpointing, when on, is turned on on the model (``gradient_checkpointing_enable``, non-reentrant), for both
  trainers, as memory.py does (the same as ``gradient_checkpointing=True`` in the arguments; the model, LoRA and
  QLoRA set-up are memory.py's ``llama_config``, ``quantized_base`` and ``adapt``);
* the HF ``Trainer`` (non-private) or ``hf_dp.DPTrainer`` (``clipping=<mode>``, σ = 1, C = 1, fixed batches, no
  self-check) runs ``--warmup`` + ``--steps`` optimizer steps on B fixed-length rows of random tokens (AdamW,
  ``bf16=True`` mixed precision by default on CUDA);
* reported: ``torch.cuda.max_memory_allocated`` over all steps minus the allocated bytes after the model and trainer
  were built (what training adds: gradients, optimizer state, activations, per-example state, temporaries — memory.py's
  measure), the peak of the timed steps alone (steady state, includes the model), and the median wall time of the
  timed steps (``on_step_begin`` → ``on_step_end``, device synchronised at both ends), with DP ÷ non-private ratios.

Each finished cell is appended to ``--json`` and the markdown table rewritten at once, so an interrupted run keeps
what it measured. ``--tiny`` (2 × 64, vocabulary 128, T = 32, B = 2) checks every code path on CPU in seconds
(no memory numbers there).

Examples::

    python benchmarks/gpu_llm.py --shapes 2048:8 4096:4 --json llm.json --markdown llm.md      # one GPU
    python benchmarks/gpu_llm.py --device cpu --tiny --variants full lora qlora                 # harness check
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
for _path in (_REPO, _HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from memory import adapt, llama_config, quantized_base  # noqa: E402
from run import ListDataset, environment  # noqa: E402

MODES = ("nonprivate", "flat", "per_layer")
VARIANTS = ("full", "lora", "qlora")


def save_base(args: argparse.Namespace, path: str) -> None:
    """The QLoRA base, saved once per run in bf16 (the other variants build the same weights on the device)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(llama_config(args, max(args.seq_lens), min_positions=4096))
    model.to(torch.bfloat16).save_pretrained(path)
    del model


def build_model(args: argparse.Namespace, variant: str, checkpointing: bool, seq_len: int, base_path: str):
    """memory.py's cell model, built directly on the device (QLoRA: the base saved once by :func:`save_base`)."""
    from transformers import LlamaForCausalLM

    device = torch.device(args.device)
    if variant == "qlora":
        model = quantized_base(base_path, device)
    else:
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(llama_config(args, seq_len, min_positions=4096))
    return adapt(model, variant, checkpointing)


def make_data(args: argparse.Namespace, seq_len: int, batch_size: int) -> ListDataset:
    gen = torch.Generator().manual_seed(1)
    rows = []
    for _ in range((args.warmup + args.steps) * batch_size):
        ids = torch.randint(0, args.vocab, (seq_len,), generator=gen)
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return ListDataset(rows)


def step_clock(device: torch.device):
    """A ``TrainerCallback`` timing every optimizer step (device synchronised at both ends) and resetting the peak
    memory statistics at the start of the first timed step."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self, warmup: int):
            self.warmup = warmup
            self.times: list[float] = []
            self.timed_peak_reset = False
            self._t0 = 0.0

        def _sync(self) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        def on_step_begin(self, args, state, control, **kwargs):
            self._sync()
            if len(self.times) == self.warmup and device.type == "cuda":
                self.all_steps_peak = torch.cuda.max_memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
                self.timed_peak_reset = True
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self._sync()
            self.times.append(time.perf_counter() - self._t0)

    return StepClock


def warm_device(device: torch.device) -> int:
    """Run a few fp32 and bf16 matmuls (forward and backward) before the first cell: cuBLAS keeps the workspace its
    first matmuls allocate (64 MiB on an H200, counted by ``torch.cuda.memory_allocated``), which would otherwise land
    in the first cell's measured peak and in every later cell's model bytes. Returns the bytes then allocated (CUDA;
    0 elsewhere, where it only exercises the code)."""
    a = torch.randn(512, 512, device=device, requires_grad=True)
    for bf16 in (False, True):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            (a @ a).float().sum().backward()
    del a
    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def build_trainer(args: argparse.Namespace, mode: str, model, data, outdir: str, batch_size: int, callback):
    from transformers import Trainer, TrainingArguments

    device = torch.device(args.device)
    common = dict(output_dir=outdir, per_device_train_batch_size=batch_size, max_steps=args.warmup + args.steps,
                  learning_rate=1e-5, lr_scheduler_type="constant", optim="adamw_torch", report_to="none",
                  save_strategy="no", disable_tqdm=True, logging_strategy="no", use_cpu=device.type == "cpu",
                  dataloader_num_workers=0, remove_unused_columns=False, bf16=args.bf16, seed=0)
    if mode == "nonprivate":
        return Trainer(model=model, args=TrainingArguments(**common, max_grad_norm=0.0), train_dataset=data,
                       callbacks=[callback])
    from hf_dp import DPTrainer, DPTrainingArguments

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dp = DPTrainingArguments(**common, noise_multiplier=1.0, per_sample_max_grad_norm=1.0, clipping=mode,
                                 poisson_sampling=False, dp_self_check=False, target_delta=1e-5, dp_seed=0)
        return DPTrainer(model=model, args=dp, train_dataset=data, callbacks=[callback])


def run_cell(args: argparse.Namespace, mode: str, variant: str, checkpointing: bool, seq_len: int, batch_size: int,
             base_path: str) -> dict[str, Any]:
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    out: dict[str, Any] = {"mode": mode, "variant": variant, "checkpointing": checkpointing, "seq_len": seq_len,
                           "batch_size": batch_size}
    model = trainer = None
    t_cell = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as outdir:
            model = build_model(args, variant, checkpointing, seq_len, base_path)
            out["trainable_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
            callback = step_clock(device)(args.warmup)
            trainer = build_trainer(args, mode, model, make_data(args, seq_len, batch_size), outdir, batch_size,
                                    callback)
            for cb in (PrinterCallback, ProgressCallback):  # no per-run metric prints
                trainer.remove_callback(cb)
            gc.collect()
            if cuda:
                torch.cuda.synchronize(device)
                base = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer.train()
            median = statistics.median(callback.times[args.warmup:])
            out.update(ok=True, step_ms=[1e3 * t for t in callback.times], median_step_ms=1e3 * median,
                       tokens_per_s=batch_size * seq_len / median)
            if cuda:
                torch.cuda.synchronize(device)
                timed_peak = torch.cuda.max_memory_allocated(device)
                all_peak = max(timed_peak, getattr(callback, "all_steps_peak", 0))
                out.update(model_bytes=base, added_bytes=all_peak - base, peak_bytes=all_peak,
                           timed_steps_peak_bytes=timed_peak)
    except torch.OutOfMemoryError as exc:
        out.update(ok=False, oom=True, error=str(exc).splitlines()[0][:300])
    except Exception as exc:  # noqa: BLE001 - reported in the table, not hidden
        out.update(ok=False, oom="out of memory" in str(exc).lower(), error=f"{type(exc).__name__}: {exc}"[:400],
                   traceback=traceback.format_exc(limit=10))
    finally:
        del model, trainer
        gc.collect()
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            out["allocated_after_cleanup_bytes"] = torch.cuda.memory_allocated(device)
    out["cell_seconds"] = time.perf_counter() - t_cell
    return out


# ====================================================================== the table
def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:,.0f}"


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace, env: dict[str, str]) -> str:
    cuda = args.device.startswith("cuda")
    prec = "bf16 mixed precision" if args.bf16 else "fp32"
    lines = [f"Llama-style {args.layers} × {args.width} (MLP {4 * args.width}), vocabulary {args.vocab:,}, {prec}, "
             f"{args.warmup} warm-up + {args.steps} timed steps, on {env.get('gpu', args.device)}. "
             "Memory: `torch.cuda.max_memory_allocated` over all steps minus the built model and trainer (MiB; "
             "DP ÷ non-private of the same cell); time: median timed step (ms; DP ÷ non-private).", "",
             "| T | B | checkpointing | variant | mode | model (MiB) | steps add (MiB) | × | peak of timed steps (MiB) "
             "| step (ms) | × | tokens/s |",
             "|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    ref: dict[tuple, dict] = {}
    for r in rows:
        key = (r["seq_len"], r["batch_size"], r["checkpointing"], r["variant"])
        if r["mode"] == "nonprivate" and r.get("ok"):
            ref[key] = r
    for r in rows:
        key = (r["seq_len"], r["batch_size"], r["checkpointing"], r["variant"])
        head = f"| {r['seq_len']:,} | {r['batch_size']} | {'on' if r['checkpointing'] else 'off'} | {r['variant']} | " \
               f"{r['mode']} |"
        if not r.get("ok"):
            what = "OOM" if r.get("oom") else "error: " + r.get("error", "")[:100].replace("|", "/")
            lines.append(f"{head} {what} | | | | | | | |")
            continue
        base = ref.get(key) if r["mode"] != "nonprivate" else None
        mem_x = time_x = ""
        if base is not None:
            time_x = f"{r['median_step_ms'] / base['median_step_ms']:.2f}×"
            if cuda and base.get("added_bytes"):
                mem_x = f"{r['added_bytes'] / base['added_bytes']:.2f}×"
        lines.append(f"{head} {_mib(r.get('model_bytes'))} | {_mib(r.get('added_bytes'))} | {mem_x} | "
                     f"{_mib(r.get('timed_steps_peak_bytes'))} | {r['median_step_ms']:,.0f} | {time_x} | "
                     f"{r['tokens_per_s']:,.0f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--shapes", nargs="+", default=["2048:8"], help="T:B pairs, run in this order (default 2048:8)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=["nonprivate", "flat"])
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--checkpointing-options", nargs="+", choices=["off", "on"], default=["off", "on"])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--warmup", type=int, default=1, help="untimed steps (optimizer state, hf_dp's first-step checks)")
    p.add_argument("--steps", type=int, default=2, help="timed steps")
    p.add_argument("--precision", choices=["bf16", "fp32"], default=None,
                   help="bf16 mixed precision (Trainer bf16=True; default on CUDA) or fp32 (default on CPU)")
    p.add_argument("--tiny", action="store_true", help="2 × 64, vocabulary 128, T = 32, B = 2: a harness check")
    p.add_argument("--json", default=None, help="write all results here (rewritten after every cell)")
    p.add_argument("--markdown", default=None, help="write the table here (rewritten after every cell)")
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tiny:
        args.layers, args.width, args.heads, args.vocab, args.shapes = 2, 64, 2, 128, ["32:2"]
    args.shape_pairs = [tuple(int(x) for x in s.split(":")) for s in args.shapes]
    args.seq_lens = [t for t, _ in args.shape_pairs]
    args.bf16 = (args.precision or ("bf16" if args.device.startswith("cuda") else "fp32")) == "bf16"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)  # gradient_checkpointing_enable's rename in v6
    logging.getLogger("hf_dp").setLevel(logging.ERROR)
    env = environment()
    print("environment:", json.dumps(env), flush=True)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    env["allocated_before_cells_MiB"] = _mib(warm_device(torch.device(args.device)))
    print(f"allocated after the device warm-up: {env['allocated_before_cells_MiB']} MiB", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        base_path = os.path.join(tmp, "base")
        if "qlora" in args.variants:
            save_base(args, base_path)
            print(f"QLoRA base saved (bf16) in {time.perf_counter() - t0:.0f} s", flush=True)
        for seq_len, batch_size in args.shape_pairs:
            for ckpt in args.checkpointing_options:
                for variant in args.variants:
                    for mode in args.modes:
                        r = run_cell(args, mode, variant, ckpt == "on", seq_len, batch_size, base_path)
                        rows.append(r)
                        if r.get("ok"):
                            status = (f"adds {_mib(r.get('added_bytes'))} MiB to {_mib(r.get('model_bytes'))} MiB, "
                                      f"step {r['median_step_ms']:,.0f} ms (all steps: "
                                      + ", ".join(f"{t:,.0f}" for t in r["step_ms"]) + ")")
                        else:
                            status = r.get("error", "")[:300]
                            if r.get("traceback"):
                                print(r["traceback"], flush=True)
                        print(f"T={seq_len} B={batch_size} checkpointing={ckpt} {variant} {mode}: {status} "
                              f"[cell {r['cell_seconds']:.0f} s, left allocated "
                              f"{_mib(r.get('allocated_after_cleanup_bytes'))} MiB]", flush=True)
                        table = markdown(rows, args, env)
                        if args.markdown:
                            with open(args.markdown, "w") as f:
                                f.write(table)
                        if args.json:
                            with open(args.json, "w") as f:
                                json.dump({"environment": env, "args": vars(args), "rows": rows}, f, indent=2,
                                          default=str)
    print(f"\n{markdown(rows, args, env)}\ntotal {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
