#!/usr/bin/env python
"""Diagnostic (issue 25, session 13, lead): does DP-SGD with momentum lose less to the noise than DP-Adam on the head?

On Austen the DP head loses 3.3 points to the noise alone (σ = 0 runs) at a planned noise-to-signal ratio of 0.017.
One explanation: Adam normalises each coordinate, so a coordinate whose signal is below the noise takes full-size
random steps; DP-AdamBC (Tang et al. 2024) recovered only 0.5. SGD (momentum 0.9) steps in proportion to the released
gradient instead. The head only (seconds a run), the rule of ``utility_proxy.py``, not pre-registered beyond it:

* candidates on the fortunes proxy's validation split (seed 42): ``head|ε|clip|sgd|lr=…|batch=256|max_steps=48``,
  lr ∈ :data:`LRS`, DP at ε = 8 and 3 and non-private (the same batches and steps as the fine-food head default);
* rule: per ε and non-private, the best proxy validation accuracy (ties: the earlier lr); then Austen's test split,
  seeds 42, 43, 44. Compare with DP-Adam's Austen head (``benchmarks/RESULTS.md``, session 11 and 12).

    python benchmarks/utility_sgd_diag.py proxy     # 12 runs -> benchmarks/utility_sgd_head_diag.json
    python benchmarks/utility_sgd_diag.py austen    # 9 runs  -> benchmarks/utility_sgd_head_diag_austen.json
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # benchmarks/ is a folder of scripts: its loader, siblings.py, by name
    sys.path.insert(0, str(HERE))
from siblings import load  # noqa: E402

proxy = load("hf_dp_benchmark_utility_proxy", HERE / "utility_proxy.py")
utility = proxy.utility
LRS = (0.3, 1.0, 3.0, 10.0)
EPSILONS = (8.0, math.inf, 3.0)
PROXY_OUT, AUSTEN_OUT = HERE / "utility_sgd_head_diag.json", HERE / "utility_sgd_head_diag_austen.json"


def sgd_keys(epsilon: float) -> list[str]:
    clipping = "-" if math.isinf(epsilon) else "clip"
    return [f"head|{epsilon}|{clipping}|sgd|lr={lr:g}|batch=256|max_steps=48" for lr in LRS]


def choose(records: list[dict[str, Any]], epsilon: float) -> str:
    """The best proxy validation accuracy among :func:`sgd_keys` (seed 42), ties to the earlier; refused if one
    candidate has no record."""
    acc = {utility.key(r): r["accuracy"] for r in records if r["seed"] == proxy.CHOICE_SEED}
    keys = sgd_keys(epsilon)
    if any(k not in acc for k in keys):
        raise ValueError(f"run the proxy stage first: a candidate at ε = {epsilon} has no record")
    return max(keys, key=lambda k: (acc[k], -keys.index(k)))


def _records(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    saved = json.loads(path.read_text()) if path.is_file() else {}
    return saved, saved.get("runs", [])


def main(stage: str) -> None:
    saved, records = _records(PROXY_OUT)
    if stage == "proxy":
        cache = proxy.build_cache(Path(os.path.expanduser("~/.cache/hf_dp/utility_fortunes_cache.pt")))
        keys = [k for eps in EPSILONS for k in sgd_keys(eps)]
        proxy.run_keys(PROXY_OUT, saved, records, cache, keys, [proxy.CHOICE_SEED], {"task": "fortunes_proxy"},
                       "/tmp/hf_dp_sgd_diag")
    elif stage == "austen":
        chosen = [choose(records, eps) for eps in EPSILONS]
        cache = proxy.unseen.build_cache(Path(os.path.expanduser("~/.cache/hf_dp/utility_austen_cache.pt")))
        austen, arecords = _records(AUSTEN_OUT)
        proxy.run_keys(AUSTEN_OUT, austen, arecords, cache, chosen, list(proxy.SEEDS), {"task": "austen"},
                       "/tmp/hf_dp_sgd_diag_austen")
        records = arecords
    for r in records:
        print(r.get("task"), utility.key(r), r["seed"], f"{100 * r['accuracy']:.2f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "table")
