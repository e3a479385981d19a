"""``python -m hf_dp plan`` / ``hf-dp plan``: the privacy plan of a run before any data is loaded.

Takes the Trainer's own argument names and prints σ, steps, q, ε, δ and the noise-to-signal ratios
(:func:`hf_dp.plan.plan_privacy`, the function ``DPTrainer.privacy_plan()`` uses), or with ``--json`` one JSON object::

    hf-dp plan --num_examples 50000 --per_device_train_batch_size 64 --gradient_accumulation_steps 16 \\
        --num_train_epochs 3 --target_epsilon 3 --trainable_parameters 1200000
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from .arguments import ACCOUNTANTS, CLIPPING_MODES, DPTrainingArguments
from .plan import plan_privacy

__all__ = ["main", "build_parser"]

_FIELDS = DPTrainingArguments.__dataclass_fields__


def _default(name: str) -> Any:
    """The default of a ``DPTrainingArguments`` field: the CLI plans what a run with the same arguments gets."""
    return _FIELDS[name].default


def _help(name: str, extra: str = "") -> str:
    text = _FIELDS[name].metadata.get("help", "") if name in _FIELDS else ""
    return " ".join(t for t in (text, extra) if t) + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    """The ``hf-dp`` parser (subcommand ``plan``)."""
    parser = argparse.ArgumentParser(prog="hf-dp", description="hf_dp command-line tools.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{plan}")
    plan = sub.add_parser(
        "plan", help="Plan a privacy budget before any data is loaded.",
        description="The privacy plan of a DPTrainer run from the Trainer's own argument names: the noise multiplier "
                    "σ, the steps, the sampling rate q, ε and δ, and the noise-to-signal ratios. The numbers are "
                    "those DPTrainer.privacy_plan() returns (and train() uses) for the same arguments. Give exactly "
                    "one of --target_epsilon and --noise_multiplier.",
    )
    plan.add_argument("--num_examples", type=int, required=True,
                      help="N: training examples (users with --privacy_unit user), i.e. len(train_dataset).")
    plan.add_argument("--per_device_train_batch_size", type=int, default=_default("per_device_train_batch_size"),
                      help="Expected examples per device and accumulation step (%(default)s).")
    plan.add_argument("--gradient_accumulation_steps", type=int, default=_default("gradient_accumulation_steps"),
                      help="Accumulation steps per optimizer step (%(default)s). The expected batch is "
                           "per_device_train_batch_size × gradient_accumulation_steps × world_size.")
    plan.add_argument("--world_size", type=int, default=1, help="Number of processes (%(default)s).")
    plan.add_argument("--num_train_epochs", type=float, default=_default("num_train_epochs"),
                      help="Epochs (%(default)s); steps = ceil(epochs × ceil(N / expected batch)).")
    plan.add_argument("--max_steps", type=int, default=_default("max_steps"),
                      help="If > 0: the number of optimizer steps, overriding --num_train_epochs (%(default)s).")
    plan.add_argument("--target_epsilon", type=float, default=None, help=_help("target_epsilon"))
    plan.add_argument("--noise_multiplier", type=float, default=None, help=_help("noise_multiplier"))
    plan.add_argument("--target_delta", type=float, default=None, help=_help("target_delta"))
    plan.add_argument("--trainable_parameters", type=int, default=None,
                      help="d: trainable parameters, for the noise-to-signal ratios (left out when not given).")
    plan.add_argument("--per_sample_max_grad_norm", type=float, default=_default("per_sample_max_grad_norm"),
                      help=_help("per_sample_max_grad_norm"))
    plan.add_argument("--accountant", choices=ACCOUNTANTS, default=_default("accountant"), help=_help("accountant"))
    plan.add_argument("--accountant_eps_error", type=float, default=_default("accountant_eps_error"),
                      help=_help("accountant_eps_error"))
    plan.add_argument("--clipping", choices=CLIPPING_MODES, default=_default("clipping"),
                      help="Clipping mode, recorded in the plan (%(default)s).")
    plan.add_argument("--privacy_unit", choices=("example", "user"), default=_default("privacy_unit"),
                      help=_help("privacy_unit", "With 'user', --num_examples counts users and the batch sizes "
                                                 "count users."))
    plan.add_argument("--json", action="store_true", help="Print one JSON object instead of a table.")
    return parser


_ROWS = (
    ("noise multiplier σ", "noise_multiplier", "{:.6g}"),
    ("ε (planned)", "epsilon", "{:.4f}"),
    ("δ", "delta", "{:.3g}"),
    ("target ε", "target_epsilon", "{}"),
    ("sampling rate q", "sample_rate", "{:.6g}"),
    ("expected batch size", "expected_batch_size", "{}"),
    ("examples N", "num_examples", "{}"),
    ("steps", "steps", "{}"),
    ("epochs", "epochs", "{:.4g}"),
    ("clipping norm C", "per_sample_max_grad_norm", "{:g}"),
    ("noise std on the sum σ·C", None, None),
    ("accountant", "accountant_used", "{}"),
    ("trainable parameters d", "trainable_parameters", "{:,}"),
    ("noise-to-signal per step", "noise_to_signal", "{:.4g}"),
    ("noise-to-signal over run", "noise_to_signal_over_run", "{:.4g}"),
)


def format_plan(plan: dict[str, Any]) -> str:
    """The plan as a readable table."""
    lines = []
    for label, key, fmt in _ROWS:
        if key is None:
            value = f"{plan['noise_multiplier'] * plan['per_sample_max_grad_norm']:.6g}"
        elif plan.get(key) is None:
            continue
        else:
            value = fmt.format(plan[key])
        lines.append(f"{label:<28} {value}")
    if plan["noise_dominates"]:
        lines.append("")
        lines.append(plan["advice"])
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hf-dp`` and ``python -m hf_dp``."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    kwargs = {k: v for k, v in vars(ns).items() if k not in ("command", "json")}
    try:
        plan = plan_privacy(**kwargs)
    except ValueError as err:
        parser.exit(2, f"hf-dp plan: error: {err}\n")
    print(json.dumps(plan, indent=2) if ns.json else format_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
