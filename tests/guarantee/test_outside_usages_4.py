"""Ordinary Trainer usages from a fourth outside probe (session 12), each closed by the invariant it violated.

* The release is what trains (DESIGN invariant 14): a hook on a trainable parameter's gradient
  (``p.register_hook`` — a masked or scaled gradient, a recorded norm —, ``register_post_accumulate_grad_hook``; PEFT's
  OSF and CPT adapters install such hooks themselves) acts on the batch's gradient and cannot act per example. The
  one-pass step silently skipped it (OSF trained without its orthogonal projection); the two-pass step (gradient
  checkpointing) ran it on the clipped sum before the noise: ``g * 100`` moved the neighbouring datasets' update by
  100 × C. Refused at train start and before every optimizer step.
* Every batch is the mechanism's Poisson draw (invariant 4): ``train_sampling_strategy`` ('sequential',
  'group_by_length') was silently ignored by the DP loader; refused at construction, as a subclass's sampler is.
* NEFTune's refusal names its true cause (noise scaled by the padded batch's length) and the fix.
* The unit the user thinks they have (invariant 13): rows that repeat other rows exactly (oversampling) make one
  example m rows, protected only as a group of m; it ran silently (1.7 × C for an example held in two rows). Said once
  and recorded in ``privacy_unit_detail``.
* The accountant sees exactly the steps that ran, at their mechanism (invariant 6): ``noise_multiplier`` changed by a
  callback (a noise schedule) was silently ignored until the next ``train()``; it is now the σ released and recorded
  from that step on. ``target_epsilon`` lowered by a callback was ignored (the old budget spent, the record reporting
  the new target); the steps allowed are now counted again before the next release.

What the probe found holding is listed in the README ("Checked at run time / refused") and in the session's report.
"""

from __future__ import annotations

import pytest
import torch
from helpers.neighbours import C, bert, bert_data, distance, neighbour_args, params, summed_updates

from hf_dp import DPTrainer


# ---------------------------------------------------------------------- a hook on a parameter's gradient
def scaled_gradients(model, factor=100.0):
    """The user's own gradient hook on every trainable parameter (here a scale, as a per-layer gradient multiplier or
    an embedding-row mask would be)."""
    for p in model.parameters():
        if p.requires_grad:
            p.register_hook(lambda g: g * factor)
    return model


@pytest.mark.parametrize("checkpointing", [True, False], ids=["two_pass", "one_pass"])
def test_gradient_hook_on_a_trainable_parameter_is_refused_at_train_start(tmp_path, checkpointing):
    """Unchecked, with gradient checkpointing (the two-pass step: a plain backward of Σ c_i L_i) the hook scaled the
    clipped sum before the noise: ‖Σ_D − Σ_D′‖ = 100 × C at σ = 0, q = 1; without it the hook was silently skipped
    (the user's gradient transformation never applied). Refused before any step, naming the parameters."""
    args = neighbour_args(tmp_path, 4, gradient_checkpointing=checkpointing)
    trainer = DPTrainer(model=scaled_gradients(bert()), args=args, train_dataset=bert_data(4))
    before = params(trainer.model)
    with pytest.raises(ValueError, match=r"these trainable parameters carry a hook on their gradient \(at train "
                                         r"start\): bert\.embeddings\.word_embeddings\.weight.*Remove the hooks"):
        trainer.train()
    assert trainer.accountant.steps == 0
    assert all(torch.equal(p, before[k]) for k, p in params(trainer.model).items())


def test_gradient_hook_added_during_training_is_refused_before_the_optimizer_step(tmp_path):
    """A callback that hooks a gradient after step 1 (a post-accumulate hook, as optimizer-in-backward recipes use):
    refused at step 2's start (review, session 12: it was refused before step 2's optimizer step, after step 2's
    backward had run the hook; with the two-pass step it saw the un-noised clipped sum), nothing of it computed;
    step 1 was released as usual."""
    from transformers import TrainerCallback

    class HookAfterFirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            model.classifier.weight.register_post_accumulate_grad_hook(lambda p: None)

    args = neighbour_args(tmp_path, 4, max_steps=2)
    trainer = DPTrainer(model=bert(), args=args, train_dataset=bert_data(4), callbacks=[HookAfterFirstStep()])
    with pytest.raises(ValueError, match=r"carry a hook on their gradient \(at this step's start; nothing of it "
                                         r"computed\): classifier\.weight"):
        trainer.train()
    assert trainer.state.global_step == 1


