#!/usr/bin/env python
"""Public pre-fine-tuning on the proxy task, then DP LoRA on Austen (issue 25, session 14).

With settings chosen on the public fortunes proxy (``benchmarks/utility_proxy.py``) DP LoRA on Austen stayed 5.8 / 8.9
points below non-private at ε = 8 / 3. DP fine-tuning learns well when the task's useful update lives in few
directions of the starting model (Li et al. 2022b, "When Does Differentially Private Learning Not Suffer in High
Dimensions?"); public data of the same kind can move the model there without spending budget (Li et al. 2022, "Large
Language Models Can Be Strong Differentially Private Learners", §5; Yu et al. 2022 §4; Ganesh et al. 2023, "Why Is
Public Pretraining Necessary for Private Model Training?"). Pre-registered in ``benchmarks/RESULTS.md`` ("Public
pre-fine-tuning on the proxy task (session 14)"):

* **stage 0** (:func:`run_stage0`; public data only, non-private, seed 42): MiniLM's top 2 layers (the ones not
  cached) and a fresh 6-way classifier trained on the proxy's 4,000 training fortunes at :data:`STAGE0_KEY` (the
  fine-food non-private top-2 choice, not tuned); its proxy validation accuracy recorded; the top 2 layers kept
  (:func:`top_layers_state`, saved with its sha256, :func:`save_top_state`), the classifier dropped. The bottom 4
  layers and the embeddings never train, so the Austen cache of their states stays valid: :func:`check_bottom`
  asserts it on the assembled model;
* **Austen** (:func:`with_top_state`): the same cache with the stage-0 top 2 layers in place of the pretrained ones,
  every run with a fresh classifier: DP LoRA at ε = 8 and 3 at the proxy's L7, non-private LoRA at its L2
  (:data:`AUSTEN_KEYS`), seeds 42, 43, 44, by ``utility.run_one`` and its run keys — records marked ``init``.

Results: ``benchmarks/utility_prefit_austen.json`` (``stage0``: the stage-0 record, the weights' sha256 and the
checks; ``runs``: one record per Austen run and seed; a finished (key, seed) is skipped when run again).

    python benchmarks/utility_prefit.py --stage 0                      # stage 0 on the proxy (≈ 4 CPU-min)
    python benchmarks/utility_prefit.py --stage austen --seeds 42      # DP ε = 8, non-private, DP ε = 3
    python benchmarks/utility_prefit.py --stage austen --seeds 43,44
    python benchmarks/utility_prefit.py --stage head --seeds 42        # after the results: the head on stage-0 features
    python benchmarks/utility_prefit.py --table-only
"""

from __future__ import annotations

import argparse
import hashlib
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
ROOT = HERE.parent
if str(HERE) not in sys.path:  # benchmarks/ is a folder of scripts: its loader, siblings.py, by name
    sys.path.insert(0, str(HERE))
from siblings import accuracy_by_key  # noqa: E402
from siblings import load as _load  # noqa: E402

proxy = _load("hf_dp_benchmark_utility_proxy", HERE / "utility_proxy.py")
utility, unseen = proxy.utility, proxy.unseen  # the modules utility_proxy.py loaded

STAGE0_KEY = "top2|inf|-|adam|head_lr=0.05|lr=0.0001|batch=512|max_steps=32"  # fine-food non-private top-2, not tuned
STAGE0_SEED = 42
DP_SETTING = proxy.LORA_CANDIDATES[6]  # L7: head_lr=0.05|lr=0.01|batch=256|max_steps=64 (DP's proxy choice, ε = 8, 3)
NP_SETTING = proxy.LORA_CANDIDATES[1]  # L2: head_lr=0.05|lr=0.01|batch=512|max_steps=32 (non-private's proxy choice)
AUSTEN_KEYS = [f"lora|8.0|clip|adam|{DP_SETTING}", f"lora|inf|-|adam|{NP_SETTING}",  # the pre-registered order
               f"lora|3.0|clip|adam|{DP_SETTING}"]
HEAD_KEYS = ["head|8.0|clip|adam|lr=0.05|batch=512|max_steps=24",  # after the results: H2 (DP's proxy choice)
             "head|3.0|clip|adam|lr=0.05|batch=512|max_steps=24", "head|inf|-|adam|lr=0.02|batch=512|max_steps=24"]
