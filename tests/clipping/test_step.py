"""The DP step as a strategy (``hf_dp/clipping/step.py``): chosen once per model, fed plain pieces, never the trainer,
and reaching the trainer's hooks so that subclass and instance overrides take effect."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from helpers import lm_dataset, tiny_gpt2
from transformers import TrainerCallback

from hf_dp import DPTrainer, DPTrainingArguments
from hf_dp.clipping.fsdp import FSDPClippingEngine, FSDPFlatClipping
from hf_dp.clipping.local import LocalDPStep
from hf_dp.clipping.step import DPStep


def make_args(tmp_path, **kw) -> DPTrainingArguments:
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                learning_rate=1e-3, use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
                dp_seed=0, per_sample_max_grad_norm=1.0, noise_multiplier=1.0, max_steps=2, dp_self_check=False)
    base.update(kw)
    return DPTrainingArguments(**base)


@pytest.fixture
def step_calls(monkeypatch):
    """Every ``LocalDPStep.training_step`` call, as the step object it ran on."""
    calls: list[DPStep] = []
    original = LocalDPStep.training_step

    def spy(self, model, inputs):
        calls.append(self)
        return original(self, model, inputs)

    monkeypatch.setattr(LocalDPStep, "training_step", spy)
    return calls


def _train(trainer: DPTrainer) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()


def test_local_step_is_chosen_once_and_runs_every_chunk(tmp_path, step_calls):
    torch.manual_seed(0)
    trainer = DPTrainer(model=tiny_gpt2(), args=make_args(tmp_path), train_dataset=lm_dataset(32))
    step = trainer._dp_step
    assert type(step) is LocalDPStep and trainer._fsdp is None
    assert step.engine is trainer.clipping_engine and step.pieces.group_clipper is trainer.group_clipper
    _train(trainer)
    assert trainer.accountant.steps == 2
    assert len(step_calls) == 4 and all(s is step for s in step_calls)  # 2 steps × 2 chunks, one strategy
    assert trainer._dp_step is step


def test_fsdp_step_is_chosen_when_fsdp_is_enabled(tmp_path):
    """Under FSDP2 (not available on CPU in-process: the flag is set by hand, the step is only built) the two-pass
    strategy and its engine are chosen; switching back rebuilds the book-keeping step."""
    trainer = DPTrainer(model=tiny_gpt2(), args=make_args(tmp_path), train_dataset=lm_dataset(32))
    trainer.is_fsdp_enabled = True
    trainer._build_clipping()
    step = trainer._dp_step
    assert type(step) is FSDPFlatClipping and trainer._fsdp is step
    assert isinstance(step.engine, FSDPClippingEngine) and trainer.clipping_engine is step.engine
    trainer.is_fsdp_enabled = False
    trainer._build_clipping()
    assert type(trainer._dp_step) is LocalDPStep and trainer._fsdp is None


def test_step_pieces_hold_no_trainer(tmp_path):
    trainer = DPTrainer(model=tiny_gpt2(), args=make_args(tmp_path), train_dataset=lm_dataset(32))
    step = trainer._dp_step
    assert not any(v is trainer for v in vars(step).values())
    for field in dataclasses.fields(step.pieces):
        value = getattr(step.pieces, field.name)
        assert value is not trainer and getattr(value, "__self__", None) is not trainer, field.name


def test_step_is_chosen_again_when_model_init_builds_a_new_model(tmp_path, step_calls):
    def model_init():
        torch.manual_seed(0)
        return tiny_gpt2()

    class AtTrainBegin(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            at_begin.append(trainer._dp_step)

    at_begin: list[DPStep] = []
    trainer = DPTrainer(model_init=model_init, args=make_args(tmp_path), train_dataset=lm_dataset(32),
                        callbacks=[AtTrainBegin()])
    first = trainer._dp_step
    _train(trainer)
    step = trainer._dp_step
    assert step is not first and type(step) is LocalDPStep
    assert at_begin == [step]  # chosen when model_init built the model, not later by the trainable-set check
    clipped = {id(p) for p in step.engine.params.values()}
    assert clipped == {id(p) for p in trainer.model.parameters() if p.requires_grad}  # the new model's
    assert step_calls and all(s is step for s in step_calls)


def test_step_calls_the_trainers_hooks_as_overridden(tmp_path):
    """The strategy reaches the trainer's hooks when it calls them: a subclass override (DPSFTTrainer's
    ``_segment_ids``) and an instance attribute set after construction (benchmarks/run.py's ``_self_check``)."""
    seen: list[str] = []

    class Hooked(DPTrainer):
        def _segment_ids(self, inputs):
            seen.append("segment_ids")
            return super()._segment_ids(inputs)

    trainer = Hooked(model=tiny_gpt2(), args=make_args(tmp_path, max_steps=1), train_dataset=lm_dataset(32))

    def skip_self_check(net, micro, labels):
        seen.append("self_check")
        trainer._self_checked = True

    trainer._self_check = skip_self_check
    _train(trainer)
    assert seen.count("self_check") == 1 and "segment_ids" in seen
    assert trainer._self_checked and trainer._dp_step.self_checked
