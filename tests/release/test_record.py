"""The PrivacyRecord (issue 16): one record built by the trainer, read by the logs, privacy_spent(), dp_state.json and
the card; the card renders from dp_state.json alone; old dp_state.json files still resume; cards/synthetic/audit never
import the trainer."""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO, lm_dataset, quick_dp_args, tiny_gpt2
from huggingface_hub import ModelCard
from transformers import TrainerCallback

from hf_dp import DPTrainer, PrivacyRecord
from hf_dp.cards import privacy_report, validate_card

OLD_DP_STATE_KEYS = ("accountant", "noise_multiplier", "sample_rate", "per_sample_max_grad_norm", "num_examples",
                     "target_epsilon", "target_delta", "poisson_sampling", "clipping", "accountant_name", "epsilon",
                     "expected_batch_size", "accountant_used", "dp_guarantee", "noise_allocation", "group_clipping",
                     "secure_mode", "eval_data_is_public")
"""The keys of dp_state.json before the record (hf_dp session 5): files with only these must still resume."""


def make_trainer(out, n=32, data=None, callbacks=None, **kw) -> DPTrainer:
    args = quick_dp_args(out, **kw)
    torch.manual_seed(0)
    return DPTrainer(model=tiny_gpt2(), args=args, train_dataset=data if data is not None else lm_dataset(n),
                     callbacks=callbacks)


def user_data():
    authors = ["ann", "bob", "bob", "cy", "ann", "dee", "bob", "eve", "ann", "cy", "bob", "dee"] * 2
    return lm_dataset(len(authors), seed=11).add_column("author", authors)


