#!/usr/bin/env python
"""LoRA's rank and its clipping, chosen on the public proxy, applied to Austen (issue 25, session 14).

With settings chosen on the fortunes proxy (``benchmarks/utility_proxy.py``) DP LoRA on Austen stays 5.8 / 8.9
points below non-private at ε = 8 / 3 (target 3 / 5). Two axes were never searched, pre-registered in
``benchmarks/RESULTS.md`` ("LoRA's rank and clipping, chosen on the proxy (session 14)"):

* **the number of trainable coordinates d**: the noise's norm grows as σ·C·√d while the signal does not (Yu et al.
  2022, "Differentially private fine-tuning of language models", ICLR: small ranks suffice under DP; Li et al. 2022
  §5). LoRA r = 8 on query/value of the 2 trained layers is 24,576 coordinates + the 6-way classifier's 2,310; r = 1,
  2, 4 cut the noise's norm by up to 2.2×;
* **clipping**: without noise DP LoRA lost 3.5 points on Austen (session 11's σ = 0 diagnostic: C = 1 against
  typical norms 2-3); a larger C, or per-layer thresholds that track a private quantile of the norms (He et al. 2023,
  "Exploring the limits of DP deep learning with group-wise clipping", ICLR, §3.3), may recover part of it.

Candidates (:func:`dp_candidates`, :func:`np_candidates`), all at the proxy's session-12 choices — DP: L7
``head_lr=0.05|lr=0.01|batch=256|max_steps=64``; non-private: L2 ``head_lr=0.05|lr=0.01|batch=512|max_steps=32`` —
with ``utility.py``'s settings ``rank`` (α = 2·rank) and ``mode`` (``adaptive_per_layer``), learning rates unchanged:

* DP at each ε ∈ {8, 3}: r = 8 at C = 1 (session 12's record, reused), r = 8 at C = 3, r = 8 adaptive per layer
  (hf_dp's quantile defaults, ``per_sample_max_grad_norm`` 1: initial thresholds C/√K), r = 4, 2, 1 at C = 1;
* non-private: r = 8 (session 12's record, reused), 4, 2, 1.

Rule (:func:`choose`): per ε, DP's choice is the best proxy validation accuracy (seed 42) of its 6 candidates; ties go
to the earlier in :func:`dp_candidates`'s order (the existing r = 8 at C = 1 first, then the larger r; between the two
other r = 8 candidates, C = 3 before adaptive). The non-private reference is the best of its 4 (ties: the larger r,
r = 8 first). Both refuse while a candidate has no record. Then Austen's test split, seeds 42, 43, 44 (records of the
same key and seed already run in session 12 are copied from ``benchmarks/utility_austen_proxy.json``).

Results: ``benchmarks/utility_lorad_proxy.json`` and ``benchmarks/utility_lorad_austen.json`` (one record per run and
seed; a finished (key, seed) is skipped when run again; ``--stage clip_only`` adds the σ = 0 diagnostic under the
latter's ``"clip_only"``).

    python benchmarks/utility_lorad.py --stage proxy --epsilons 8          # 5 new DP runs (r = 8, C = 1 copied)
    python benchmarks/utility_lorad.py --stage proxy --epsilons inf        # 3 new non-private runs (r = 8 copied)
    python benchmarks/utility_lorad.py --stage austen --epsilons 8 --seeds 42   # the ε = 8 choice + the reference
    python benchmarks/utility_lorad.py --stage clip_only --seeds 42       # σ = 0 of the ε = 8 choice (diagnostic)
    python benchmarks/utility_lorad.py --stage clip_only --seeds 42 --also 'KEY,KEY'   # more σ = 0 runs, not chosen
    python benchmarks/utility_lorad.py --table-only
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

# HF_HUB_OFFLINE / TOKENIZERS_PARALLELISM: set by utility.py, loaded below before anything imports transformers

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # benchmarks/ is a folder of scripts: its loader, siblings.py, by name
    sys.path.insert(0, str(HERE))
from siblings import load as _load  # noqa: E402

proxy = _load("hf_dp_benchmark_utility_proxy", HERE / "utility_proxy.py")
utility, unseen = proxy.utility, proxy.unseen  # the modules utility_proxy.py loaded

DP_BASE = proxy.LORA_CANDIDATES[6]  # L7: head_lr=0.05|lr=0.01|batch=256|max_steps=64, DP's proxy choice at ε = 8, 3
NP_BASE = proxy.LORA_CANDIDATES[1]  # L2: head_lr=0.05|lr=0.01|batch=512|max_steps=32, non-private's proxy choice
CHOICE_SEED = proxy.CHOICE_SEED  # 42
SEEDS = (42, 43, 44)
# (label, settings beyond the base) in the tie order: the existing r = 8, C = 1 first, then the larger r
DP_VARIANTS = (("r=8, C=1", {}), ("r=8, C=3", {"C": 3.0}), ("r=8, adaptive", {"mode": "adaptive_per_layer"}),
               ("r=4, C=1", {"rank": 4}), ("r=2, C=1", {"rank": 2}), ("r=1, C=1", {"rank": 1}))
NP_VARIANTS = (("r=8", {}), ("r=4", {"rank": 4}), ("r=2", {"rank": 2}), ("r=1", {"rank": 1}))
SESSION12 = {8.0: 5.8, 3.0: 8.9}  # the Austen gaps of session 12 (the proxy's choices, r = 8, C = 1, 3 seeds)


def variant_key(epsilon: float, settings: dict[str, Any]) -> str:
    """The run key of LoRA at DP's base L7 (``epsilon`` finite: clip, Adam) or non-private's L2 (``inf``) with
    ``settings`` (``rank``, ``C``, ``mode``) added, everything else unchanged; it round-trips through ``utility``."""
    private = not math.isinf(epsilon)
    run = utility.parse_key(f"lora|{float(epsilon)}|{'clip' if private else '-'}|adam|"
                            + (DP_BASE if private else NP_BASE))
    run.update(settings)
    k = utility.key(run)
    assert utility.key(utility.parse_key(k)) == k, k
    return k


def dp_candidates(epsilon: float) -> list[tuple[str, str]]:
    """(label, run key) of DP's 6 candidates at ``epsilon``, in the tie order."""
    if math.isinf(epsilon):
        raise ValueError("dp_candidates is for a finite ε; the non-private candidates are np_candidates()")
    return [(label, variant_key(epsilon, s)) for label, s in DP_VARIANTS]


