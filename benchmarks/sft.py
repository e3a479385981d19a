#!/usr/bin/env python
"""DP-SFT speed and memory: packed DP-SFT vs unpacked DP-SFT vs non-private packed SFT, same data (issue 14).

Methods (same initial weights, same rows, AdamW, constant lr):

* ``dp_packed``     ``hf_dp.DPSFTTrainer(packing=True)``: each step's Poisson sample packed padding-free at collation,
                    clipped per packed example (σ = 1, C = 1, expected batch ``--batch`` rows);
* ``dp_unpacked``   ``hf_dp.DPSFTTrainer(packing=False)``: the same, each micro-batch right-padded to its longest row;
* ``nonprivate``    trl's ``SFTTrainer(packing=True)`` (dataset-level BFD packing into ``--max-length`` blocks,
                    padding-free), batches of ``round(batch · mean row length / max_length)`` blocks, so a step sees
                    about as many tokens as a DP step.

Data: ``--rows`` random-token rows whose lengths vary (log-normal, median ``--median-length``, clipped to
``[8, --max-length]``): the case packing is for. Model: a GPT-2 (``--layers`` × ``--width``, vocab ``--vocab``),
tied embeddings, dropout off.

Throughput = real (non-padding) tokens of the measured steps ÷ their time, counted by a wrapper around the collator
and timed from the Trainer's ``on_step_begin`` to ``on_step_end``, by wall clock and by the process's CPU time (one
intra-op thread: on a shared machine the CPU time is the stable one). The first ``--warmup`` steps (which include
hf_dp's first-step self-check and packing isolation check) are not timed. Peak memory: a separate child process per
method counts live CPU tensor bytes (``LiveTensorBytes`` of ``benchmarks/run.py``, entered before the model is built)
and reports the peak of one step after one warm-up step. One child process per method and measure.

    python benchmarks/sft.py                      # defaults: 4 x 128 GPT-2, vocab 8192, 512 rows, batch 32
    python benchmarks/sft.py --json out.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
METHODS = ("dp_packed", "dp_unpacked", "nonprivate")


def _run_module():
    spec = importlib.util.spec_from_file_location("hf_dp_benchmark_run", HERE / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["hf_dp_benchmark_run"] = module
    spec.loader.exec_module(module)
    return module


def make_rows(args: argparse.Namespace) -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.exp(torch.randn(args.rows, generator=gen) * 0.6 + float(torch.tensor(args.median_length).log()))
    lengths = lengths.round().clamp(8, args.max_length).long().tolist()
    return [{"input_ids": torch.randint(2, args.vocab, (n,), generator=gen).tolist()} for n in lengths]


def make_tokenizer(vocab: int):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="<pad>")),
                                   pad_token="<pad>", eos_token="<eos>")


def make_model(args: argparse.Namespace):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=args.vocab, n_positions=args.max_length, n_embd=args.width, n_layer=args.layers,
                     n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1,
                     pad_token_id=0)
    return GPT2LMHeadModel(cfg)


class _Counting:
    """Counts the real tokens of every collated batch (padding excluded)."""

    def __init__(self, collator):
        self.collator = collator
        self.tokens: list[int] = []

    def __call__(self, features):
        batch = self.collator(features)
        mask = batch.get("attention_mask")
        self.tokens.append(int(mask.sum()) if mask is not None else int(batch["input_ids"].numel()))
        return batch


def build(method: str, args: argparse.Namespace, outdir: str):
    from datasets import Dataset

    from hf_dp import DPSFTConfig, DPSFTTrainer

    data = Dataset.from_list(make_rows(args))
    common = {"output_dir": outdir, "max_length": args.max_length, "learning_rate": 1e-4, "optim": "adamw_torch",
              "lr_scheduler_type": "constant", "use_cpu": True, "report_to": "none", "save_strategy": "no",
              "disable_tqdm": True, "logging_steps": 10_000, "max_steps": args.warmup + args.steps,
              "gradient_accumulation_steps": 1, "dataloader_num_workers": 0, "bf16": False}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if method == "nonprivate":
            from trl import SFTConfig, SFTTrainer

            mean_len = sum(len(r["input_ids"]) for r in data) / len(data)
            blocks = max(1, round(args.batch * mean_len / args.max_length))
            cfg = SFTConfig(**common, packing=True, per_device_train_batch_size=blocks, gradient_checkpointing=False,
                            max_grad_norm=0.0)
            trainer = SFTTrainer(model=make_model(args), args=cfg, train_dataset=data,
                                 processing_class=make_tokenizer(args.vocab))
        else:
            cfg = DPSFTConfig(**common, packing=method == "dp_packed", per_device_train_batch_size=args.batch,
                              noise_multiplier=1.0, per_sample_max_grad_norm=1.0, target_delta=1e-5)
            trainer = DPSFTTrainer(model=make_model(args), args=cfg, train_dataset=data,
                                   processing_class=make_tokenizer(args.vocab))
    counter = _Counting(trainer.data_collator)
    trainer.data_collator = counter
    return trainer, counter


def child(method: str, measure: str, args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from transformers import TrainerCallback

    torch.set_num_threads(1)
    run = _run_module()
    times: list[tuple[float, float]] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t = (time.perf_counter(), time.process_time())

        def on_step_end(self, a, state, control, **kw):
            times.append((time.perf_counter() - self.t[0], time.process_time() - self.t[1]))

    with tempfile.TemporaryDirectory() as outdir:
        if measure == "memory":
            tracker = run.LiveTensorBytes()

            class Peak(TrainerCallback):
                def on_step_begin(self, a, state, control, **kw):
                    if state.global_step == 1:
                        tracker.reset_peak()

                def on_step_end(self, a, state, control, **kw):
                    if state.global_step == 2:
                        self.peak = tracker.peak
                        control.should_training_stop = True

            peak = Peak()
            with tracker:
                trainer, _ = build(method, args, outdir)
                trainer.add_callback(peak)
                trainer.train()
            return {"peak_bytes": peak.peak}
        trainer, counter = build(method, args, outdir)
        trainer.add_callback(Clock())
        trainer.train()
    timed = times[args.warmup:]
    # The loader fetches a step's batch before on_step_begin; batch k of the counter belongs to step k.
    tokens = sum(counter.tokens[args.warmup:args.warmup + len(timed)])
    wall = sum(t for t, _ in timed)
    cpu = sum(c for _, c in timed)
    return {"tokens": tokens, "steps": len(timed), "wall_s": wall, "cpu_s": cpu, "tokens_per_s_wall": tokens / wall,
            "tokens_per_s_cpu": tokens / cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--median-length", type=int, default=48)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32, help="expected DP batch (rows)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "MEASURE"), default=None)
    args = parser.parse_args()
    if args.child is not None:
        print("RESULT " + json.dumps(child(args.child[0], args.child[1], args)))
        return
    passthrough = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                   if k not in ("json", "child", "methods")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    results: dict[str, dict[str, Any]] = {}
    for measure in ("time", "memory"):
        for method in args.methods:
            load = os.getloadavg()[0]
            proc = subprocess.run([sys.executable, __file__, *passthrough, "--child", method, measure],
                                  capture_output=True, text=True, env=env)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"{method}/{measure} failed:\n{proc.stderr[-3000:]}")
            results.setdefault(method, {}).update(json.loads(line[7:]), **{f"load_{measure}": load})
            print(f"{method:>12} {measure:>6}: {results[method]}", flush=True)
    base = results.get("nonprivate")
    print(f"\nGPT-2 {args.layers}x{args.width}, vocab {args.vocab}; {args.rows} rows, median length "
          f"{args.median_length}, max {args.max_length}; expected DP batch {args.batch} rows; {args.steps} timed steps")
    print(f"{'method':>12}{'tokens/s (cpu)':>16}{'tokens/s (wall)':>17}{'peak MB':>10}"
          f"{'÷ nonprivate: time (cpu)':>26}{'memory':>8}")
    for method, r in results.items():
        ratio_t = base["tokens_per_s_cpu"] / r["tokens_per_s_cpu"] if base else float("nan")
        ratio_m = r["peak_bytes"] / base["peak_bytes"] if base else float("nan")
        print(f"{method:>12}{r['tokens_per_s_cpu']:>16.0f}{r['tokens_per_s_wall']:>17.0f}"
              f"{r['peak_bytes'] / 2**20:>10.1f}{ratio_t:>26.2f}{ratio_m:>8.2f}")
    if "dp_packed" in results and "dp_unpacked" in results:
        p, u = results["dp_packed"], results["dp_unpacked"]
        print(f"packed vs unpacked DP-SFT: {p['tokens_per_s_cpu'] / u['tokens_per_s_cpu']:.2f}x tokens/s (cpu), "
              f"{p['peak_bytes'] / u['peak_bytes']:.2f}x peak memory")
    print(f"load average (1 min) at the start of each child: "
          f"{ {m: round(r['load_time'], 1) for m, r in results.items()} }")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
