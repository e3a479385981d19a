#!/usr/bin/env python
"""A/B of engine variants in one process (issue 17): the same DPTrainer loop with an engine setting switched, run
interleaved with the non-private HF Trainer, process CPU time per step (one thread). Not part of the test suite.

Variants (module attributes of ``hf_dp.clipping.norms`` set only while that variant's steps run):
  ``per_layer``, ``flat``: as committed; ``per_layer_no_buffer``: per-layer without the reused instantiation buffer
  (``_scratch_for`` off, as before commit bffd450); ``per_layer_t25``: per-layer with ``_GHOST_TIME_RATIO = 25``
  (instantiates BERT's FFN at T = 128: faster, but +32 MiB peak memory; not committed).

    python benchmarks/ab.py --shape bert-4x256-v8192-cls-T128-B32 --rounds 6
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import tempfile

_BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_BENCH))
sys.path.insert(0, _BENCH)

import run  # noqa: E402
import torch  # noqa: E402

from hf_dp.clipping import norms as engine_mod  # noqa: E402  (the norm maths the variants switch)

VARIANTS = {
    "nonprivate": ("nonprivate", {}),
    "flat": ("flat", {}),
    "per_layer": ("per_layer", {}),
    "per_layer_no_buffer": ("per_layer", {"_scratch_for": lambda *a: None}),
    "per_layer_t25": ("per_layer", {"_GHOST_TIME_RATIO": 25}),
}


@contextlib.contextmanager
def patched(attrs: dict):
    old = {k: getattr(engine_mod, k) for k in attrs}
    for k, v in attrs.items():
        setattr(engine_mod, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(engine_mod, k, v)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="bert-4x256-v8192-cls-T128-B32")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    shape = next(s for ss in run.PRESETS.values() for s in ss if s.name == args.shape)
    base = run._base_state(shape)
    data = run.make_dataset(shape)
    cpu = {v: [] for v in args.variants}
    with tempfile.TemporaryDirectory() as out:
        runners = {}
        for v in args.variants:
            method, attrs = VARIANTS[v]
            runners[v] = run.build_runner(method, base, shape, data, torch.device("cpu"), os.path.join(out, v), 1e-5)
            with patched(attrs):
                runners[v].run(run.StepTimes(torch.device("cpu"), 1, False), 1)  # warm-up, self-check
        order = list(args.variants)
        for r in range(args.rounds):
            for v in order[r % len(order):] + order[:r % len(order)]:
                gc.collect()
                st = run.StepTimes(torch.device("cpu"), 0, False)
                with patched(VARIANTS[v][1]):
                    runners[v].run(st, args.steps)
                cpu[v].append(1e3 * statistics.median(st.measured_cpu))
            print(f"round {r}: " + ", ".join(f"{v} {cpu[v][-1]:.0f}" for v in args.variants), flush=True)
    base_ms = cpu.get("nonprivate")
    print(f"\n{shape.name}, process CPU ms per step (median of {args.steps} per round; {args.rounds} rounds, "
          "rotated order)\n")
    print("| variant | median (ms) | ÷ non-private (medians) | ÷ non-private, paired by round (median) |")
    print("|---|---:|---:|---:|")
    for v in args.variants:
        med = statistics.median(cpu[v])
        ratio = paired = ""
        if base_ms:
            ratio = f"{med / statistics.median(base_ms):.3f}×"
            paired = f"{statistics.median(a / b for a, b in zip(cpu[v], base_ms)):.3f}×"
        print(f"| {v} | {med:.0f} | {ratio} | {paired} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