def np_candidates() -> list[tuple[str, str]]:
    """(label, run key) of the 4 non-private candidates, in the tie order (r = 8 first, then the larger r)."""
    return [(label, variant_key(math.inf, s)) for label, s in NP_VARIANTS]


def candidates(epsilon: float) -> list[tuple[str, str]]:
    return np_candidates() if math.isinf(epsilon) else dp_candidates(epsilon)


def choose(records: list[dict[str, Any]], epsilon: float, seed: int = CHOICE_SEED) -> str:
    """The pre-registered rule at ``epsilon`` (``inf``: the non-private reference): the candidate key with the best
    accuracy among ``records`` of ``seed``, ties to the earlier in the candidates' order. Refused while a candidate
    has no record (a choice among part of the list is not the pre-registered one)."""
    acc = {utility.key(r): r["accuracy"] for r in records if r["seed"] == seed}
    keys = [k for _, k in candidates(epsilon)]
    missing = [k for k in keys if k not in acc]
    if missing:
        raise ValueError(f"cannot choose at ε = {epsilon:g}: {len(missing)} of its {len(keys)} candidates have no "
                         f"proxy run with seed {seed} ({', '.join(missing)}); run them first "
                         f"(--stage proxy --epsilons {epsilon:g})")
    return max(keys, key=lambda k: (acc[k], -keys.index(k)))


def chosen_keys(records: list[dict[str, Any]], epsilons: list[float]) -> list[tuple[str, dict[str, Any]]]:
    """For each finite ε in ``epsilons``: (DP's chosen key, fields for its records); then the non-private
    reference's key once."""
    out = [(choose(records, e), {"chosen_for_epsilon": e}) for e in epsilons if not math.isinf(e)]
    return out + [(choose(records, math.inf), {"reference": True})]


def label_of(k: str) -> str:
    for eps in (8.0, 3.0, math.inf):
        for label, ck in candidates(eps):
            if ck == k:
                return label
    return k


