#!/usr/bin/env python
"""Cost of the always-on released-state check (``hf_dp.guarantee.ReleasedStateGuard``, DESIGN invariant 10) per DP
step, at the benchmark shapes of ``benchmarks/run.py``; and of a value fingerprint that would also see writes through
``p.data`` (not built: this measures whether it would fit).

For each shape, ``DPTrainer`` (flat clipping, AdamW, fixed-size batches, as ``run.py``'s DP runs) trains ``--steps``
steps after one untimed warm-up step. The guard's own work — every ``changed()`` / ``snapshot()`` / ``optimizer_
stepped()`` call the run makes (the step's first chunk, its release, the optimizer's pre- and post-step hooks) — is
timed inside the real run with this process's CPU time (one intra-op thread, so waiting for a core held by another job
does not count), next to the step's CPU time measured from ``on_step_begin`` to ``on_step_end`` (as ``run.py``).

Fingerprints, timed on the same model and optimizer (two per step: one at the post-step snapshot, one compared before
the next optimizer step):

* ``sampled``: 16 strided elements of every tracked tensor, summed (one small gather per tensor);
* ``full``: the sum of every element of every tracked tensor (reads all parameters and buffers once).

Run ``python benchmarks/guard_cost.py`` (presets: ``--preset cpu-quick`` by default, any of ``run.py``'s).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from run import PRESETS, Shape, StepTimes, _timer_callback_cls, build_model, make_dataset  # noqa: E402

from hf_dp.guarantee import ReleasedStateGuard  # noqa: E402


class TimedGuard(ReleasedStateGuard):
    """The trainer's guard, with the CPU time of each of its comparisons and snapshots added up."""

    def __init__(self) -> None:
        super().__init__()
        self.cpu = 0.0
        self.calls = 0

    def _timed(self, fn, *args, **kwargs):
        c0 = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            self.cpu += time.process_time() - c0
            self.calls += 1

    def changed(self, *args, **kwargs):
        return self._timed(super().changed, *args, **kwargs)

    def snapshot(self) -> None:
        return self._timed(super().snapshot)

    def optimizer_stepped(self) -> None:
        # its comparison is a timed changed(); the re-keying is timed here
        c0 = time.process_time()
        super().optimizer_stepped()
        self.cpu += time.process_time() - c0
        self.calls += 1


def fingerprint_ms(tensors: list[torch.Tensor], mode: str, repeats: int = 20) -> float:
    def once() -> float:
        total = 0.0
        with torch.no_grad():
            if mode == "sampled":
                parts = [t.reshape(-1)[:: max(1, t.numel() // 16)][:16].double().sum() for t in tensors if t.numel()]
            else:
                parts = [t.double().sum() if t.dtype != torch.float64 else t.sum() for t in tensors if t.numel()]
            total = float(torch.stack(parts).sum())
        return total

    once()
    c0 = time.process_time()
    for _ in range(repeats):
        once()
    return (time.process_time() - c0) / repeats * 1e3


def measure(shape: Shape, steps: int, device: torch.device) -> dict:
    from transformers import default_data_collator

    from hf_dp import DPTrainer, DPTrainingArguments

    model = build_model(shape)
    data = make_dataset(shape, num_batches=steps + 1)
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = DPTrainingArguments(
            output_dir=out, per_device_train_batch_size=shape.batch_size, gradient_accumulation_steps=shape.accum,
            max_steps=steps + 1, learning_rate=1e-4, lr_scheduler_type="constant", weight_decay=0.0,
            optim="adamw_torch", max_grad_norm=0.0, logging_strategy="no", save_strategy="no", report_to="none",
            disable_tqdm=True, use_cpu=device.type == "cpu", clipping="flat", noise_multiplier=1.0,
            per_sample_max_grad_norm=1.0, poisson_sampling=False, dp_seed=0, accountant="rdp", dp_self_check=False)
        timer = _timer_callback_cls()()
        times = StepTimes(device, warmup=1, reset_peak_at_measured=False)
        timer.times = times
        trainer = DPTrainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator,
                            callbacks=[timer])
        guard = trainer._state_guard = TimedGuard()
        marks: list[float] = []

        class Mark(type(timer)):  # the guard's CPU time at the start of every timed step
            def on_step_begin(self, args, state, control, **kwargs):
                marks.append(guard.cpu)

            def on_step_end(self, args, state, control, **kwargs):
                marks.append(guard.cpu)

        trainer.add_callback(Mark())
        trainer.train()
        # the guard's time inside each step (on_step_begin → on_step_end), measured steps only
        inside = [marks[2 * i + 1] - marks[2 * i] for i in range(len(marks) // 2)][1:]
        # the release's pre/post-step hooks run inside the step; the first-chunk and release checks too
        step_cpu = statistics.median(times.measured_cpu)
        guard_ms = statistics.median(inside) * 1e3
        guard.start(trainer.model, trainer.optimizer)  # for the fingerprints: the same tracked tensors
        tensors = guard._unique
        sampled, full = fingerprint_ms(tensors, "sampled"), fingerprint_ms(tensors, "full")
        guard.stop()
    return {"shape": shape.name, "tensors": len(tensors), "params": sum(t.numel() for t in tensors),
            "step_ms": step_cpu * 1e3, "guard_ms": guard_ms, "guard_pct": 100 * guard_ms / (step_cpu * 1e3),
            "sampled_pct": 100 * 2 * sampled / (step_cpu * 1e3), "full_pct": 100 * 2 * full / (step_cpu * 1e3),
            "sampled_ms": 2 * sampled, "full_ms": 2 * full}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu-quick")
    p.add_argument("--shape", action="append", default=None, help="only the named shapes of the preset")
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = [s for s in PRESETS[a.preset] if a.shape is None or s.name in a.shape]
    print("| shape | tracked tensors | DP step (CPU ms) | guard (ms / step) | guard ÷ step | sampled fingerprint ×2 "
          "(ms, ÷ step) | full fingerprint ×2 (ms, ÷ step) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for shape in shapes:
        r = measure(shape, a.steps, device)
        print(f"| {r['shape']} | {r['tensors']} | {r['step_ms']:.0f} | {r['guard_ms']:.2f} | {r['guard_pct']:.2f} % | "
              f"{r['sampled_ms']:.2f} ({r['sampled_pct']:.2f} %) | {r['full_ms']:.1f} ({r['full_pct']:.1f} %) |",
              flush=True)


if __name__ == "__main__":
    main()