class StopAt(TrainerCallback):
    """Stops training after ``step`` steps: the accountant's planned run (max_steps) is longer than the steps taken,
    so a report that read ε off the run-sized discretisation would differ from one computed for the steps taken."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


_RENDER_FROM_STATE = r"""
import json, sys
from hf_dp.cards import card_from_dp_state, validate_card
card = card_from_dp_state(sys.argv[1], model_name=sys.argv[2])
validate_card(card)
print(json.dumps({"data": card.data.to_dict(), "text": card.text}))
"""


# ------------------------------------------------------------------------------- the card from dp_state.json alone
@pytest.mark.parametrize("kind", ["flat", "adaptive_user"])
def test_card_renders_from_dp_state_alone_and_matches_the_trainers(tmp_path, kind):
    out = tmp_path / "run"
    if kind == "flat":
        trainer = make_trainer(out)
    else:  # group thresholds, adaptive clipping's noise split and the user-level settings must survive too
        trainer = make_trainer(out, data=user_data(), clipping="adaptive_per_layer", privacy_unit="user",
                               user_id_column="author", per_device_train_batch_size=2, max_examples_per_user=2)
    trainer.train()
    trainer.save_model()
    written = ModelCard.load(out / "README.md")
    alone = tmp_path / "hub-user"
    alone.mkdir()
    shutil.copy(out / "dp_state.json", alone / "dp_state.json")  # only the record: no weights, no README
    del trainer
    proc = subprocess.run([sys.executable, "-c", _RENDER_FROM_STATE, str(alone / "dp_state.json"), "run"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rendered = json.loads(proc.stdout.strip().splitlines()[-1])
    ours, theirs = rendered["data"]["differential_privacy"], written.data.to_dict()["differential_privacy"]
    assert list(ours) == list(theirs)  # same keys, same order
    for key in theirs:
        assert ours[key] == theirs[key], key
    if kind == "adaptive_user":
        assert ours["privacy_unit"] == "user" and ours["user_id_column"] == "author" and ours["num_examples"] == 24
        assert len(ours["group_thresholds"]) == 15 and "count_noise_multiplier" in ours["adaptive_clipping"]
    # the body's privacy part is the same text (only the hyperparameters, which dp_state.json does not hold, differ)
    cut = "## Training hyperparameters"
    assert rendered["text"].split(cut)[0] == written.text.split(cut)[0]
    validate_card(written)


# -------------------------------------------------------------------------- one run, four places, field by field
def test_logs_privacy_spent_dp_state_and_card_agree_field_by_field(tmp_path):
    out = tmp_path / "run"
    trainer = make_trainer(out, max_steps=8, callbacks=[StopAt(3)])
    trainer.train()
    trainer.save_model()
    assert trainer.accountant.steps == 3 and trainer.accountant.planned_steps == 8  # stopped early
    log = [h for h in trainer.state.log_history if "epsilon" in h][-1]
    assert "train_runtime" in log
    spent = trainer.privacy_spent()
    state = json.loads((out / "dp_state.json").read_text())
    card = privacy_report(out)
    validate_card(out)
    rows = [  # (field, log, privacy_spent(), dp_state.json, card)
        ("epsilon", log["epsilon"], spent["epsilon"], state["epsilon"], card["epsilon"]),
        ("delta", log["delta"], spent["delta"], state["target_delta"], card["delta"]),
        ("steps", log["dp_steps"], spent["steps"], sum(r["steps"] for r in state["accountant"]["history"]),
         card["steps"]),
        ("accountant_used", log["dp_accountant"], spent["accountant_used"], state["accountant_used"],
         card["accountant_used"]),
        ("accountant", None, spent["accountant"], state["accountant_name"], card["accountant"]),
        ("noise_multiplier", None, spent["noise_multiplier"], state["noise_multiplier"], card["noise_multiplier"]),
        ("sample_rate", None, spent["sample_rate"], state["sample_rate"], card["sampling_rate"]),
        ("per_sample_max_grad_norm", None, spent["per_sample_max_grad_norm"], state["per_sample_max_grad_norm"],
         card["per_sample_max_grad_norm"]),
        ("poisson_sampling", None, spent["poisson_sampling"], state["poisson_sampling"], card["sampling"] == "poisson"),
        ("dp_guarantee", None, spent["dp_guarantee"], state["dp_guarantee"], card["dp_guarantee"]),
        ("clipping", None, None, state["clipping"], card["clipping"]),
        ("privacy_unit", None, None, state["privacy_unit"], card["privacy_unit"]),
        ("expected_batch_size", None, None, state["expected_batch_size"], card["expected_batch_size"]),
        ("num_examples", None, None, state["num_examples"], card["dataset_size"]),
        ("eps_error", None, None, state["accountant"]["eps_error"], card["eps_error"]),
        ("mechanisms", None, None, [{"noise_multiplier": r["noise_multiplier"], "sampling_rate": r["sample_rate"],
                                     "steps": r["steps"]} for r in state["accountant"]["history"]], card["mechanisms"]),
        ("trained_parameters", None, None, state["trained_parameters"], card["trained_parameters"]),
        ("optimizer", None, None, state["optimizer"], card["optimizer"]),
        ("prv_accountant_version", None, None, state["accountant"]["prv_accountant_version"],
         card["prv_accountant_version"]),
        ("hf_dp_version", None, None, state["hf_dp_version"], card["hf_dp_version"]),
        ("budget_exhausted", None, None, state["budget_exhausted"], card["budget_exhausted"]),
    ]
    for field, in_log, in_spent, in_state, in_card in rows:
        values = [v for v in (in_spent, in_state) if v is not None]
        assert all(v == values[0] for v in values), (field, values)  # the two exact places: identical
        if field == "epsilon":  # the log rounds to 4 decimals, the card to 6 significant digits
            assert in_log == round(in_spent, 4), (field, in_log, in_spent)
            assert in_card == float(f"{in_spent:.6g}"), (field, in_card, in_spent)
        else:
            for v in (in_log, in_card):
                assert v is None or v == values[0], (field, v, values[0])
    assert math.isfinite(card["epsilon"]) and card["epsilon"] > 0


# ------------------------------------------------------------------------------------------- dp_state.json itself
def test_record_round_trips_through_dp_state(tmp_path):
    trainer = make_trainer(tmp_path / "run", clipping="per_layer", max_steps=2)
    trainer.train()
    record = trainer.privacy_record()
    assert record.accountant is trainer.accountant  # the contract with the DP step: the record reads it live
    state = json.loads(json.dumps(record.to_dict()))
    assert set(OLD_DP_STATE_KEYS) <= set(state)
    back = PrivacyRecord.from_dict(state)
    for f in dataclasses.fields(PrivacyRecord):
        if f.name != "accountant":
            assert getattr(back, f.name) == getattr(record, f.name), f.name
    assert back.accountant.state_dict() == record.accountant.state_dict()
    assert back.to_dict() == state and back.spent() == record.spent() and back.epsilon() == record.epsilon()
    assert back.log_fields(final=True) == record.log_fields(final=True)
    record.save(tmp_path / "dp_state.json")
    assert PrivacyRecord.load(tmp_path).to_dict() == state  # a directory holding dp_state.json, or the file


def test_continued_run_round_trips_and_its_card_renders_from_dp_state_alone(tmp_path):
    """Issue 22: a run that continued a DP-trained model keeps its earlier runs and run id in dp_state.json; the card
    rendered from that file alone says it continues, with the composed ε."""
    import warnings

    from hf_dp.cards import card_from_dp_state

    torch.manual_seed(0)
    model, data = tiny_gpt2(), lm_dataset(8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        DPTrainer(model=model, args=quick_dp_args(tmp_path / "a", max_steps=2, logging_steps=100),
                  train_dataset=data).train()
        second = DPTrainer(model=model, args=quick_dp_args(tmp_path / "b", max_steps=1, logging_steps=100),
                           train_dataset=data)
        second.train()
    record = second.privacy_record()
    state = json.loads(json.dumps(record.to_dict()))
    back = PrivacyRecord.from_dict(state)
    assert back.run_id == record.run_id and back.earlier_runs == record.earlier_runs
    assert [r["steps"] for r in back.earlier_runs] == [2] and back.steps == 3
    record.save(tmp_path / "dp_state.json")
    dp = card_from_dp_state(tmp_path / "dp_state.json").data.to_dict()["differential_privacy"]
    assert dp["continues_from"]["steps"] == 2 and dp["steps"] == 3
    assert dp["epsilon"] == pytest.approx(record.epsilon(), rel=1e-5)


def test_old_dp_state_without_the_new_keys_still_resumes(tmp_path):
    out = tmp_path / "run"
    trainer = make_trainer(out, max_steps=2, save_strategy="steps", save_steps=2)
    trainer.train()
    path = out / "checkpoint-2" / "dp_state.json"
    state = json.loads(path.read_text())
    old = {k: state[k] for k in OLD_DP_STATE_KEYS}  # as session 5 wrote it
    path.write_text(json.dumps(old, indent=2))
    record = PrivacyRecord.from_dict(old)
    assert record.steps == 2 and record.privacy_unit == "example" and record.noise_allocation == "global"
    assert record.epsilon() == pytest.approx(state["epsilon"], rel=1e-12)
    resumed = make_trainer(out, max_steps=3, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert resumed.accountant.steps == 3 and resumed.state.global_step == 3
    fresh = make_trainer(tmp_path / "fresh", max_steps=3)
    fresh.train()  # the same mechanism, 3 steps in one go: ε continues exactly
    assert resumed.privacy_spent()["epsilon"] == pytest.approx(fresh.privacy_spent()["epsilon"], rel=1e-12)


@pytest.mark.parametrize("dp_seed", [None, 5], ids=["secret", "fixed"])
def test_card_from_an_old_dp_state_says_what_it_does_not_record(tmp_path, dp_seed):
    """A dp_state.json written before the record (session 5 keys only) renders a valid card with its ε; what the old
    file does not hold (trained parameters, optimizer) is said to be unknown, and the seed is read from the old
    guarantee notes (a fixed dp_seed was always noted there), not assumed secret."""
    from hf_dp import card_from_dp_state
    from hf_dp.synthetic import resolve_privacy

    out = tmp_path / "run"
    trainer = make_trainer(out, max_steps=2, dp_seed=dp_seed)
    trainer.train()
    trainer.save_model()
    state = json.loads((out / "dp_state.json").read_text())
    old_dir = tmp_path / "old"
    old_dir.mkdir()
    (old_dir / "dp_state.json").write_text(json.dumps({k: state[k] for k in OLD_DP_STATE_KEYS}))
    card = card_from_dp_state(old_dir, output_dir=old_dir)
    validate_card(old_dir / "README.md")
    dp = privacy_report(old_dir)
    assert dp["epsilon"] == privacy_report(out)["epsilon"] and dp["steps"] == 2
    assert dp["dp_seed"] == privacy_report(out)["dp_seed"]  # fixed -> fixed, secret -> secret
    assert dp["trained_parameters"]["method"] == "unknown" and "unknown" in dp["optimizer"]
    assert "not recorded" in card.text
    assert resolve_privacy(str(old_dir / "dp_state.json"))["epsilon"] == dp["epsilon"]  # synthetic data's card too
    del state["dp_guarantee"]  # older still: nothing says whether the seed was fixed
    (old_dir / "dp_state.json").write_text(json.dumps({k: state[k] for k in OLD_DP_STATE_KEYS if k in state}))
    assert "unknown" in card_from_dp_state(old_dir).data.to_dict()["differential_privacy"]["dp_seed"]


# ------------------------------------------------------------------------------------------------ one-way imports
def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in the file (function-local and ``if TYPE_CHECKING:`` imports too),
    as absolute names; ``from pkg import name`` also counts ``pkg.name`` (a submodule or a re-export)."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.add(module)
            out.update(f"{module}.{a.name}" for a in node.names)
    return out


@pytest.mark.parametrize("module", ["hf_dp/cards.py", "hf_dp/record.py", "hf_dp/synthetic.py",
                                    "hf_dp/audit/__init__.py", "hf_dp/audit/callbacks.py", "hf_dp/audit/canaries.py",
                                    "hf_dp/audit/membership.py"])
def test_readers_of_the_record_never_import_the_trainer(module):
    trainer_names = {"hf_dp.trainer", "hf_dp.trainer.DPTrainer", "hf_dp.DPTrainer", "hf_dp.sft", "hf_dp.DPSFTTrainer"}
    seen, todo = set(), [REPO / module]
    while todo:  # the module and every hf_dp module it imports, transitively
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        imported = _imported_modules(path)
        assert not imported & trainer_names, f"{path.relative_to(REPO)} imports {sorted(imported & trainer_names)}"
        for name in imported:
            if name.startswith("hf_dp."):
                stem = REPO / name.replace(".", "/")
                for candidate in (stem.with_suffix(".py"), stem / "__init__.py"):
                    if candidate.is_file():
                        todo.append(candidate)
    assert REPO / "hf_dp" / "trainer.py" not in seen


# -------------------------------------------------------------------------- cards read a run through its record
def test_cards_given_a_trainer_read_its_record_and_card_inputs(tmp_path):
    from hf_dp import cards

    trainer = make_trainer(tmp_path / "run", max_steps=2)
    trainer.train()
    record = trainer.privacy_record()
    assert cards.privacy_metadata(trainer) == cards.privacy_metadata(record)
    via_trainer = cards.create_model_card(trainer, tmp_path / "a", model_name="m")
    via_method = trainer.create_model_card(output_dir=str(tmp_path / "b"), model_name="m")
    assert via_trainer.data.to_dict() == via_method.data.to_dict()
    assert str(via_trainer) == str(via_method)  # hyperparameters and tags came from card_inputs()
    assert "## Training hyperparameters" in str(via_trainer)
    with pytest.raises(TypeError, match="PrivacyRecord"):
        cards.privacy_metadata(object())
