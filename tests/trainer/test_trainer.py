"""DPTrainer behaviour: ε logging, checkpoint/resume, budget stops, argument validation, loud failures."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from datasets import Dataset
from helpers import lm_dataset, tiny_bert, tiny_gpt2
from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

from hf_dp import DPTrainer, DPTrainingArguments, NotPrivateWarning, UnsupportedLayerError
from hf_dp.trainer import DP_STATE_NAME


def make_args(tmp_path, **kw) -> DPTrainingArguments:
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                learning_rate=1e-3, use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
                logging_steps=1, dp_seed=0, per_sample_max_grad_norm=1.0)
    base.update(kw)
    return DPTrainingArguments(**base)


def prv_epsilon(sigma: float, q: float, steps: int, delta: float, planned: int | None = None) -> float:
    """Independent ε: prv-accountant used directly (upper bound, as hf_dp reports), with its domain sized for
    ``planned`` steps (the whole run) or for ``steps``."""
    acc = PRVAccountant(prvs=[PoissonSubsampledGaussianMechanism(sampling_probability=q, noise_multiplier=sigma)],
                        max_self_compositions=[planned or steps], eps_error=0.01, delta_error=delta / 1000)
    return acc.compute_epsilon(delta=delta, num_self_compositions=[steps])[2]


def test_epsilon_is_logged_and_matches_prv_accountant(tmp_path):
    torch.manual_seed(0)
    data = lm_dataset(64)
    trainer = DPTrainer(model=tiny_gpt2(), args=make_args(tmp_path, noise_multiplier=1.1, max_steps=4),
                        train_dataset=data)
    trainer.train()
    # the step logs (an empty step logs no loss: select them by their learning rate)
    logged = [(h["step"], h["epsilon"]) for h in trainer.state.log_history if "learning_rate" in h]
    assert [s for s, _ in logged] == [1, 2, 3, 4]
    eps = [e for _, e in logged]
    assert eps == sorted(eps) and eps[0] > 0
    q, delta = 8 / 64, 1 / 64**1.1
    assert trainer.sample_rate == q and trainer.target_delta == pytest.approx(delta)
    for step, e in logged:
        assert e == pytest.approx(prv_epsilon(1.1, q, step, delta, planned=4), abs=2e-4)
        assert e == pytest.approx(prv_epsilon(1.1, q, step, delta), abs=0.02)  # same bound up to eps_error
    spent = trainer.privacy_spent()
    assert spent["steps"] == 4 and spent["epsilon"] == pytest.approx(prv_epsilon(1.1, q, 4, delta), rel=1e-6)


def test_target_epsilon_calibrates_sigma_for_the_planned_steps(tmp_path):
    torch.manual_seed(0)
    data = lm_dataset(64)
    args = make_args(tmp_path, target_epsilon=4.0, num_train_epochs=2)  # 8 steps per epoch at q = 1/8
    trainer = DPTrainer(model=tiny_gpt2(), args=args, train_dataset=data)
    trainer.train()
    assert trainer.state.global_step == trainer.accountant.steps == 16
    sigma = trainer.noise_multiplier
    delta = trainer.target_delta
    eps = prv_epsilon(sigma, 1 / 8, 16, delta)
    assert 4.0 * 0.97 <= eps <= 4.0  # spends the budget, never more
    assert not trainer.budget_exhausted


def test_resume_continues_epsilon_exactly(tmp_path):
    torch.manual_seed(0)
    data = lm_dataset(64)
    full = DPTrainer(model=tiny_gpt2(), args=make_args(tmp_path / "full", noise_multiplier=1.0, max_steps=6),
                     train_dataset=data)
    full.train()

    torch.manual_seed(0)
    first = DPTrainer(model=tiny_gpt2(), args=make_args(tmp_path / "run", noise_multiplier=1.0, max_steps=6,
                                                        save_strategy="steps", save_steps=3),
                      train_dataset=data)
    first.train()
    ckpt = tmp_path / "run" / "checkpoint-3"
    state = json.loads((ckpt / DP_STATE_NAME).read_text())
    assert sum(r["steps"] for r in state["accountant"]["history"]) == 3

    torch.manual_seed(1)
    resumed = DPTrainer(model=tiny_gpt2(), args=make_args(tmp_path / "run", noise_multiplier=1.0, max_steps=6),
                        train_dataset=data)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.accountant.steps == 6 == resumed.state.global_step
    delta = full.target_delta
    assert resumed.accountant.get_epsilon(delta) == pytest.approx(full.accountant.get_epsilon(delta), rel=1e-9)
    # With a fixed dp_seed the resumed run reproduces the uninterrupted one (same batches, same noise).
    for (n, a), b in zip(full.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b, msg=n)


def test_resume_from_checkpoint_without_privacy_state_is_refused(tmp_path):
    torch.manual_seed(0)
    data = lm_dataset(32)
    t = DPTrainer(model=tiny_gpt2(), args=make_args(tmp_path, noise_multiplier=1.0, max_steps=2,
                                                   save_strategy="steps", save_steps=2), train_dataset=data)
    t.train()
    os.remove(tmp_path / "checkpoint-2" / DP_STATE_NAME)
    t2 = DPTrainer(model=tiny_gpt2(), args=make_args(tmp_path, noise_multiplier=1.0, max_steps=4), train_dataset=data)
    with pytest.raises(ValueError, match="under-count"):
        t2.train(resume_from_checkpoint=True)


def test_budget_exhaustion_stops_and_saves(tmp_path):
    torch.manual_seed(0)
    data = lm_dataset(64)
    # Calibrated for 4 steps; checkpoint after 2.
    t = DPTrainer(model=tiny_gpt2(), args=make_args(tmp_path, target_epsilon=3.0, max_steps=4,
                                                   save_strategy="steps", save_steps=2), train_dataset=data)
    t.train()
    sigma = t.noise_multiplier
    # Resume from step 2 asking for 10 steps: σ is kept, so only ~2 more steps fit in ε = 3.
    r = DPTrainer(model=tiny_gpt2(), args=make_args(tmp_path, target_epsilon=3.0, max_steps=10,
                                                   save_strategy="no"), train_dataset=data)
    r.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert r.noise_multiplier == sigma
    assert r.budget_exhausted
    assert r.accountant.steps == r.state.global_step < 10
    assert r.accountant.get_epsilon(r.target_delta) <= 3.0
    extra = r.accountant.copy()
    extra.step(sigma, r.sample_rate)
    assert extra.get_epsilon(r.target_delta) > 3.0  # it stopped exactly at the budget
    saved = tmp_path / f"checkpoint-{r.state.global_step}"
    assert (saved / DP_STATE_NAME).is_file()
    # Resuming once more does not train at all.
    again = DPTrainer(model=tiny_gpt2(), args=make_args(tmp_path, target_epsilon=3.0, max_steps=10),
                      train_dataset=data)
    before = [p.detach().clone() for p in again.model.parameters()]
    again.train(resume_from_checkpoint=str(saved))
    assert again.budget_exhausted and again.accountant.steps == r.accountant.steps
    again_params = list(again.model.parameters())
    assert len(before) == len(again_params)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(target_epsilon=1.0, noise_multiplier=1.0), "exactly one"),
        (dict(), "exactly one"),
        (dict(target_epsilon=0.0), "target_epsilon must be > 0"),
        (dict(target_epsilon=-1.0), "target_epsilon must be > 0"),
        (dict(noise_multiplier=-0.5), "noise_multiplier must be >= 0"),
        (dict(target_epsilon=1.0, target_delta=1.0), "target_delta"),
        (dict(target_epsilon=1.0, target_delta=0.0), "target_delta"),
        (dict(target_epsilon=1.0, per_sample_max_grad_norm=-1.0), "per_sample_max_grad_norm"),
        (dict(target_epsilon=1.0, per_sample_max_grad_norm=0.0), "per_sample_max_grad_norm"),
        (dict(target_epsilon=1.0, accountant="gdp"), "accountant"),
        (dict(target_epsilon=1.0, clipping="automatic"), "clipping"),
        (dict(target_epsilon=1.0, max_grad_norm=-1.0), "max_grad_norm"),
        (dict(target_epsilon=1.0, label_smoothing_factor=0.1, lm_loss_chunk_size=4), "label_smoothing"),
    ],
)
def test_bad_arguments_are_refused(tmp_path, kwargs, message):
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match=message):
        DPTrainingArguments(**base, **kwargs)


def test_loud_warnings(tmp_path):
    with pytest.warns(NotPrivateWarning, match="NOT differentially private"):
        DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=0.0, use_cpu=True)
    with pytest.warns(NotPrivateWarning, match="heuristic"):
        DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=1.0, poisson_sampling=False, use_cpu=True)
    with pytest.raises(ValueError, match="not below 1/N"):  # refused since issue 12 (tests/guarantee/test_guarantee.py)
        DPTrainer(model=tiny_gpt2(), args=make_args(tmp_path, target_epsilon=1.0, target_delta=0.1),
                  train_dataset=lm_dataset(16))


def test_sample_rate_above_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match="exceeds the training set size"):
        DPTrainer(model=tiny_gpt2(), args=make_args(tmp_path, target_epsilon=1.0, per_device_train_batch_size=16),
                  train_dataset=lm_dataset(8))


def test_unsupported_trainable_parameter_is_named(tmp_path):
    model = tiny_bert()
    model.register_parameter("temperature", torch.nn.Parameter(torch.ones(1)))
    with pytest.raises(UnsupportedLayerError) as err:  # a parameter of the model itself (no generic fallback)
        DPTrainer(model=model, args=make_args(tmp_path, target_epsilon=1.0), train_dataset=lm_dataset(16))
    text = str(err.value)
    assert "temperature" in text and "requires_grad_(False)" in text
    # Freezing it makes the model trainable.
    model.temperature.requires_grad_(False)
    DPTrainer(model=model, args=make_args(tmp_path, target_epsilon=1.0), train_dataset=lm_dataset(16))


def test_non_private_loss_normalisation_is_refused(tmp_path):
    with pytest.raises(ValueError, match="per_example_loss"):
        DPTrainer(model=tiny_gpt2(), args=make_args(tmp_path, target_epsilon=1.0), train_dataset=lm_dataset(16),
                  compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.logits.mean())


def test_processes_launched_but_not_distributed_are_refused(tmp_path, monkeypatch):
    """`torchrun --nproc_per_node 2` on a CPU-only machine without use_cpu: transformers runs each process alone
    (world_size 1); each would train on all the data and be released, spending the budget again."""
    args = make_args(tmp_path, target_epsilon=1.0)
    assert args.world_size == 1
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="independent"):
        DPTrainer(model=tiny_gpt2(), args=args, train_dataset=lm_dataset(16))


def test_plain_training_arguments_are_refused(tmp_path):
    from transformers import TrainingArguments

    with pytest.raises(TypeError, match="DPTrainingArguments"):
        DPTrainer(model=tiny_gpt2(), args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True),
                  train_dataset=lm_dataset(16))


def test_shuffled_batches_are_labelled(tmp_path, caplog):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        args = make_args(tmp_path, noise_multiplier=1.0, max_steps=2, poisson_sampling=False)
    trainer = DPTrainer(model=tiny_gpt2(), args=args, train_dataset=lm_dataset(32))
    with caplog.at_level("WARNING", logger="hf_dp.trainer"):
        trainer.train()
    assert "heuristic" in caplog.text
    assert trainer.privacy_spent()["poisson_sampling"] is False


def test_custom_per_example_loss(tmp_path):
    """A user loss is clipped per example: with σ=0 and C large, the update is its mean gradient."""
    torch.manual_seed(0)
    data = Dataset.from_dict({"input_ids": [[3, 4, 5, 6]] * 4, "labels": [[3, 4, 5, 6]] * 4})

    def first_logit_loss(outputs, labels):
        return outputs.logits[:, 0, 0] ** 2

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        args = make_args(tmp_path, noise_multiplier=0.0, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                         max_steps=1, optim="sgd", learning_rate=1.0, per_sample_max_grad_norm=1e6)
    model = tiny_gpt2().double()
    ref = model.transformer.ln_f.bias.detach().clone()
    out = model(input_ids=torch.tensor([[3, 4, 5, 6]]))
    (out.logits[0, 0, 0] ** 2).backward()
    expected = ref - model.transformer.ln_f.bias.grad
    model.zero_grad(set_to_none=True)
    DPTrainer(model=model, args=args, train_dataset=data, per_example_loss=first_logit_loss).train()
    torch.testing.assert_close(model.transformer.ln_f.bias.detach(), expected)


def test_dp_guarantee_collects_reasons_from_trainer_and_callbacks(tmp_path):
    from transformers import TrainerCallback

    class Regulariser(TrainerCallback):
        def dp_guarantee_notes(self):
            return ["regulariser trained on private data without noise"]

    strict = DPTrainer(model=tiny_gpt2(), args=make_args(tmp_path, target_epsilon=1.0, dp_seed=None),
                       train_dataset=lm_dataset(16))
    assert strict.dp_guarantee == "strict"
    loose = DPTrainer(model=tiny_gpt2(), args=make_args(tmp_path, target_epsilon=1.0), train_dataset=lm_dataset(16),
                      callbacks=[Regulariser()])
    assert loose.dp_guarantee.startswith("not strict: ")
    assert "fixed dp_seed" in loose.dp_guarantee and "regulariser" in loose.dp_guarantee


def test_model_selection_by_private_evaluation_is_warned_and_noted(tmp_path):
    """save_strategy='best' (checkpoints kept only when the evaluation metric improves), EarlyStoppingCallback (the
    number of steps chosen by evaluation metrics) and reduce_lr_on_plateau (the learning rate chosen by them) use the
    evaluation data to shape the released model, like load_best_model_at_end: warned, and dp_guarantee (hence the
    card) says so (DESIGN invariant 7)."""
    from transformers import EarlyStoppingCallback

    evaluation = dict(eval_strategy="steps", eval_steps=1, metric_for_best_model="eval_loss", target_epsilon=1.0,
                      dp_seed=None)
    with pytest.warns(NotPrivateWarning, match="save_strategy='best' selects a checkpoint"):
        args = make_args(tmp_path, save_strategy="best", **evaluation)
    trainer = DPTrainer(model=tiny_gpt2(), args=args, train_dataset=lm_dataset(16), eval_dataset=lm_dataset(4))
    assert "save_strategy='best'" in trainer.dp_guarantee

    args = make_args(tmp_path, max_steps=2, **evaluation)
    trainer = DPTrainer(model=tiny_gpt2(), args=args, train_dataset=lm_dataset(16), eval_dataset=lm_dataset(4),
                        callbacks=[EarlyStoppingCallback(early_stopping_patience=1)])
    assert "EarlyStoppingCallback" in trainer.dp_guarantee
    with pytest.warns(NotPrivateWarning, match="EarlyStoppingCallback stops training"):
        trainer.train()
    assert "EarlyStoppingCallback" in trainer.privacy_record().dp_guarantee

    with pytest.warns(NotPrivateWarning, match="reduce_lr_on_plateau' lowers the learning rate"):
        args = make_args(tmp_path, lr_scheduler_type="reduce_lr_on_plateau", **evaluation)
    trainer = DPTrainer(model=tiny_gpt2(), args=args, train_dataset=lm_dataset(16), eval_dataset=lm_dataset(4))
    assert "reduce_lr_on_plateau" in trainer.dp_guarantee


@pytest.mark.parametrize("count", ["all", "non_padding"])
def test_num_input_tokens_seen_with_empty_poisson_batches(tmp_path, count):
    """include_num_input_tokens_seen: every chunk, empty ones included, takes part in the Trainer's gather of the
    token count (a rank that skipped it would hang the others under DDP), and the count is the sampled tokens'."""
    data = lm_dataset(16)
    args = make_args(tmp_path, noise_multiplier=1.0, per_device_train_batch_size=1, gradient_accumulation_steps=1,
                     max_steps=12, include_num_input_tokens_seen=count, logging_steps=100)
    trainer = DPTrainer(model=tiny_gpt2(), args=args, train_dataset=data)
    gathered, seen = [], []
    plain_gather = trainer.accelerator.gather
    trainer.accelerator.gather = lambda t: gathered.append(int(t)) or plain_gather(t)
    plain_step = trainer.training_step
    trainer.training_step = lambda model, inputs, *a, **k: seen.append(inputs) or plain_step(model, inputs, *a, **k)
    trainer.train()
    assert len(gathered) == len(seen) == 12
    assert any(int(v) == 0 for v in gathered)  # q = 1/16: some chunks were empty
    key = "attention_mask" if count == "non_padding" else "input_ids"
    expected = sum(int(b[key].sum()) if count == "non_padding" else b[key].numel() for b in seen if key in b)
    assert trainer.state.num_input_tokens_seen == expected == sum(gathered)


def test_resume_of_a_spent_budget_leaves_the_checkpoint_model(tmp_path):
    """resume_from_checkpoint=True on a run whose budget is spent trains no step and leaves the trainer with the
    checkpoint's model, the one its accountant describes (as the plain Trainer resuming a finished run does), not the
    fresh model it was built with, which save_model() would otherwise release under a card claiming those steps."""
    def args():
        return make_args(tmp_path, target_epsilon=3.0, max_steps=2, save_strategy="steps", save_steps=1)

    torch.manual_seed(0)
    first = DPTrainer(model=tiny_gpt2(), args=args(), train_dataset=lm_dataset(16))
    first.train()
    trained = {k: v.detach().clone() for k, v in first.model.state_dict().items()}
    torch.manual_seed(1)
    second = DPTrainer(model=tiny_gpt2(), args=args(), train_dataset=lm_dataset(16))
    second.train(resume_from_checkpoint=True)
    assert second.budget_exhausted and second.accountant.steps == 2
    for k, v in second.model.state_dict().items():
        torch.testing.assert_close(v, trained[k], msg=k)