# --------------------------------------------------------------------------------------------------------- report
def _by_key(records: list[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for r in records:
        out.setdefault(utility.key(r), {})[r["seed"]] = r
    return out


def _chosen_or_none(records: list[dict[str, Any]], eps: float) -> str | None:
    try:
        return choose(records, eps)
    except ValueError:
        return None


def proxy_table(records: list[dict[str, Any]]) -> list[str]:
    """One row per candidate: d (trainable parameters), σ and proxy validation accuracy (seed 42) at ε = 8 and 3,
    non-private accuracy where it is a candidate, CPU s; the rule's choices in bold."""
    by = {k: v.get(CHOICE_SEED) for k, v in _by_key(records).items()}
    bold = {c for c in (_chosen_or_none(records, e) for e in (8.0, 3.0, math.inf)) if c}

    def acc(k: str) -> str:
        r = by.get(k)
        cell = "–" if r is None else f"{100 * r['accuracy']:.2f}"
        return f"**{cell}**" if k in bold else cell

    def field(k: str, name: str, fmt: str) -> str:
        r = by.get(k)
        return "–" if r is None or r.get(name) is None else format(r[name], fmt)

    rows = ["| candidate | d (trainable) | σ ε = 8 / 3 | ε = 8 | ε = 3 | non-private | CPU s (ε = 8 / 3 / ∞) |",
            "|---|---:|---|---:|---:|---:|---|"]
    np_keys = dict(np_candidates())
    for (label, k8), (_, k3) in zip(dp_candidates(8.0), dp_candidates(3.0)):
        kn = np_keys.get(label.split(",")[0]) if label.endswith("C=1") else None
        d = next((field(k, "trainable_parameters", ",") for k in (k8, k3, kn) if k and by.get(k)), "–")
        times = " / ".join(field(k, "cpu_s", ".0f") if k else "" for k in (k8, k3, kn)).rstrip(" /")
        rows.append(f"| {label} | {d} | {field(k8, 'noise_multiplier', '.3f')} / {field(k3, 'noise_multiplier', '.3f')}"
                    f" | {acc(k8)} | {acc(k3)} | {acc(kn) if kn else ''} | {times} |")
    return rows


def choices(records: list[dict[str, Any]]) -> list[str]:
    lines = []
    for eps in (8.0, 3.0, math.inf):
        name = "non-private reference" if math.isinf(eps) else f"DP ε = {eps:g}"
        try:
            k = choose(records, eps)
            lines.append(f"{name}: {label_of(k)} `{k}`")
        except ValueError as e:
            lines.append(f"{name}: not chosen ({e})")
    return lines


def austen_table(records: list[dict[str, Any]], proxy_records: list[dict[str, Any]]) -> list[str]:
    """Per ε with a proxy choice: the chosen DP run and the non-private reference on Austen's test split (mean ± sd,
    per seed), the gap (mean; per seed where both ran) against the target, beside session 12's gap."""
    by = {k: {s: 100 * r["accuracy"] for s, r in v.items()} for k, v in _by_key(records).items()}

    def stats(v: dict[int, float]) -> str:
        a = np.array([v[s] for s in sorted(v)])
        sd = f" ± {a.std(ddof=1):.1f}" if len(a) > 1 else ""
        return f"{a.mean():.1f}{sd} ({' / '.join(f'{v[s]:.2f}' for s in sorted(v))})"

    rows = ["| ε | DP choice | DP (mean ± sd; per seed) | non-private reference | non-private (mean ± sd; per seed) "
            "| gap (mean; per seed) | target | session 12 gap |", "|---|---|---|---|---|---|---:|---:|"]
    ref = _chosen_or_none(proxy_records, math.inf)
    for eps in (8.0, 3.0):
        k = _chosen_or_none(proxy_records, eps)
        if k is None or ref is None:
            rows.append(f"| {eps:g} | not chosen | | | | | within {unseen.TARGET[eps]:g} | {SESSION12[eps]} |")
            continue
        dp, base = by.get(k, {}), by.get(ref, {})
        if dp and base:
            gap = np.mean(list(base.values())) - np.mean(list(dp.values()))
            mark = " (met)" if gap <= unseen.TARGET[eps] else " (**not met**)"
            per = " / ".join(f"{base[s] - dp[s]:.2f}" for s in sorted(dp) if s in base)
            gap_cell = f"**{gap:.1f}**{mark} ({per})"
        else:
            gap_cell = "not run"
        rows.append(f"| {eps:g} | {label_of(k)} | {stats(dp) if dp else 'not run'} | {label_of(ref)} | "
                    f"{stats(base) if base else 'not run'} | {gap_cell} | within {unseen.TARGET[eps]:g} | "
                    f"{SESSION12[eps]} |")
    return rows


# --------------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", choices=("proxy", "austen", "clip_only"), default=None,
                   help="proxy: the candidates on the proxy's validation split (seed 42); austen: the choices on "
                        "Austen's test split (--seeds); clip_only: the ε = 8 choice with σ = 0 on Austen (not "
                        "private, a diagnostic).")
    p.add_argument("--epsilons", default="8,inf,3", help="Comma-separated ε (inf: non-private), in this order.")
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="The Austen test runs' seeds.")
    p.add_argument("--proxy-out", default="benchmarks/utility_lorad_proxy.json")
    p.add_argument("--austen-out", default="benchmarks/utility_lorad_austen.json")
    p.add_argument("--proxy-reuse", default="benchmarks/utility_proxy.json",
                   help="Session 12's proxy runs: the r = 8, C = 1 records (L7 DP, L2 non-private) are copied.")
    p.add_argument("--austen-reuse", default="benchmarks/utility_austen_proxy.json",
                   help="Session 12's Austen runs of the proxy's choices: a chosen (key, seed) there is copied.")
    p.add_argument("--proxy-cache", default=os.path.expanduser("~/.cache/hf_dp/utility_fortunes_cache.pt"))
    p.add_argument("--austen-cache", default=os.path.expanduser("~/.cache/hf_dp/utility_austen_cache.pt"))
    p.add_argument("--also", default="",
                   help="--stage clip_only: more DP keys (comma-separated) run with σ = 0 after the chosen one, "
                        "marked 'not chosen, after the results'.")
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
        p.error("give --stage proxy, austen or clip_only (or --table-only)")
    if args.stage == "proxy":
        cache = proxy.build_cache(Path(args.proxy_cache))  # the existing cache: its settings match, not rebuilt
        psaved.update(task="fortunes proxy validation (utility_proxy.py's split and cache)",
                      reused_from=args.proxy_reuse)
        reuse = json.loads(Path(args.proxy_reuse).read_text())["runs"]
        for eps in epsilons:
            for label, k in candidates(eps):
                proxy.run_keys(proxy_out, psaved, precords, cache, [k], [CHOICE_SEED],
                               {"task": "fortunes_proxy", "evaluated_on": "proxy validation (2,000 fortunes)",
                                "candidate": label}, "/tmp/hf_dp_utility_lorad_proxy", reuse)
    elif args.stage == "austen":
        todo = chosen_keys(precords, epsilons)  # refused if a candidate it ranks has no record
        cache = unseen.build_cache(Path(args.austen_cache))  # the existing cache, not rebuilt
        labels = np.asarray(cache["test"]["labels"])
        asaved.update(majority=float(np.bincount(labels).max() / len(labels)), books=cache["books"],
                      task="Austen test split (utility_unseen.py), rank / clipping chosen on the fortunes proxy",
                      reused_from=args.austen_reuse)
        reuse = json.loads(Path(args.austen_reuse).read_text())["runs"]
        for k, extra in todo:
            proxy.run_keys(austen_out, asaved, arecords, cache, [k], seeds,
                           {"task": "austen", "chosen_on": f"fortunes proxy validation, seed {CHOICE_SEED}",
                            "candidate": label_of(k), **extra}, "/tmp/hf_dp_utility_lorad_austen", reuse)
    elif args.stage == "clip_only":
        todo = [(choose(precords, 8.0), {"chosen_for_epsilon": 8.0})]  # the pre-registered diagnostic
        todo += [(k, {"note": "not chosen, after the results"}) for k in args.also.split(",") if k]
        cache = unseen.build_cache(Path(args.austen_cache))
        done = {(utility.key(r), r["seed"]) for r in asaved.get("clip_only", [])}
        for seed, (k, extra) in ((s, t) for t in todo for s in seeds):
            if (k, seed) in done:
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rec = unseen.run_clip_only(cache, utility.parse_key(k), seed)
            asaved.setdefault("clip_only", []).append({**rec, "candidate": label_of(k), **extra})
            print(json.dumps(rec, default=str), flush=True)
            proxy._save(austen_out, asaved, arecords)
    print("proxy (fortunes) validation, seed 42:")
    print("\n".join(proxy_table(precords)))
    print("\nchoices:\n" + "\n".join(choices(precords)))
    print("\nAusten test:")
    print("\n".join(austen_table(arecords, precords)))
    for r in asaved.get("clip_only", []):
        print(f"\nσ = 0 diagnostic (not private), Austen seed {r['seed']}: {r['candidate']} `{utility.key(r)}`: "
              f"{100 * r['accuracy']:.2f} % ({r['cpu_s']:.0f} CPU s){' — ' + r['note'] if r.get('note') else ''}")


if __name__ == "__main__":
    main()
