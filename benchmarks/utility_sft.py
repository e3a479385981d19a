#!/usr/bin/env python
"""Privacy–utility benchmark (issue 25), DP-SFT part: completion perplexity against ε on the chat data.

The task is ``examples/dp_sft.py``'s, reused by import (never copied): its public GPT-2 (4 × 128, vocabulary 8,192,
pre-trained on Jane Austen and cached), its chatterbot conversations (``load_chats``: 1,825 training / 200 held-out
test conversations, one conversation = one privacy unit), its chat template with assistant-only loss, its
``completion_perplexity`` (exp of the mean NLL over the bot's tokens of the evaluation conversations), its LoRA
config (r = 8, α = 16 on ``c_attn``, ``c_proj``, ``c_fc``), its DP run (``dp_run``: ``DPSFTTrainer``, packed,
Poisson sampling) and its non-private run (``non_private_run``: trl's ``SFTTrainer``).

Methods (``method`` of a run key): ``full`` (all 1.86 M parameters), ``lora`` (LoRA adapters only) and ``public``
(the public model alone, no private data: ε = 0). Each DP run (``clipping``: ``clip`` = min(1, C/‖g‖) or
``automatic`` = C/(‖g‖ + 0.01), Bu et al. 2023; ``optim``: ``adam`` = AdamW or ``adam_bc`` = DP-AdamBC, Tang et al.
2024, floor γ′ = the run's noise variance Φ = (σC/(qN))²) beside its non-private counterpart (ε = ∞): the same
optimizer, learning rate, constant schedule, steps and conversations per step — trl's ``SFTTrainer`` **unpacked**
(``packing=False``), fixed batches of the DP run's expected size in conversations. (The example's own non-private
baseline packs the dataset into blocks of ``max_length`` tokens, so each of its rows holds ~3 conversations and a
step sees ~3× the DP step's conversations; ``np_packing=True`` in a run key reproduces that.)

Protocol: settings are chosen on a validation split carved from the TRAINING conversations (``split=val``: the model
trains on the first 1,625 and is evaluated on the last 200; the 200 test conversations are not read), at ε = 8
with (clip, Adam); the chosen setting then runs at ε ∈ {1, 3, 8} and ∞ on the test conversations
(``split=test``: trained on all 1,825).

Every setting is in a run's key, ``method|ε|clipping|optim|lr=…|batch=…|steps=…|C=…|max_length=…|split=…`` (and
``np_packing=…`` where not the default), e.g. ``lora|8.0|clip|adam|lr=0.005|batch=64|steps=16|C=0.1|max_length=128|
split=val``; finished runs (same key and seed) are skipped when the script runs again.

    python benchmarks/utility.py --task sft --val            # the validation sweep (sweep())
    python benchmarks/utility.py --task sft --final          # the chosen settings on the test split (final())
    python benchmarks/utility.py --task sft --extra          # automatic clipping and DP-AdamBC at ε = 8 (extra())
    python benchmarks/utility.py --task sft --runs 'lora|3.0|clip|adam|lr=0.01'   # any runs (missing settings:
                                                                                  # the defaults below)
    python benchmarks/utility.py --task sft --plot-only      # the table and docs/utility_sft.png from the JSON

Results: ``--out`` (default ``benchmarks/utility_sft.json``, one record per run), the plot ``--plot`` (default
``docs/utility_sft.png``, test split only), the table on stdout and in ``--markdown``. Choosing settings on private
data is itself not covered by the guarantee; the chatterbot corpus is public.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import math
import os
import sys
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EPSILONS = (1.0, 3.0, 8.0)
VAL = 200  # split=val: the last VAL training conversations are the validation set
MICRO = 64  # conversations per micro-batch (memory only); an expected batch is a multiple of it
# The defaults of a run key's settings (a run key names them all once parsed). Learning rates and C = 0.1: the
# example's (full 2e-3, LoRA 5e-3). Expected batch 64 and 16 steps (~0.56 epoch of 1,825): the example's batch 128
# for 3 epochs (45 steps) costs ~7-10 CPU s a step here, ~6 min a run — too slow for the grid on 2 shared cores.
DEFAULT_LR = {"full": 2e-3, "lora": 5e-3, "public": 0.0}
DEFAULTS: dict[str, Any] = {"batch": 64, "steps": 16, "C": 0.1, "max_length": 128, "split": "test",
                            "np_packing": False}
SETTINGS: dict[str, Any] = {"lr": float, "batch": int, "steps": int, "C": float, "max_length": int, "split": str,
                            "np_packing": lambda v: str(v).lower() in ("1", "true", "yes")}


# --------------------------------------------------------------------------------------------------------- keys
def key(run: dict[str, Any]) -> str:
    """``method|ε|clipping|optim|lr=…|batch=…|steps=…|C=…|max_length=…|split=…`` — every setting that acts on the run
    (the public model: max_length and split only; non-private: no C; ``np_packing`` only where True)."""
    names = ["lr", "batch", "steps", "C", "max_length", "split"]
    if run["method"] == "public":
        names = ["max_length", "split"]
    elif math.isinf(run["epsilon"]):
        names = ["lr", "batch", "steps", "max_length", "split"] + (["np_packing"] if run.get("np_packing") else [])
    extra = "".join(f"|{n}={run[n]:g}" if isinstance(run[n], float) else f"|{n}={run[n]}" for n in names)
    return f"{run['method']}|{run['epsilon']}|{run['clipping']}|{run['optim']}{extra}"


def parse_key(text: str) -> dict[str, Any]:
    """The run a :func:`key` names, missing settings filled with :data:`DEFAULTS` (and the method's learning rate)."""
    method, eps, clipping, optim, *rest = text.split("|")
    if method not in DEFAULT_LR:
        raise ValueError(f"method must be one of {', '.join(DEFAULT_LR)}, not {method!r} (in {text!r})")
    run: dict[str, Any] = {"method": method, "epsilon": float(eps), "clipping": clipping, "optim": optim,
                           "lr": DEFAULT_LR[method], **DEFAULTS}
    for item in rest:
        name, _, value = item.partition("=")
        if name not in SETTINGS:
            raise ValueError(f"unknown setting {name!r} in run key {text!r}; known: {', '.join(SETTINGS)}")
        run[name] = SETTINGS[name](value)
    private = method != "public" and not math.isinf(run["epsilon"])
    if private and (clipping not in ("clip", "automatic") or optim not in ("adam", "adam_bc")):
        raise ValueError(f"a DP run's clipping is clip or automatic and its optim adam or adam_bc (in {text!r})")
    if not private and (clipping, optim) != ("-", "-" if method == "public" else "adam"):
        raise ValueError(f"a non-private run is '-|adam', the public model '0.0|-|-' (in {text!r})")
    if method == "public" and run["epsilon"] != 0.0:
        raise ValueError(f"the public model alone has ε = 0 (in {text!r})")
    if run["split"] not in ("test", "val"):
        raise ValueError(f"split must be 'test' or 'val', not {run['split']!r} (in {text!r})")
    if run["batch"] % MICRO:
        raise ValueError(f"batch must be a multiple of the micro-batch {MICRO} (in {text!r})")
    return run


def sweep() -> list[dict[str, Any]]:
    """The validation sweep (``--val``), at ε = 8, (clip, Adam), in the order it ran: each method's example learning
    rate and larger ones (short runs), and the public model on the validation split."""
    keys = ["public|0.0|-|-", "lora|8.0|clip|adam|lr=0.005", "lora|8.0|clip|adam|lr=0.02",
            "full|8.0|clip|adam|lr=0.002", "full|8.0|clip|adam|lr=0.005",
            # both improved with the larger rate: one step further each
            "lora|8.0|clip|adam|lr=0.05", "full|8.0|clip|adam|lr=0.01",
            # full still improved (run after a first set of test runs at 1e-2, which stay in the JSON and the table)
            "full|8.0|clip|adam|lr=0.02", "full|8.0|clip|adam|lr=0.05"]
    return [{**parse_key(k), "split": "val"} for k in keys]


# The settings chosen on the validation split (RESULTS.md "DP-SFT: completion perplexity against ε").
CHOSEN = {"lora": "lr=0.02", "full": "lr=0.02"}


def final() -> list[dict[str, Any]]:
    """The chosen settings on the test split (``--final``): the public model; per method ε = 8, ∞, 3, 1."""
    keys = ["public|0.0|-|-"]
    for eps in ("8.0", "inf", "3.0", "1.0"):
        for method in ("lora", "full"):
            keys.append(f"{method}|{eps}|{'-' if eps == 'inf' else 'clip'}|adam|{CHOSEN[method]}")
    return [parse_key(k) for k in keys]


def extra() -> list[dict[str, Any]]:
    """Automatic clipping and DP-AdamBC with the chosen settings at ε = 8, test split (``--extra``)."""
    keys = [f"{m}|8.0|{c}|{o}|{CHOSEN[m]}" for c, o in (("automatic", "adam"), ("clip", "adam_bc"))
            for m in ("lora", "full")]
    return [parse_key(k) for k in keys]


# --------------------------------------------------------------------------------------------------------- runs
def example() -> ModuleType:
    """``examples/dp_sft.py`` (imported from its path)."""
    name = "hf_dp_example_dp_sft"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / "dp_sft.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def split_chats(chats: Any, split: str, val: int = VAL) -> Any:
    """``DatasetDict(train, test)`` to train and evaluate on: as given for ``split="test"``; for ``"val"`` the last
    ``val`` training conversations become the evaluation set and the model trains on the others — the test
    conversations are not used."""
    import datasets

    if split == "test":
        return chats
    if split != "val":
        raise ValueError(f"split must be 'test' or 'val', not {split!r}")
    train = chats["train"]
    if not 0 < val < len(train):
        raise ValueError(f"validation size {val} must be in (0, {len(train)}) training conversations")
    return datasets.DatasetDict(train=train.select(range(len(train) - val)),
                                test=train.select(range(len(train) - val, len(train))))


def example_args(run: dict[str, Any], seed: int, out: Path, n_train: int | None = None) -> tuple[Any, Any]:
    """The example's ``(ScriptArguments, DPSFTExampleConfig)`` for ``run``, parsed from its own command line."""
    from hf_dp import plan_privacy

    argv = ["--output_dir", str(out), "--methods", "lora" if run["method"] == "lora" else "full",
            "--baselines", "false", "--learning_rate", str(run["lr"]), "--lora_learning_rate", str(run["lr"]),
            "--per_device_train_batch_size", str(MICRO), "--gradient_accumulation_steps", str(run["batch"] // MICRO),
            "--max_steps", str(run["steps"]), "--max_length", str(run["max_length"]),
            "--per_sample_max_grad_norm", str(run["C"]), "--seed", str(seed), "--dp_seed", str(seed),
            "--dp_self_check", "false", "--disable_tqdm", "true", "--logging_steps", "1000", "--use_cpu", "true"]
    private = run["method"] != "public" and not math.isinf(run["epsilon"])
    if private:
        argv += ["--target_epsilon", str(run["epsilon"]), "--clipping_function", run["clipping"]]
        if run["optim"] == "adam_bc" and n_train is not None:  # (None: the data are not loaded yet)
            # γ′ = Φ = (σC/(qN))², the noise variance per coordinate (as benchmarks/utility.py's DP-AdamBC runs)
            plan = plan_privacy(num_examples=n_train, per_device_train_batch_size=MICRO,
                                gradient_accumulation_steps=run["batch"] // MICRO, max_steps=run["steps"],
                                target_epsilon=run["epsilon"])
            phi = (plan["noise_multiplier"] * run["C"] / (plan["sample_rate"] * n_train)) ** 2
            argv += ["--dp_adam_bias_correction", "true", "--dp_adam_bc_epsilon", repr(phi)]
    return example().parse_args(argv)


def run_one(run: dict[str, Any], seed: int, out: Path) -> dict[str, Any]:
    """One run of :func:`key`'s ``run``: train (unless the public model) and measure completion perplexity on its
    split's evaluation conversations. CPU time is this process's (one intra-op thread)."""
    from transformers import AutoModelForCausalLM

    ex = example()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    script_args, args = example_args(run, seed, out)
    tokenizer = ex.load_tokenizer(script_args)
    public = ex.public_model_path(script_args, tokenizer, seed)
    chats = split_chats(ex.load_chats(script_args, seed), run["split"])
    n = len(chats["train"])
    if run["optim"] == "adam_bc":
        script_args, args = example_args(run, seed, out, n)
    record: dict[str, Any] = {**run, "key": key(run), "seed": seed, "n_train": n, "n_eval": len(chats["test"]),
                              "evaluated_on": "validation (the last training conversations)" if run["split"] == "val"
                              else "test (held-out conversations)"}
    if run["method"] == "public":
        model = AutoModelForCausalLM.from_pretrained(public)
        row = {"steps": 0, "perplexity": ex.completion_perplexity(model, tokenizer, chats["test"], args.max_length)}
    elif math.isinf(run["epsilon"]):
        np_args = dataclasses.replace(args, packing=bool(run["np_packing"]))
        peft = ex.lora_config(script_args) if run["method"] == "lora" else None
        row = ex.non_private_run(public, np_args, run["steps"], tokenizer, chats, peft_config=peft)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            row = ex.dp_run(run["method"], public, script_args, args, tokenizer, chats)
    record.update({k: v for k, v in row.items() if k not in ("run", "epsilon", "steps")})
    record["steps_run"] = row["steps"]
    if "epsilon" in row and not math.isinf(row["epsilon"]) and run["method"] != "public":
        record["epsilon_spent"] = row["epsilon"]
    record["expected_batch"] = run["batch"]
    record["epochs"] = run["steps"] * run["batch"] / n if run["method"] != "public" else 0.0
    record["wall_s"] = time.perf_counter() - wall0
    record["cpu_s"] = time.process_time() - cpu0
    return record


# --------------------------------------------------------------------------------------------------------- report
LABEL = {"lora": "LoRA r=8", "full": "full fine-tuning"}


def summary(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per run key: the mean perplexity over seeds, its sample standard deviation (None for one seed), the number of
    seeds, the first record's other fields."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(key(r), []).append(r)
    out = {}
    for k, rs in groups.items():
        ppl = np.array([r["perplexity"] for r in rs])
        out[k] = {**rs[0], "perplexity": float(ppl.mean()),
                  "perplexity_sd": float(ppl.std(ddof=1)) if len(rs) > 1 else None, "seeds": len(rs)}
    return out


def _cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return "–"
    sd = f" ± {r['perplexity_sd']:.1f}" if r.get("perplexity_sd") is not None else ""
    return f"{r['perplexity']:.1f}{sd}"


def _settings(r: dict[str, Any]) -> str:
    return f"lr {r['lr']:g}, batch {r['batch']}, {r['steps']} steps, C {r['C']:g}" + (
        f", max_length {r['max_length']}" if r["max_length"] != DEFAULTS["max_length"] else "")


def markdown(records: list[dict[str, Any]], split: str) -> str:
    """One row per method × clipping × optimizer × settings on ``split``: perplexity at each ε beside the non-private
    run with the same settings, steps, σ at ε = 8 and the CPU seconds of one DP run."""
    by = {k: r for k, r in summary(records).items() if r["split"] == split}
    public = next((r for r in by.values() if r["method"] == "public"), None)
    rows: dict[tuple[Any, ...], dict[float, dict[str, Any]]] = {}
    for r in by.values():
        if r["method"] != "public" and not math.isinf(r["epsilon"]):
            rows.setdefault((r["method"], r["clipping"], r["optim"], _settings(r)), {})[r["epsilon"]] = r
    lines = ["| method | clipping | optimizer | settings | ε = 1 | ε = 3 | ε = 8 | ε = ∞ (non-private) | trainable "
             "| CPU s (DP run) | CPU s (non-private) |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    order = {("clip", "adam"): 0, ("automatic", "adam"): 1, ("clip", "adam_bc"): 2, ("automatic", "adam_bc"): 3}
    ranked = sorted(rows.items(), key=lambda kv: (kv[0][0] != "lora", next(iter(kv[1].values()))["lr"],
                                                  order[kv[0][1], kv[0][2]]))
    for (method, clipping, optim, text), cells in ranked:
        some = next(iter(cells.values()))
        base = by.get(key({**some, "epsilon": math.inf, "clipping": "-", "optim": "adam", "np_packing": False}))
        lo, hi = min(r["cpu_s"] for r in cells.values()), max(r["cpu_s"] for r in cells.values())
        cpu = f"{lo:.0f}" if round(lo) == round(hi) else f"{lo:.0f}–{hi:.0f}"
        lines.append(f"| {LABEL[method]} | {clipping} | {optim.replace('_', '-')} | {text} | "
                     + " | ".join(_cell(cells.get(eps)) for eps in EPSILONS)
                     + f" | {_cell(base)} | {some.get('trainable', 0):,} | {cpu} | "
                     + (f"{base['cpu_s']:.0f}" if base else "–") + " |")
    if public is not None:
        lines.append(f"\nPublic model alone (ε = 0, no private data): {public['perplexity']:.1f}. Completion "
                     f"perplexity (lower is better) on {public['n_eval']} "
                     + ("validation conversations (the last of the training set)." if split == "val"
                        else "held-out test conversations."))
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], path: Path) -> None:
    """Test-split perplexity against ε: one line per method × clipping × optimizer with the chosen settings, its
    non-private counterpart dashed, the public model dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    by = {k: r for k, r in summary(records).items() if r["split"] == "test"}
    fig, ax = plt.subplots(figsize=(7.4, 3.4), dpi=90)
    styles = {("clip", "adam"): ("o", "-"), ("automatic", "adam"): ("s", "none"), ("clip", "adam_bc"): ("^", "none"),
              ("automatic", "adam_bc"): ("v", "none")}
    xs = range(len(EPSILONS))
    for color, method in (("C0", "lora"), ("C3", "full")):
        settings = CHOSEN[method]
        for (clipping, optim), (marker, ls) in styles.items():
            pts = [(x, by[k]) for x, eps in zip(xs, EPSILONS)
                   if (k := key(parse_key(f"{method}|{eps}|{clipping}|{optim}|{settings}"))) in by]
            if pts:
                ax.plot([x for x, _ in pts], [r["perplexity"] for _, r in pts], color=color, marker=marker, ls=ls,
                        ms=5, mfc=color if (clipping, optim) == ("clip", "adam") else "none",
                        label=f"DP {LABEL[method]} ({clipping}, {optim.replace('_', '-')})")
        base = by.get(key(parse_key(f"{method}|inf|-|adam|{settings}")))
        if base:
            ax.axhline(base["perplexity"], color=color, ls="--", lw=1, label=f"non-private {LABEL[method]}")
    public = next((r for r in by.values() if r["method"] == "public"), None)
    if public:
        ax.axhline(public["perplexity"], color="grey", ls=":", lw=1, label="public model alone (ε = 0)")
    ax.set_xticks(list(xs), [f"{e:g}" for e in EPSILONS])
    ax.set_xlim(-0.3, len(EPSILONS) - 0.7)
    ax.set_xlabel("ε (δ = 1/N^1.1)")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.set_ylabel("completion perplexity (test, log scale)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    ax.set_title("hf_dp, benchmarks/utility_sft.py: DP-SFT on chatterbot (N = 1,825), GPT-2 4×128", fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


# --------------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(prog="benchmarks/utility.py --task sft", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/utility_sft.json")
    p.add_argument("--plot", default="docs/utility_sft.png")
    p.add_argument("--markdown", default=None)
    p.add_argument("--val", action="store_true", help="The validation sweep (sweep()); the test split is not read.")
    p.add_argument("--final", action="store_true", help="The chosen settings on the test split (final()).")
    p.add_argument("--extra", action="store_true", help="Automatic clipping and DP-AdamBC at ε = 8 (extra()).")
    p.add_argument("--runs", default=None, help="Comma-separated run keys, in this order.")
    p.add_argument("--plot-only", action="store_true")
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    for name in ("hf_dp", "dp_sft", "transformers", "trl"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import datasets
    import transformers

    transformers.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity(logging.ERROR)
    out = Path(args.out)
    records: list[dict[str, Any]] = json.loads(out.read_text())["runs"] if out.is_file() else []
    if not args.plot_only:
        runs = (sweep() if args.val else []) + (final() if args.final else []) + (extra() if args.extra else [])
        if args.runs:
            runs += [parse_key(k) for k in args.runs.split(",")]
        done = {(key(r), r["seed"]) for r in records}
        for run in runs:
            if (key(run), args.seed) in done:
                continue
            rec = run_one(run, args.seed, Path("/tmp/hf_dp_utility_sft") / key(run).replace("|", "_"))
            records.append(rec)
            print(json.dumps(rec, default=str), flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"runs": records}, indent=1, default=str))
    tables = [f"**{split}**\n\n" + markdown(records, split) for split in ("val", "test")
              if any(r["split"] == split for r in records)]
    print("\n\n".join(tables))
    if args.markdown:
        Path(args.markdown).write_text("\n\n".join(tables) + "\n")
    if args.plot and any(r["split"] == "test" for r in records):
        plot(records, Path(args.plot))
    return records


if __name__ == "__main__":
    main()