SEEDS = (42, 43, 44)
INIT = "prefit: top 2 layers of stage 0 (fortunes proxy training split, non-private)"
SESSION12 = {8.0: 5.8, 3.0: 8.9}  # the Austen gaps of the same keys from the original MiniLM (3 seeds)


# --------------------------------------------------------------------------------------------------------- weights
def top_layers_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The top layers of a ``utility.TopLayersForSequenceClassification`` (``model.layer``, keys as the caches'
    ``top_state``: ``0.attention.self.query.weight`` ...), cloned; the classifier is not in it (dropped)."""
    return {k: v.detach().clone() for k, v in model.layer.state_dict().items()}


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def save_top_state(state: dict[str, torch.Tensor], path: Path) -> str:
    """``torch.save`` of ``state`` to ``path``; returns the file's sha256 (recorded in the JSON, checked on load)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return sha256_file(path)


def load_top_state(path: Path, sha256: str) -> dict[str, torch.Tensor]:
    """The state saved by :func:`save_top_state`, refused unless the file's sha256 is the recorded one (another
    stage 0 would make the Austen runs of this JSON a different experiment)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no stage-0 weights; run --stage 0 first")
    found = sha256_file(path)
    if found != sha256:
        raise ValueError(f"{path} has sha256 {found}, not the stage-0 weights' {sha256} recorded in the JSON: the file "
                         "changed since stage 0 ran; restore it, or start a new JSON (--out) and run --stage 0 again")
    return torch.load(path, weights_only=True)


def with_top_state(cache: dict[str, Any], state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A shallow copy of ``cache`` whose ``top_state`` (what ``utility.make_model`` loads into the top layers) is
    ``state``: every run on it starts from those layers with a fresh classifier. Refused unless ``state`` has the
    cache's keys and shapes (the same architecture)."""
    old = cache["top_state"]
    if set(old) != set(state):
        raise ValueError(f"the stage-0 state's keys differ from the cache's top layers: missing "
                         f"{sorted(set(old) - set(state))[:3]}, unexpected {sorted(set(state) - set(old))[:3]}")
    bad = [k for k in old if tuple(old[k].shape) != tuple(state[k].shape)]
    if bad:
        raise ValueError(f"the stage-0 state's shapes differ from the cache's top layers at {bad[:3]}")
    return {**cache, "top_state": state}


