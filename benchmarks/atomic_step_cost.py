#!/usr/bin/env python
"""Cost of the atomic DP step (DESIGN invariant 11; ``hf_dp/clipping/step.py``) and of drawing each step by key.

What the invariant adds to every step, timed on its own (wall clock, one thread, median of ``--repeats``):

* ``begin_step`` (once per step: the state is checked empty), ``_add_losses`` (once per micro-batch: the
  micro-batch's loss sum and count added on their device; timed with the ``torch.where``/``sum`` that produce them)
  and ``_step_released`` (once per step: the step's loss totals committed; under DDP one all-reduce of two float64
  values, not timed here);
* the Poisson draw of one step from its own stream ``(seed, k, rank)`` (a fresh generator per step) against the old
  one stream per epoch, for a training set of ``--examples`` rows;
* a short DPTrainer run (tiny GPT-2, CPU) with the bookkeeping as shipped against the same run with it stubbed out,
  interleaved, as a check that nothing else moved (at this size, the run's own noise is larger than the cost).

The per-step overhead is then put against the benchmark shapes' step times (``benchmarks/RESULTS.md``).
Run: ``PYTHONPATH=. python benchmarks/atomic_step_cost.py``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

import numpy as np
import torch


def _median_us(fn, repeats: int, inner: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner * 1e6)
    return statistics.median(times)


def bookkeeping(repeats: int, micro_batches: int) -> dict[str, float]:
    import sys

    sys.path.insert(0, "tests")
    from helpers import lm_dataset, quick_dp_args, tiny_gpt2

    from hf_dp import DPTrainer

    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPTrainer(model=tiny_gpt2(), args=quick_dp_args(out), train_dataset=lm_dataset(16))
    step = trainer._dp_step
    losses = torch.rand(8, dtype=torch.float32)
    bad = torch.zeros(8, dtype=torch.bool)

    def one_step():
        step.begin_step()
        for _ in range(micro_batches):
            step._add_losses(torch.where(bad, 0.0, losses).sum(), (~bad).sum())
        step._step_released()

    def begin():
        step.begin_step()

    per_step = _median_us(one_step, repeats, 200)
    return {"begin_step_us": _median_us(begin, repeats, 2000), "step_bookkeeping_us": per_step,
            "micro_batches": micro_batches}


def draws(repeats: int, examples: int, q: float) -> dict[str, float]:
    from hf_dp.sampling import derive_seed

    shard = np.arange(examples)

    def keyed(k=[0]):  # noqa: B006 - a counter
        k[0] += 1
        gen = torch.Generator().manual_seed(derive_seed(7, k[0], 0))
        return shard[torch.rand(len(shard), generator=gen, dtype=torch.float64).numpy() < q]

    gen_epoch = torch.Generator().manual_seed(derive_seed(7, 0, 0))

    def per_epoch():
        return shard[torch.rand(len(shard), generator=gen_epoch, dtype=torch.float64).numpy() < q]

    return {"examples": examples, "draw_keyed_us": _median_us(keyed, repeats, 20),
            "draw_one_stream_us": _median_us(per_epoch, repeats, 20)}


def end_to_end(rounds: int, steps: int) -> dict[str, float]:
    import sys

    sys.path.insert(0, "tests")
    from helpers import lm_dataset, quick_dp_args, tiny_gpt2
    from transformers import TrainerCallback

    from hf_dp import DPTrainer
    from hf_dp.clipping.step import DPStep

    class Clock(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.t0)

    def run(stub: bool) -> float:
        saved = DPStep.begin_step, DPStep._add_losses, DPStep._step_released
        if stub:
            DPStep.begin_step = lambda self: None
            DPStep._add_losses = lambda self, *a: None

            def released(self, released=True):
                self._chunk_in_step = 0

            DPStep._step_released = released
        try:
            clock = Clock()
            with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.manual_seed(0)
                trainer = DPTrainer(model=tiny_gpt2(), args=quick_dp_args(out, max_steps=steps + 1, logging_steps=5,
                                                                          gradient_accumulation_steps=2, dp_seed=0),
                                    train_dataset=lm_dataset(64), callbacks=[clock])
                trainer.train()
            return statistics.median(clock.times[1:]) * 1e3
        finally:
            DPStep.begin_step, DPStep._add_losses, DPStep._step_released = saved

    on, off = [], []
    for r in range(rounds):
        for stub in ((False, True) if r % 2 == 0 else (True, False)):
            (off if stub else on).append(run(stub))
    return {"step_ms_with": statistics.median(on), "step_ms_stubbed": statistics.median(off),
            "ratio": statistics.median(a / b for a, b in zip(on, off))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step (GA × splits)")
    p.add_argument("--examples", type=int, default=42_061, help="training set size (E2E's, Li et al. 2022)")
    p.add_argument("--q", type=float, default=0.024)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    torch.set_num_threads(1)
    print(bookkeeping(a.repeats, a.micro_batches))
    print(draws(a.repeats, a.examples, a.q))
    print(end_to_end(a.rounds, a.steps))


if __name__ == "__main__":
    main()