def test_gradient_hook_added_by_a_callback_added_after_construction_never_sees_the_unnoised_sum(tmp_path):
    """Review (session 12): a callback added with ``trainer.add_callback`` after construction runs its
    ``on_train_begin`` after DPTrainer's train-start check (a tracker's ``wandb.watch`` is set up there). Its hook
    passed the train-start check, and with the two-pass step (gradient checkpointing) step 1's backward ran it on the
    clipped sum before the noise (here it kept that un-noised gradient; a tracker would log it), before the refusal
    at the optimizer step. Refused at the step's start: the hook never runs."""
    from transformers import TrainerCallback

    seen = []

    class WatchGradients(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            model.classifier.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))

    args = neighbour_args(tmp_path, 4, gradient_checkpointing=True)
    trainer = DPTrainer(model=bert(), args=args, train_dataset=bert_data(4))
    trainer.add_callback(WatchGradients())
    with pytest.raises(ValueError, match=r"carry a hook on their gradient \(at this step's start; nothing of it "
                                         r"computed\): classifier\.weight"):
        trainer.train()
    assert seen == [] and trainer.accountant.steps == 0


def test_gradient_hook_added_inside_a_step_is_refused_before_the_optimizer_step(tmp_path):
    """A hook added between a step's accumulation chunks (after the step-start check): refused before the optimizer
    step, nothing of it applied."""
    from transformers import TrainerCallback

    class HookBetweenChunks(TrainerCallback):
        def on_substep_end(self, args, state, control, model=None, **kwargs):
            if not model.classifier.weight._post_accumulate_grad_hooks:
                model.classifier.weight.register_post_accumulate_grad_hook(lambda p: None)

    args = neighbour_args(tmp_path, 4, ga=2)
    trainer = DPTrainer(model=bert(), args=args, train_dataset=bert_data(4), callbacks=[HookBetweenChunks()])
    before = params(trainer.model)
    with pytest.raises(ValueError, match=r"carry a hook on their gradient \(before this optimizer step; nothing of "
                                         r"it applied\): classifier\.weight"):
        trainer.train()
    assert all(torch.equal(p, before[k]) for k, p in params(trainer.model).items())


def test_peft_adapter_that_projects_its_gradients_by_hooks_is_refused(tmp_path):
    """PEFT's OSF keeps its update orthogonal to the pretrained subspace by hooks on U_low / V_low's gradients.
    Unchecked, the hooks never ran under DP: OSF trained without its projection, silently."""
    from peft import OSFConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(bert().float(), OSFConfig(target_modules=["query"]))
    trainer = DPTrainer(model=model, args=neighbour_args(tmp_path, 4), train_dataset=bert_data(4))
    with pytest.raises(ValueError, match=r"carry a hook on their gradient \(at train start\): .*osf_svd_params"):
        trainer.train()
    assert trainer.accountant.steps == 0


def test_a_hook_removed_before_train_trains_within_the_bound(tmp_path):
    """The way out the refusal names: the hook removed (handle.remove()) — the run trains, within C."""

    def build(args, data):
        model = bert()
        handles = [p.register_hook(lambda g: g * 100.0) for p in model.parameters() if p.requires_grad]
        for handle in handles:
            handle.remove()
        return DPTrainer(model=model, args=args, train_dataset=data)

    sigma_d, sigma_d2 = summed_updates(tmp_path, build=build, gradient_checkpointing=True)
    assert 0 < distance(sigma_d, sigma_d2) <= C * (1 + 1e-6)


# ---------------------------------------------------------------------- settings the DP loader cannot honour
@pytest.mark.parametrize("strategy", ["sequential", "group_by_length"])
def test_train_sampling_strategy_the_dp_loader_would_ignore_is_refused(tmp_path, strategy):
    """Unchecked, the run drew uniform Poisson batches and the user believed the rows came in order (a curriculum)
    or grouped by length."""
    with pytest.raises(ValueError, match=rf"train_sampling_strategy='{strategy}' .*Poisson sampling.*silently "
                                         r"ignored.*Leave train_sampling_strategy='random'"):
        DPTrainer(model=bert(), args=neighbour_args(tmp_path, 4, train_sampling_strategy=strategy),
                  train_dataset=bert_data(4))


def test_neftune_refusal_names_its_cause_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"NEFTune \(neftune_noise_alpha\) .*padded batch's length.*Set "
                                         r"neftune_noise_alpha=None"):
        DPTrainer(model=bert(), args=neighbour_args(tmp_path, 4, neftune_noise_alpha=5.0), train_dataset=bert_data(4))