def same_top_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def relative_change(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    """‖after − before‖ / ‖before‖ over all coordinates (how far stage 0 moved the top layers)."""
    num = sum(float((after[k].double() - before[k].double()).pow(2).sum()) for k in before)
    den = sum(float(before[k].double().pow(2).sum()) for k in before)
    return math.sqrt(num / den)


def assemble(bert: torch.nn.Module, state: dict[str, torch.Tensor], cut: int) -> torch.nn.Module:
    """``bert`` (a ``BertModel``, changed in place and returned) with ``state`` loaded into its layers ``cut`` and
    above: the whole model a user of the pre-fine-tuned encoder would hold."""
    bert.encoder.layer[cut:].load_state_dict(state)
    return bert


def check_bottom(pretrained: torch.nn.Module, assembled: torch.nn.Module, state: dict[str, torch.Tensor],
                 cut: int) -> dict[str, Any]:
    """Every parameter and buffer of ``assembled`` below layer ``cut`` (embeddings, layers 0 … cut − 1) identical to
    ``pretrained``'s, and its layers ``cut`` … equal to ``state``. Raises on any difference; returns counts."""
    ref = pretrained.state_dict()
    got = assembled.state_dict()
    top = tuple(f"encoder.layer.{i}." for i in range(cut, len(assembled.encoder.layer)))
    bottom = [k for k in got if not k.startswith(top)]
    changed = [k for k in bottom if not torch.equal(got[k], ref[k])]
    if changed:
        raise AssertionError(f"stage 0 changed weights below layer {cut}: {changed[:5]}; the cached states of the "
                             "frozen layers would no longer be this model's")
    local = {k.split(".", 2)[2]: v for k, v in got.items() if k.startswith(top)}
    local = {f"{int(k.split('.')[0]) - cut}.{k.split('.', 1)[1]}": v for k, v in local.items()}
    if not same_top_state(local, state):
        raise AssertionError("the assembled model's top layers are not the stage-0 state")
    return {"bottom_tensors_identical": len(bottom), "top_tensors_loaded": len(local)}


# --------------------------------------------------------------------------------------------------------- stage 0
def run_stage0(cache: dict[str, Any], out: Path, seed: int = STAGE0_SEED, key: str = STAGE0_KEY,
               epochs_scale: float = 1.0) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``utility.run_one`` of ``key`` (non-private top 2 layers) on ``cache`` (the proxy's: training split, evaluated
    on its validation split under ``"test"``), the trained model kept through the cache's ``make_model`` hook;
    returns (its record, :func:`top_layers_state` of the trained model)."""
    run = utility.parse_key(key)
    if run["method"] != "top2" or not math.isinf(run["epsilon"]):
        raise ValueError(f"stage 0 trains the top 2 layers non-privately on public data, not {key!r}")
    held: dict[str, torch.nn.Module] = {}

    def make(c: dict[str, Any], method: str, s: int) -> torch.nn.Module:
        held["model"] = utility.make_model({k: v for k, v in c.items() if k != "make_model"}, method, s)
        return held["model"]

    record = utility.run_one({**cache, "make_model": make}, run, out, seed, epochs_scale)
    return record, top_layers_state(held["model"])


def bottom_checks(pcache: dict[str, Any], acache: dict[str, Any], state: dict[str, torch.Tensor],
                  sample: int = 64) -> dict[str, Any]:
    """The real checks (pretrained MiniLM, both caches): stage 0 started from the top layers the Austen cache was
    built with (both caches' ``top_state`` equal the pretrained layers 4, 5); the assembled model's bottom layers are
    the pretrained ones (:func:`check_bottom`); and its states entering layer 4, recomputed for the first ``sample``
    Austen training passages, equal the Austen cache's."""
    from transformers import AutoTokenizer

    ex = _load("hf_dp_example_text_cls", ROOT / "examples" / "dp_text_classification.py")
    path = ex.default_model_path()
    pretrained = ex.BertMeanPoolingForSequenceClassification.from_pretrained(path, num_labels=6).bert.eval()
    cut = len(pretrained.encoder.layer) - utility.TOP
    start = {k: v for k, v in pretrained.encoder.layer[cut:].state_dict().items()}
    if not (same_top_state(start, pcache["top_state"]) and same_top_state(start, acache["top_state"])):
        raise AssertionError("the caches' top layers are not the pretrained MiniLM's: stage 0 did not start from the "
                             "model whose bottom layers built the Austen cache")
    assembled = ex.BertMeanPoolingForSequenceClassification.from_pretrained(path, num_labels=6).bert.eval()
    counts = check_bottom(pretrained, assemble(assembled, state, cut), state, cut)
    splits, _ = unseen.austen_splits(acache["settings"][3], acache["settings"][4])
    states, _, _ = utility.encode_states(assembled, AutoTokenizer.from_pretrained(path),
                                         splits["train"]["text"][:sample], unseen.SEQ_LEN, cut)
    diff = max(float((a - b).abs().max()) for a, b in zip(states, acache["train"]["states"][:sample]))
    if diff > 1e-4:
        raise AssertionError(f"the assembled model's states entering layer {cut} differ from the Austen cache's by "
                             f"{diff:g}: the cache is not this model's")
    return {**counts, "austen_states_rechecked": sample, "austen_states_max_abs_diff": diff,
            "start_equals_both_caches_top_state": True, "relative_change_of_top_layers": relative_change(start, state)}


# --------------------------------------------------------------------------------------------------------- head
def top_features(cache: dict[str, Any], state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A copy of ``cache`` whose ``features`` (what the head method trains on) are the mean-pooled outputs of the top
    layers ``state`` on the cached states (the frozen stage-0 encoder's features), batches of 256."""
    from transformers.masking_utils import create_bidirectional_mask

    model = utility.make_model(with_top_state(cache, state), "top2", 0).eval()
    out = {**cache, "top_state": state}
    for part in ("train", "test"):
        feats = []
        with torch.no_grad():
            rows = cache[part]["states"]
            for s in range(0, len(rows), 256):
                batch = utility.collate([{"hidden_states": h, "labels": 0} for h in rows[s:s + 256]])
                h = batch["hidden_states"]
                mask4 = create_bidirectional_mask(config=model.config, inputs_embeds=h,
                                                  attention_mask=batch["attention_mask"])
                for layer in model.layer:
                    h = layer(h, attention_mask=mask4)
                    h = h[0] if isinstance(h, tuple) else h
                m = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
                feats += list(((h * m).sum(1) / m.sum(1).clamp(min=1)).unbind(0))
        out[part] = {**cache[part], "features": feats}
    return out


# --------------------------------------------------------------------------------------------------------- report
def _by_key(records: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    return accuracy_by_key(records, utility.key)


def _stats(v: dict[int, float]) -> str:
    a = np.array([v[s] for s in sorted(v)])
    sd = f" ± {a.std(ddof=1):.1f}" if len(a) > 1 else ""
    return f"{a.mean():.1f}{sd} ({' / '.join(f'{v[s]:.2f}' for s in sorted(v))})"


def austen_table(records: list[dict[str, Any]], original: list[dict[str, Any]]) -> list[str]:
    """Per ε: DP LoRA (L7) and non-private LoRA (L2) from the stage-0 layers (mean ± sd; per seed), the gap (mean;
    per seed) against the target; beside the same keys from the original MiniLM (``original``: session 12's records)
    on the same seeds, and each side's change."""
    new, old = _by_key(records), _by_key(original)
    np_key = AUSTEN_KEYS[1]
    rows = ["| ε | start | DP LoRA L7 (mean ± sd; per seed) | non-private LoRA L2 (mean ± sd; per seed) "
            "| gap (mean; per seed) | target |", "|---|---|---|---|---|---:|"]
    for eps, dp_key in ((8.0, AUSTEN_KEYS[0]), (3.0, AUSTEN_KEYS[2])):
        for label, by in (("stage-0 top 2 (prefit)", new), ("original MiniLM (session 12)", old)):
            dp, base = by.get(dp_key, {}), by.get(np_key, {})
            if label.startswith("original"):
                seeds = set(new.get(dp_key, {})) | set(new.get(np_key, {})) or set(SEEDS)
                dp = {s: a for s, a in dp.items() if s in seeds}
                base = {s: a for s, a in base.items() if s in seeds}
            common = sorted(set(dp) & set(base))
            if common:
                gap = np.mean(list(base.values())) - np.mean(list(dp.values()))
                mark = "met" if gap <= unseen.TARGET[eps] else "**not met**"
                gap_cell = f"**{gap:.1f}** ({mark}; {' / '.join(f'{base[s] - dp[s]:.1f}' for s in common)})"
            else:
                gap_cell = "not run"
            rows.append(f"| {eps:g} | {label} | {_stats(dp) if dp else 'not run'} | "
                        f"{_stats(base) if base else 'not run'} | {gap_cell} | within {unseen.TARGET[eps]:g} |")
    return rows


def head_table(records: list[dict[str, Any]], original: list[dict[str, Any]]) -> list[str]:
    """The head (after the results): per key, on the stage-0 features and on the original ones (``original``: session
    12's records, the seeds run here only), mean ± sd; per seed; and the gaps non-private − DP of each."""
    new, old = _by_key(records), _by_key(original)
    seeds = set().union(*[set(v) for v in new.values()]) if new else set()
    old = {k: {s: a for s, a in v.items() if s in seeds} for k, v in old.items()}
    rows = ["| head | run key | stage-0 features (mean ± sd; per seed) | original features (session 12) |",
            "|---|---|---|---|"]
    for k in HEAD_KEYS:
        cells = [_stats(by[k]) if by.get(k) else "–" for by in (new, old)]
        rows.append(f"| {k.split('|')[1]} | `{k}` | " + " | ".join(cells) + " |")
    for eps, dp_key in ((8.0, HEAD_KEYS[0]), (3.0, HEAD_KEYS[1])):
        cells = []
        for by in (new, old):
            dp, base = by.get(dp_key, {}), by.get(HEAD_KEYS[2], {})
            common = sorted(set(dp) & set(base))
            cells.append(f"{np.mean([base[s] - dp[s] for s in common]):.1f}" if common else "–")
        rows.append(f"| gap ε = {eps:g} | | {cells[0]} | {cells[1]} |")
    return rows


def _save(out: Path, saved: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(saved, indent=1, default=str))


# --------------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", choices=("0", "austen", "head"), default=None,
                   help="0: stage 0 on the proxy (public; saves the top 2 layers); austen: the LoRA runs from them on "
                        "Austen's test split (--seeds); head: after the results, the head on the stage-0 features.")
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    p.add_argument("--out", default="benchmarks/utility_prefit_austen.json")
    p.add_argument("--weights", default=os.path.expanduser("~/.cache/hf_dp/utility_prefit_top2.pt"))
    p.add_argument("--proxy-cache", default=os.path.expanduser("~/.cache/hf_dp/utility_fortunes_cache.pt"))
    p.add_argument("--austen-cache", default=os.path.expanduser("~/.cache/hf_dp/utility_austen_cache.pt"))
    p.add_argument("--original", default="benchmarks/utility_austen_proxy.json",
                   help="Session 12's Austen runs of the same keys from the original MiniLM (the comparison).")
    p.add_argument("--table-only", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("hf_dp").setLevel(logging.WARNING)
    out = Path(args.out)
    saved: dict[str, Any] = json.loads(out.read_text()) if out.is_file() else {}
    records: list[dict[str, Any]] = saved.setdefault("runs", [])
    seeds = [int(s) for s in args.seeds.split(",")]
    if not args.table_only and args.stage is None:
        p.error("give --stage 0, austen or head (or --table-only)")
    if args.stage == "0":
        if "stage0" in saved:
            p.error(f"{out} already holds a stage 0 (sha256 {saved['stage0']['sha256']}); one stage 0 per JSON")
        pcache = proxy.build_cache(Path(args.proxy_cache))  # the existing cache: its settings match, not rebuilt
        record, state = run_stage0(pcache, Path("/tmp/hf_dp_utility_prefit") / "stage0")
        sha = save_top_state(state, Path(args.weights))
        acache = unseen.build_cache(Path(args.austen_cache))
        checks = bottom_checks(pcache, acache, state)
        saved["stage0"] = {**record, "task": "fortunes_proxy", "evaluated_on": "proxy validation (2,000 fortunes)",
                           "weights": args.weights, "sha256": sha, "kept": "top 2 layers (classifier dropped)",
                           "checks": checks}
        _save(out, saved)
        print(json.dumps(saved["stage0"], default=str), flush=True)
    elif args.stage in ("austen", "head"):
        if "stage0" not in saved:
            p.error(f"{out} has no stage 0: run --stage 0 first")
        state = load_top_state(Path(args.weights), saved["stage0"]["sha256"])
        acache = unseen.build_cache(Path(args.austen_cache))  # the existing cache, not rebuilt
        labels = np.asarray(acache["test"]["labels"])
        saved.update(majority=float(np.bincount(labels).max() / len(labels)), books=acache["books"],
                     task="Austen test split (utility_unseen.py), from the stage-0 top 2 layers")
        cache = with_top_state(acache, state) if args.stage == "austen" else top_features(acache, state)
        keys = AUSTEN_KEYS if args.stage == "austen" else HEAD_KEYS
        extra = {"task": "austen", "init": INIT, "top2_sha256": saved["stage0"]["sha256"],
                 **({"note": "after the results"} if args.stage == "head" else {})}
        for seed in seeds:  # seed by seed, in the pre-registered order of the keys
            proxy.run_keys(out, {k: v for k, v in saved.items() if k != "runs"}, records, cache, keys, [seed],
                           extra, "/tmp/hf_dp_utility_prefit")
    original = json.loads(Path(args.original).read_text())["runs"] if Path(args.original).is_file() else []
    if "stage0" in saved:
        s0 = saved["stage0"]
        print(f"stage 0 (proxy validation, seed {s0['seed']}): {100 * s0['accuracy']:.2f} %, {s0['cpu_s']:.0f} CPU s, "
              f"sha256 {s0['sha256'][:16]}…, checks {s0['checks']}")
    print(f"\nAusten test (majority {100 * saved.get('majority', float('nan')):.1f} %):")
    print("\n".join(austen_table([r for r in records if r["method"] == "lora"], original)))
    if any(r["method"] == "head" for r in records):
        print("\n" + "\n".join(head_table([r for r in records if r["method"] == "head"], original)))


if __name__ == "__main__":
    main()
