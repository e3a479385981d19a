#!/usr/bin/env python
"""More compute for both sides, the level chosen on the public proxy, applied to Austen (issue 25, session 13).

With settings chosen on the fortunes proxy (``benchmarks/utility_proxy.py``), DP LoRA on Austen stayed 5.8 / 8.9
points below non-private at ε = 8 / 3, every run at the same small compute (16,384 example-passes). DP-SGD's signal
grows with the number of steps T and its noise with √T, and σ at fixed ε grows slowly with T (Li et al. 2022, "Large
language models can be strong DP learners", §3). This script gives both sides more compute, pre-registered in
``benchmarks/RESULTS.md`` ("More compute for both sides, chosen on the proxy (session 13)"):

* levels ×1, ×2, ×4 (:data:`LEVELS`) of the proxy's session-12 choices: DP LoRA L7 (expected batch 256, 64 steps)
  and non-private LoRA L2 (batch 512, 32 steps), the steps multiplied, the learning rates unchanged (a choice, not
  tuned): :func:`level_key`;
* on the proxy's validation split (seed 42): DP at ε = 8 and 3 and non-private at ×2 and ×4 (the ×1 records are
  session 12's, copied from ``benchmarks/utility_proxy.json``, marked ``reused_from``);
* rule (:func:`choose_level`, :func:`reference_level`): per ε, DP's level is the best proxy validation accuracy
  among ×1, ×2, ×4 (ties: the smaller); the non-private reference is the best among the non-private levels ≤ DP's
  (ties: the smaller); refused while a level it ranks has no record;
* then on Austen's test split, seeds 42, 43, 44: the chosen DP runs and their non-private references (records of the
  same key and seed already run in session 12 are copied from ``benchmarks/utility_austen_proxy.json``).

Results: ``benchmarks/utility_compute_proxy.json`` and ``benchmarks/utility_compute_austen.json`` (one record per run
and seed; a finished (key, seed) is skipped when run again).

    python benchmarks/utility_compute.py --stage proxy --epsilons 8          # DP ε = 8 at ×2, ×4 (×1 copied)
    python benchmarks/utility_compute.py --stage proxy --epsilons inf        # non-private at ×2, ×4
    python benchmarks/utility_compute.py --stage austen --epsilons 8 --seeds 42   # the ε = 8 choice + its reference
    python benchmarks/utility_compute.py --stage trend --seeds 42            # ×4 on Austen, not chosen, for the trend
    python benchmarks/utility_compute.py --table-only
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

# HF_HUB_OFFLINE / TOKENIZERS_PARALLELISM: set by utility.py, loaded below before anything imports transformers

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # benchmarks/ is a folder of scripts: its loader, siblings.py, by name
    sys.path.insert(0, str(HERE))
from siblings import accuracy_by_key  # noqa: E402
from siblings import load as _load  # noqa: E402

proxy = _load("hf_dp_benchmark_utility_proxy", HERE / "utility_proxy.py")
utility, unseen = proxy.utility, proxy.unseen  # the modules utility_proxy.py loaded

LEVELS = (1, 2, 4)  # compute multiples of the session-12 choices; a tie goes to the smaller
DP_BASE = proxy.LORA_CANDIDATES[6]  # L7: head_lr=0.05|lr=0.01|batch=256|max_steps=64, DP's proxy choice at ε = 8, 3
NP_BASE = proxy.LORA_CANDIDATES[1]  # L2: head_lr=0.05|lr=0.01|batch=512|max_steps=32, non-private's proxy choice
CHOICE_SEED = proxy.CHOICE_SEED  # 42
SEEDS = (42, 43, 44)
TREND_LEVEL = 4  # --stage trend: ×4 on Austen, not chosen, for the trend (when the proxy chooses ×1)
SESSION12 = {8.0: 5.8, 3.0: 8.9}  # the ×1 Austen gaps of session 12 (the proxy's choices)


def level_key(epsilon: float, level: int) -> str:
    """The run key of LoRA at compute ``level`` (×1, ×2, ×4): DP (``epsilon`` finite: flat clipping, Adam) from L7,
    non-private (``inf``) from L2, the number of steps multiplied by ``level``, everything else unchanged."""
    if level not in LEVELS:
        raise ValueError(f"compute level must be one of {LEVELS}, not {level!r}")
    private = not math.isinf(epsilon)
    run = utility.parse_key(f"lora|{float(epsilon)}|{'clip' if private else '-'}|adam|"
                            + (DP_BASE if private else NP_BASE))
    run["max_steps"] *= level
    k = utility.key(run)
    assert utility.key(utility.parse_key(k)) == k, k
    return k


def _accuracies(records: list[dict[str, Any]], epsilon: float, levels: tuple[int, ...], seed: int) -> dict[int, float]:
    acc = {utility.key(r): r["accuracy"] for r in records if r["seed"] == seed}
    missing = [level_key(epsilon, lv) for lv in levels if level_key(epsilon, lv) not in acc]
    if missing:
        raise ValueError(f"cannot choose the compute level at ε = {epsilon:g}: {len(missing)} of the levels "
                         f"{', '.join(f'×{lv}' for lv in levels)} have no proxy run with seed {seed} "
                         f"({', '.join(missing)}); run them first (--stage proxy --epsilons {epsilon:g})")
    return {lv: acc[level_key(epsilon, lv)] for lv in levels}


def choose_level(records: list[dict[str, Any]], epsilon: float, seed: int = CHOICE_SEED) -> int:
    """The pre-registered rule for DP at ``epsilon``: the level among :data:`LEVELS` with the best proxy validation
    accuracy in ``records`` (seed ``seed``), ties to the smaller level. Refused while a level has no record."""
    if math.isinf(epsilon):
        raise ValueError("choose_level is DP's rule; the non-private reference is reference_level(records, level)")
    acc = _accuracies(records, epsilon, LEVELS, seed)
    return max(LEVELS, key=lambda lv: (acc[lv], -lv))


def reference_level(records: list[dict[str, Any]], dp_level: int, seed: int = CHOICE_SEED) -> int:
    """The non-private reference at DP's level ``dp_level``: the best proxy validation accuracy among the
    non-private levels ≤ ``dp_level`` (a user with that compute takes the best run it allows, never a forced
    overfit), ties to the smaller level. Refused while one of those levels has no record."""
    allowed = tuple(lv for lv in LEVELS if lv <= dp_level)
    if not allowed:
        raise ValueError(f"no compute level ≤ ×{dp_level} (levels {LEVELS})")
    acc = _accuracies(records, math.inf, allowed, seed)
    return max(allowed, key=lambda lv: (acc[lv], -lv))


def chosen_keys(records: list[dict[str, Any]], epsilons: list[float]) -> list[tuple[str, dict[str, Any]]]:
    """For each finite ε: (DP's chosen key, its record fields), then (the non-private reference's key, fields), the
    reference once if shared."""
    out: list[tuple[str, dict[str, Any]]] = []
    seen = set()
    for eps in epsilons:
        lv = choose_level(records, eps)
        ref = reference_level(records, lv)
        for k, extra in ((level_key(eps, lv), {"level": lv, "chosen_for_epsilon": eps}),
                         (level_key(math.inf, ref), {"level": ref, "reference_for_dp_level": lv})):
            if k not in seen:
                seen.add(k)
                out.append((k, extra))
    return out


# --------------------------------------------------------------------------------------------------------- report
def _by_key(records: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    return accuracy_by_key(records, utility.key)


def proxy_table(records: list[dict[str, Any]]) -> list[str]:
    """One row per level: proxy validation accuracy (seed 42) of DP ε = 8, 3 and non-private, CPU s; the choices
    in bold (DP's level per ε; the non-private reference of each)."""
    acc = {k: v.get(CHOICE_SEED) for k, v in _by_key(records).items()}
    cpu = {utility.key(r): r.get("cpu_s") for r in records if r["seed"] == CHOICE_SEED}
    bold = set()
    for eps in (8.0, 3.0):
        try:
            lv = choose_level(records, eps)
            bold |= {level_key(eps, lv), level_key(math.inf, reference_level(records, lv))}
        except ValueError:
            pass
    rows = ["| level | DP settings | non-private settings | ε = 8 | ε = 3 | non-private | CPU s (ε = 8 / 3 / ∞) |",
            "|---|---|---|---:|---:|---:|---|"]
    for lv in LEVELS:
        cells, times = [], []
        for eps in (8.0, 3.0, math.inf):
            k = level_key(eps, lv)
            a = acc.get(k)
            cell = "–" if a is None else f"{a:.1f}"
            cells.append(f"**{cell}**" if k in bold else cell)
            times.append("–" if cpu.get(k) is None else f"{cpu[k]:.0f}")
        dp, np_ = (level_key(e, lv).split("|adam|")[1] for e in (8.0, math.inf))
        rows.append(f"| ×{lv} | `{dp}` | `{np_}` | " + " | ".join(cells) + f" | {' / '.join(times)} |")
    return rows


def choices(records: list[dict[str, Any]]) -> list[str]:
    lines = []
    for eps in (8.0, 3.0):
        try:
            lv = choose_level(records, eps)
            ref = reference_level(records, lv)
            lines.append(f"ε = {eps:g}: DP ×{lv} `{level_key(eps, lv)}`; non-private reference ×{ref} "
                         f"`{level_key(math.inf, ref)}`")
        except ValueError as e:
            lines.append(f"ε = {eps:g}: not chosen ({e})")
    return lines


def austen_table(records: list[dict[str, Any]], proxy_records: list[dict[str, Any]]) -> list[str]:
    """Per ε with a proxy choice: DP at its level and the non-private reference on Austen's test split (mean ± sd,
    per seed), the gap (mean; per seed where both ran) against the target, beside session 12's ×1 gap; then the
    records not chosen (the trend), each on its own row."""
    by_key = _by_key([r for r in records if r.get("chosen", True)])

    def stats(v: dict[int, float]) -> str:
        a = np.array([v[s] for s in sorted(v)])
        sd = f" ± {a.std(ddof=1):.1f}" if len(a) > 1 else ""
        return f"{a.mean():.1f}{sd} ({' / '.join(f'{v[s]:.1f}' for s in sorted(v))})"

    rows = ["| ε | DP level | DP (mean ± sd; per seed) | non-private reference | non-private (mean ± sd; per seed) "
            "| gap (mean; per seed) | target | session 12 (×1) gap |", "|---|---|---|---|---|---|---:|---:|"]
    for eps in (8.0, 3.0):
        try:
            lv = choose_level(proxy_records, eps)
            ref = reference_level(proxy_records, lv)
        except ValueError:
            rows.append(f"| {eps:g} | not chosen | | | | | within {unseen.TARGET[eps]:g} | {SESSION12[eps]} |")
            continue
        dp, base = by_key.get(level_key(eps, lv), {}), by_key.get(level_key(math.inf, ref), {})
        if dp and base:
            gap = np.mean(list(base.values())) - np.mean(list(dp.values()))
            mark = " (met)" if gap <= unseen.TARGET[eps] else " (**not met**)"
            per = " / ".join(f"{base[s] - dp[s]:.1f}" for s in sorted(dp) if s in base)
            gap_cell = f"**{gap:.1f}**{mark} ({per})"
        else:
            gap_cell = "not run"
        rows.append(f"| {eps:g} | ×{lv} | {stats(dp) if dp else 'not run'} | ×{ref} | "
                    f"{stats(base) if base else 'not run'} | {gap_cell} | within {unseen.TARGET[eps]:g} | "
                    f"{SESSION12[eps]} |")
    trend = _by_key([r for r in records if not r.get("chosen", True)])
    for k, v in trend.items():
        rows.append(f"| not chosen, for the trend: `{k}` | | {stats(v)} | | | | | |")
    return rows


# --------------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", choices=("proxy", "austen", "trend"), default=None,
                   help="proxy: the levels on the proxy's validation split (seed 42); austen: the chosen levels on "
                        "Austen's test split (--seeds); trend: ×4 on Austen, not chosen (--seeds, DP ε = 8 and "
                        "non-private), when the proxy chose ×1.")
    p.add_argument("--epsilons", default="8,inf,3", help="Comma-separated ε (inf: non-private), in this order.")
    p.add_argument("--levels", default="1,2,4", help="--stage proxy: the compute levels (×1 is copied, not run).")
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="The Austen test runs' seeds.")
    p.add_argument("--proxy-out", default="benchmarks/utility_compute_proxy.json")
    p.add_argument("--austen-out", default="benchmarks/utility_compute_austen.json")
    p.add_argument("--proxy-reuse", default="benchmarks/utility_proxy.json",
                   help="Session 12's proxy runs: a record of a level's key and seed 42 is copied, not re-run.")
    p.add_argument("--austen-reuse", default="benchmarks/utility_austen_proxy.json",
                   help="Session 12's Austen runs of the proxy's choices (×1): copied, not re-run.")
    p.add_argument("--proxy-cache", default=os.path.expanduser("~/.cache/hf_dp/utility_fortunes_cache.pt"))
    p.add_argument("--austen-cache", default=os.path.expanduser("~/.cache/hf_dp/utility_austen_cache.pt"))
    p.add_argument("--table-only", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("hf_dp").setLevel(logging.WARNING)
    epsilons = proxy._epsilons(args.epsilons)
    seeds = [int(s) for s in args.seeds.split(",")]
    proxy_out, austen_out = Path(args.proxy_out), Path(args.austen_out)
    psaved = json.loads(proxy_out.read_text()) if proxy_out.is_file() else {}
    asaved = json.loads(austen_out.read_text()) if austen_out.is_file() else {}
    precords: list[dict[str, Any]] = psaved.get("runs", [])
    arecords: list[dict[str, Any]] = asaved.get("runs", [])
    if not args.table_only and args.stage is None:
        p.error("give --stage proxy, austen or trend (or --table-only)")
    if args.stage == "proxy":
        cache = proxy.build_cache(Path(args.proxy_cache))  # the existing cache: its settings match, not rebuilt
        psaved.update(task="fortunes proxy validation (utility_proxy.py's split and cache)",
                      reused_from=args.proxy_reuse)
        reuse = json.loads(Path(args.proxy_reuse).read_text())["runs"]
        for eps in epsilons:
            for lv in (int(x) for x in args.levels.split(",")):
                proxy.run_keys(proxy_out, psaved, precords, cache, [level_key(eps, lv)], [CHOICE_SEED],
                               {"task": "fortunes_proxy", "evaluated_on": "proxy validation (2,000 fortunes)",
                                "level": lv}, "/tmp/hf_dp_utility_compute_proxy", reuse)
    elif args.stage in ("austen", "trend"):
        if args.stage == "austen":
            todo = chosen_keys(precords, [e for e in epsilons if not math.isinf(e)])  # refused if incomplete
            todo = [(k, {**x, "chosen": True}) for k, x in todo]
        else:
            todo = [(level_key(e, TREND_LEVEL), {"level": TREND_LEVEL, "chosen": False,
                                                 "note": "not chosen, for the trend"}) for e in epsilons]
        cache = unseen.build_cache(Path(args.austen_cache))  # the existing cache, not rebuilt
        labels = np.asarray(cache["test"]["labels"])
        asaved.update(majority=float(np.bincount(labels).max() / len(labels)), books=cache["books"],
                      task="Austen test split (utility_unseen.py), compute level chosen on the fortunes proxy",
                      reused_from=args.austen_reuse)
        reuse = json.loads(Path(args.austen_reuse).read_text())["runs"]
        for k, extra in todo:
            proxy.run_keys(austen_out, asaved, arecords, cache, [k], seeds,
                           {"task": "austen", "chosen_on": f"fortunes proxy validation, seed {CHOICE_SEED}", **extra},
                           "/tmp/hf_dp_utility_compute_austen", reuse)
    print("proxy (fortunes) validation, seed 42:")
    print("\n".join(proxy_table(precords)))
    print("\nchoices:\n" + "\n".join(choices(precords)))
    print("\nAusten test:")
    print("\n".join(austen_table(arecords, precords)))


if __name__ == "__main__":
    main()