# ---------------------------------------------------------------------- rows that repeat other rows
def test_oversampled_rows_are_said_once_and_recorded_as_the_unit(tmp_path):
    """A minority example oversampled by concatenation is two rows: each step can sample both copies, so removing
    that example moved the summed update (σ = 0, q = 1) by 1.7 × C; ε protects a row, the example only as a group of
    2. It ran silently, the card saying the unit was one row; now warned once at construction and recorded in
    privacy_unit_detail (dp_state.json, the card)."""
    import warnings

    from datasets import concatenate_datasets
    from helpers import cls_dataset

    data = cls_dataset(16, 3)
    oversampled = concatenate_datasets([data, data.select([3, 5, 5])])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = DPTrainer(model=bert(), args=neighbour_args(tmp_path, 4), train_dataset=oversampled)
    said = [str(w.message) for w in caught if "repeat another row exactly" in str(w.message)]
    assert len(said) == 1 and "3 row(s)" in said[0] and "row 16 equals row 3; up to 3 copies" in said[0]
    assert "group of 3" in said[0] and "privacy_unit='user'" in said[0]
    assert "3 row(s) of the training set repeat another row exactly" in trainer.privacy_record().privacy_unit_detail
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distinct = DPTrainer(model=bert(), args=neighbour_args(tmp_path / "d", 4), train_dataset=data)
    assert not [w for w in caught if "repeat another row" in str(w.message)]
    assert distinct.privacy_record().privacy_unit_detail is None


def test_repeated_rows_are_found_however_the_set_was_built():
    """``interleave_datasets(stopping_strategy="all_exhausted")`` repeats the smaller set's rows; a torch
    ``ConcatDataset``; a random ``set_transform`` (the stored rows are compared, not one random read of each)."""
    from datasets import concatenate_datasets, interleave_datasets
    from helpers import cls_dataset
    from torch.utils.data import ConcatDataset

    from hf_dp.units import repeated_rows

    data = cls_dataset(16, 3)
    assert repeated_rows(data) is None
    assert repeated_rows(interleave_datasets([data.select(range(12)), data.select(range(12, 16))],
                                             stopping_strategy="all_exhausted")) == (8, 3, (1, 9))
    assert repeated_rows(ConcatDataset([data, data.select([3])])) == (1, 2, (3, 16))
    noisy = concatenate_datasets([data, data.select([7])]).with_transform(
        lambda batch: {**batch, "input_ids": [[t + int(torch.randint(0, 5, ())) for t in row]
                                              for row in batch["input_ids"]]})
    assert repeated_rows(noisy) == (1, 2, (7, 16))


