"""The budget planner (issue 25, item 4): ``hf-dp plan`` / ``python -m hf_dp plan`` before any data is loaded.

The command line gives exactly ``DPTrainer.privacy_plan()`` for the same arguments (one function, ``hf_dp/plan.py``),
its ε equals prv-accountant's own upper bound computed here directly, and bad arguments fail with a clear message.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import tomllib
import torch
from helpers import REPO, cls_dataset, tiny_bert, user_args, user_data
from prv_accountant import PRVAccountant
from prv_accountant.privacy_random_variables import PoissonSubsampledGaussianMechanism

from hf_dp import DPTrainer, DPTrainingArguments
from hf_dp.__main__ import main
from hf_dp.plan import plan_privacy


def head_only_bert() -> torch.nn.Module:
    torch.manual_seed(0)
    model = tiny_bert(num_labels=2)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("classifier"))
    return model


def trainer_for(tmp_path, **kw) -> DPTrainer:
    args = DPTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no",
                               dp_seed=0, **kw)
    return DPTrainer(model=head_only_bert(), args=args, train_dataset=cls_dataset(60, num_labels=2))


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "hf_dp", "plan", *argv], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)


def test_cli_json_is_the_trainers_privacy_plan(tmp_path):
    """Epoch-based: ceil(60/16) = 4 steps per epoch, 1.3 epochs -> 6 steps (the Trainer's rounding); the
    subprocess's JSON equals ``privacy_plan()`` key for key, value for value."""
    kw = dict(per_device_train_batch_size=4, gradient_accumulation_steps=4, num_train_epochs=1.3, noise_multiplier=0.8,
              per_sample_max_grad_norm=0.5)
    trainer = trainer_for(tmp_path, **kw)
    plan = trainer.privacy_plan()
    d = plan["trainable_parameters"]
    done = run_cli("--num_examples", "60", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "4",
                   "--num_train_epochs", "1.3", "--noise_multiplier", "0.8", "--per_sample_max_grad_norm", "0.5",
                   "--trainable_parameters", str(d), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == plan
    assert plan["steps"] == 6 == trainer.planned_max_steps() and not plan["noise_multiplier_calibrated"]


def test_cli_in_process_matches_trainer_with_max_steps_and_target(tmp_path, capsys):
    """σ calibrated to a target (the same calibration), max_steps wins over epochs, an explicit δ, the RDP
    accountant; and the readable table."""
    kw = dict(per_device_train_batch_size=5, gradient_accumulation_steps=2, max_steps=7, num_train_epochs=9,
              target_epsilon=4.0, target_delta=1e-3, accountant="rdp")
    plan = trainer_for(tmp_path, **kw).privacy_plan()
    argv = ["plan", "--num_examples", "60", "--per_device_train_batch_size", "5", "--gradient_accumulation_steps", "2",
            "--max_steps", "7", "--num_train_epochs", "9", "--target_epsilon", "4", "--target_delta", "1e-3",
            "--accountant", "rdp", "--trainable_parameters", str(plan["trainable_parameters"])]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == plan
    assert plan["steps"] == 7 and plan["sample_rate"] == 10 / 60 and plan["accountant_used"] == "rdp"
    assert plan["noise_multiplier_calibrated"] and plan["epsilon"] <= 4.0
    assert main(argv) == 0
    table = capsys.readouterr().out
    for words in ("noise multiplier σ", f"{plan['noise_multiplier']:.6g}", "steps", "7", "ε (planned)",
                  f"{plan['epsilon']:.4f}", "noise-to-signal over run"):
        assert words in table


def test_epsilon_is_prv_accountants_upper_bound():
    """ε of the plan = prv-accountant's upper bound for the same (σ, q, T, δ), computed here with the package
    itself (not hf_dp's accountant); the calibrated σ meets the target and σ·0.99 misses it."""
    n, batch, steps, delta = 20_000, 256, 100, 1e-5
    plan = plan_privacy(num_examples=n, per_device_train_batch_size=batch, max_steps=steps, target_epsilon=3.0,
                        target_delta=delta)

    def prv_upper(sigma: float) -> float:
        prv = PoissonSubsampledGaussianMechanism(sampling_probability=batch / n, noise_multiplier=sigma)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            acc = PRVAccountant(prvs=[prv], eps_error=0.01, delta_error=delta / 1000, max_self_compositions=[steps])
            return acc.compute_epsilon(delta=delta, num_self_compositions=[steps])[2]

    sigma = plan["noise_multiplier"]
    assert plan["sample_rate"] == batch / n and plan["steps"] == steps and plan["accountant_used"] == "prv"
    assert plan["epsilon"] == pytest.approx(prv_upper(sigma), abs=0.01)
    assert plan["epsilon"] <= 3.0 < prv_upper(sigma * 0.99) + 0.01
    assert plan["noise_to_signal"] is None  # no --trainable_parameters: no ratios
    given = plan_privacy(num_examples=n, per_device_train_batch_size=batch, max_steps=steps, noise_multiplier=1.1,
                         target_delta=delta, trainable_parameters=10_000)
    assert given["epsilon"] == pytest.approx(prv_upper(1.1), abs=0.01)
    assert given["noise_to_signal"] == pytest.approx(1.1 * math.sqrt(10_000) / batch)
    assert given["noise_to_signal_over_run"] == pytest.approx(given["noise_to_signal"] / math.sqrt(steps))


@pytest.mark.parametrize("argv, message", [
    (["--num_examples", "100", "--target_epsilon", "3", "--noise_multiplier", "1"], "exactly one of target_epsilon"),
    (["--num_examples", "100"], "exactly one of target_epsilon"),
    (["--num_examples", "100", "--per_device_train_batch_size", "200", "--noise_multiplier", "1"], "q = 2.000 > 1"),
    (["--num_examples", "100", "--target_delta", "0.02", "--noise_multiplier", "1"], "not below 1/N"),
    (["--num_examples", "0", "--noise_multiplier", "1"], "num_examples must be an integer >= 1"),
    (["--num_examples", "100", "--num_train_epochs", "0", "--noise_multiplier", "1"], "num_train_epochs must be > 0"),
    (["--num_examples", "100", "--noise_multiplier", "-1"], "noise_multiplier must be a finite number >= 0"),
])
def test_argument_errors_are_clear(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "hf-dp plan: error:" in err and message in err


def test_missing_num_examples_and_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--target_epsilon", "3"])
    assert exc.value.code == 2 and "--num_examples" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    for name in ("--num_examples", "--per_device_train_batch_size", "--gradient_accumulation_steps",
                 "--num_train_epochs", "--max_steps", "--target_epsilon", "--noise_multiplier", "--target_delta",
                 "--trainable_parameters", "--world_size", "--json"):
        assert name in out


def test_console_script_is_declared():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["hf-dp"] == "hf_dp.__main__:main"


def test_world_size_and_user_level(tmp_path, capsys):
    """The expected batch counts every process (per-device × accumulation × world size); with privacy_unit="user"
    N counts users, and the trainer's plan is the command line's with --privacy_unit user --num_examples U."""
    plan = plan_privacy(num_examples=1000, per_device_train_batch_size=8, gradient_accumulation_steps=2, world_size=4,
                        noise_multiplier=1.0, max_steps=3)
    assert plan["expected_batch_size"] == 64 and plan["sample_rate"] == 0.064 and plan["steps"] == 3
    from helpers import tiny_gpt2

    trainer = DPTrainer(model=tiny_gpt2(), args=user_args(tmp_path, noise_multiplier=0.7, max_steps=4),
                        train_dataset=user_data())
    plan = trainer.privacy_plan()
    assert plan["num_examples"] == 5 and plan["privacy_unit"] == "user"  # 5 users, 12 rows
    assert main(["plan", "--num_examples", "5", "--per_device_train_batch_size", "3", "--gradient_accumulation_steps",
                 "1", "--max_steps", "4", "--noise_multiplier", "0.7", "--per_sample_max_grad_norm", "1",
                 "--privacy_unit", "user", "--trainable_parameters", str(plan["trainable_parameters"]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == plan