# ---------------------------------------------------------------------- a noise schedule in a callback
def test_noise_multiplier_changed_by_a_callback_is_the_noise_released_and_recorded(tmp_path):
    """A callback lowers and raises σ between steps (a noise schedule): it was silently ignored until the next
    train() (the steps noised at the σ of train start). Each step is now noised at the σ asked when it is released,
    and the accountant records exactly that: step 1 at σ = 0 (its update is the clipped sum, ‖Σ‖ ≤ C · m), step 2 at
    σ = 1e4 (its update is noise, far above C)."""
    from transformers import TrainerCallback

    class RaiseNoise(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            args.noise_multiplier = 1e4

    steps = []

    class Params(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            steps.append(params(model))

    args = neighbour_args(tmp_path, 4, max_steps=2)
    trainer = DPTrainer(model=bert(), args=args, train_dataset=bert_data(4), callbacks=[RaiseNoise(), Params()])
    before = params(trainer.model)
    trainer.train()
    step1 = distance(before, steps[0]) * 4  # Σ = (θ₀ − θ₁) · m
    step2 = distance(steps[0], steps[1]) * 4
    assert step1 <= 4 * C * (1 + 1e-6) and step2 > 1e3 * C
    assert [(m.noise_multiplier, m.steps) for m in trainer.accountant.history] == [(0.0, 1), (1e4, 1)]


# ---------------------------------------------------------------------- every other argument of the mechanism
@pytest.mark.parametrize("field, before, after", [
    ("poisson_sampling", False, True),  # shuffled batches recorded as Poisson sampling (its caveat dropped)
    ("dp_seed", 0, None),  # draws from a fixed seed recorded as a secret one (its note dropped)
    ("secure_mode", False, True),  # the ordinary generator recorded as secure
    ("accountant", "rdp", "prv"),  # ε of one accountant recorded under the other's name
], ids=["poisson_sampling", "dp_seed", "secure_mode", "accountant"])
def test_argument_the_mechanism_was_set_up_from_changed_by_a_callback_is_refused(tmp_path, field, before, after):
    """Review (session 12): the accountant, the sampler and its seed, the noise source, the clipping mode, the noise
    allocation and the privacy unit are set up when train() begins; a callback changing their argument was silently
    ignored by the steps while the record and the card read the new value (e.g. shuffled batches recorded as Poisson
    sampling). Refused before anything more is released, naming the field (``Mechanism.check_fixed_arguments``)."""
    from helpers import cls_dataset, quick_dp_args
    from transformers import TrainerCallback

    class Change(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            setattr(args, field, after)

    args = quick_dp_args(tmp_path, max_steps=3, logging_strategy="no", **{"accountant": "rdp", "dp_seed": 0,
                                                                       field: before})
    trainer = DPTrainer(model=bert(), args=args, train_dataset=cls_dataset(16, 3), callbacks=[Change()])
    with pytest.raises(RuntimeError, match=rf"arguments changed during train\(\): {field} from {before!r} to "
                                           rf"{after!r}\..*Nothing of this step was released"):
        trainer.train()
    assert trainer.accountant.steps == 1
    # the record describes the step that ran, not the changed argument (it read the arguments live)
    record = trainer.privacy_record()
    described = {"poisson_sampling": record.poisson_sampling, "dp_seed": record.dp_seed,
                 "secure_mode": record.secure_mode, "accountant": record.accountant_name}
    assert described[field] == {"poisson_sampling": False, "dp_seed": "fixed", "secure_mode": False,
                                "accountant": "rdp"}[field]


def test_arguments_changed_between_runs_are_described_for_the_whole_history(tmp_path):
    """Between two ``train()`` calls on one trainer: a fixed ``dp_seed`` in the first run and none in the second was
    recorded as a secret seed (the first run's noise is predictable: the note must stay); ``accountant`` changed from
    rdp to prv was recorded as prv while ε kept coming from rdp. The record and the notes describe every run: the
    fixed seed stays said; the named accountant is the one that computes ε of the whole history."""
    import warnings

    from helpers import cls_dataset, quick_dp_args

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = quick_dp_args(tmp_path, max_steps=1, logging_strategy="no", accountant="rdp", dp_seed=0)
    trainer = DPTrainer(model=bert(), args=args, train_dataset=cls_dataset(16, 3))
    trainer.train()
    args.dp_seed, args.accountant, args.max_steps = None, "prv", 2
    trainer.train()
    record = trainer.privacy_record()
    assert record.dp_seed == "fixed" and "fixed dp_seed" in trainer.dp_guarantee
    assert record.accountant_name == trainer.accountant.accountant == "prv" and trainer.accountant.steps == 3
    trainer.accountant.get_epsilon(record.delta)
    assert trainer.accountant.accountant_used.startswith(("prv", "pld"))


def lower_target(args, trainer):
    args.target_epsilon = 1.5


def lower_delta(args, trainer):
    args.target_delta = 1e-5


def lower_sigma(args, trainer):
    args.noise_multiplier = 0.55


def set_lower_sigma(args, trainer):
    trainer.noise_multiplier = 0.55


@pytest.mark.parametrize("change, target, delta, sigmas", [
    # target_epsilon 3 → 1.5: the run spent the old budget (20 steps, ε = 2.97) while the record said target 1.5
    (lower_target, 1.5, None, None),
    # δ 1e-3 → 1e-5 (ε is reported at δ): all 20 steps, ε = 4.6 at δ = 1e-5 against target 3 (review)
    (lower_delta, 3.0, 1e-5, None),
    # args.noise_multiplier → 0.55 under the target: noised at it, but the allowance stayed (ε = 21 at 0.3; lead)
    (lower_sigma, 3.0, None, [0.55]),
    # trainer.noise_multiplier (the mechanism's σ, settable) → 0.55: the same (ε = 29 at 0.3; review)
    (set_lower_sigma, 3.0, None, [0.55]),
], ids=["target_epsilon", "target_delta", "args_noise_multiplier", "trainer_noise_multiplier"])
def test_budget_changed_by_a_callback_during_train_is_the_budget_the_run_stops_at(tmp_path, change, target, delta,
                                                                                  sigmas):
    """Session 12 (redteam4, its review): a callback changing the budget (``target_epsilon``, ``target_delta``) or
    the noise (σ, in the arguments or on the trainer) after step 1 of a run with ``target_epsilon`` = 3: the steps
    still allowed were those counted at train start, so the run went on to ε above the target the record reported.
    They are now counted again at the new values before each release; the run stops within the target."""
    import warnings

    from helpers import cls_dataset, quick_dp_args
    from transformers import TrainerCallback

    class Change(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                change(args, trainer)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = quick_dp_args(tmp_path, max_steps=20, logging_strategy="no", noise_multiplier=None, target_epsilon=3.0,
                             target_delta=None if delta is None else 1e-3, accountant="rdp")
    trainer = DPTrainer(model=bert(), args=args, train_dataset=cls_dataset(40, 3), callbacks=[Change()])
    trainer.train()
    record = trainer.privacy_record()
    assert record.target_epsilon == target and record.delta == (delta or record.delta) and record.epsilon() <= target
    assert 1 < trainer.accountant.steps < 20 and trainer.budget_exhausted
    if sigmas is not None:
        assert [m.noise_multiplier for m in trainer.accountant.history][1:] == sigmas
