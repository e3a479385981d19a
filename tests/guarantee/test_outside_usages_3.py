"""Ordinary Trainer usages from a third outside probe (session 11), each closed by the invariant it violated.

* Evaluation data that hf_dp can see is training data (DESIGN invariant 7; ``hf_dp/evaluation.py``):
  ``eval_data_is_public=True`` put un-noised metrics computed on training rows into the card's ``model-index``, under
  a card saying they were computed on public data. Refused at construction, at train start and at every evaluation;
  a choice made on such metrics (best checkpoint, early stopping, ...) is named definitely in ``dp_guarantee``.
* The first-step checks follow the precision the model is seen computing in (invariant 8: a refusal states its true
  cause): a ``torch.autocast`` inside the user's own forward was refused as "a use outside the forward of the module
  that owns them"; it trains, within the bound.
* ``auto_find_batch_size`` (the Trainer begins its training loop again after running out of memory, within one
  ``train()``): the budget's allowance counts from the loop's start (invariant 6), so the run takes the steps
  ``target_epsilon`` allows, no fewer, with q unchanged and smaller micro-batches.
* Every batch is the mechanism's Poisson draw (invariant 4): a subclass's ``_get_train_sampler``, which the DP loader
  never calls, is refused at construction instead of silently ignored.
* The release is what trains (invariant 14): a trainable parameter the optimizer does not hold (an optimizer built
  before ``peft_config`` added the adapter, an adapter switched in by ``set_adapter``) trained nothing while ε was
  reported; refused at train start and before every optimizer step.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from datasets import Dataset
from helpers import cls_dataset
from helpers.neighbours import C, bert, bert_data, distance, neighbour_args, params, summed_updates
from helpers.runs import quick_dp_args

from hf_dp import DPTrainer


# ---------------------------------------------------------------------- evaluation data that is training data
def eval_trainer(out, train, eval_dataset, **kw):
    args = quick_dp_args(out, eval_strategy="steps", eval_steps=1, max_steps=2, logging_strategy="no", **kw)
    return DPTrainer(model=bert(), args=args, train_dataset=train, eval_dataset=eval_dataset)


@pytest.mark.parametrize("evaluation", [lambda d: d, lambda d: d.select(range(2, 10)),
                                        lambda d: Dataset.from_dict(d[4:12]).shuffle(seed=0)],
                         ids=["same_object", "select", "equal_rows"])
def test_evaluation_set_declared_public_but_seen_to_be_training_rows_is_refused(tmp_path, evaluation):
    """Unchecked, each ran and wrote the evaluation loss on training rows into the card's model-index (and the pushed
    trainer_state.json), the card saying the evaluation data was public or held out."""
    train = cls_dataset(16, 3)
    with pytest.raises(ValueError, match=r"eval_data_is_public=True, but eval_dataset (is the training set|holds "
                                         r"training rows \(8 of the 8 evaluation rows).*at construction"):
        eval_trainer(tmp_path, train, evaluation(train), eval_data_is_public=True)


def padded_further(d, length=12):
    return {**d, "input_ids": [r + [0] * (length - len(r)) for r in d["input_ids"]],
            "attention_mask": [r + [0] * (length - len(r)) for r in d["attention_mask"]]}


@pytest.mark.parametrize("copy", [padded_further, lambda d: {**d, "labels": [float(y) for y in d["labels"]]},
                                  lambda d: {**d, "row_id": [f"eval-{i}" for i in range(len(d["labels"]))]}],
                         ids=["padded_to_another_length", "float_labels", "an_id_column_that_differs"])
def test_training_rows_copied_in_another_form_are_still_training_rows(tmp_path, copy):
    """Session 12 (review of the detection): the same training rows re-padded to another length, with float labels,
    or beside an id column that differs from the training set's were "held-out data" to the fingerprint (padding,
    the label's type and a column the model never reads took part in it), and eval_data_is_public=True published
    their metrics. Rows are compared on the columns the model consumes, without padding, numbers as float64."""
    train = cls_dataset(16, 3)
    if "row_id" in copy(train[:1]):
        train = train.add_column("row_id", [f"train-{i}" for i in range(16)])
    with pytest.raises(ValueError, match=r"eval_dataset holds training rows \(8 of the 8 evaluation rows"):
        eval_trainer(tmp_path, train, Dataset.from_dict(copy(train[4:12])), eval_data_is_public=True)


def test_training_rows_given_for_evaluation_later_are_refused_before_anything_is_computed(tmp_path):
    """The evaluation set given after construction: refused at train start (nothing released) and at an evaluation
    (no metric computed). A held-out set that shares one duplicate row with the training set is not training data."""
    train = cls_dataset(16, 3)
    held_out = Dataset.from_dict({k: v[:7] + [train[3][k]] for k, v in cls_dataset(7, 3, seed=5).to_dict().items()})
    trainer = eval_trainer(tmp_path, train, held_out, eval_data_is_public=True)
    trainer.eval_dataset = {"val": held_out, "train": train}
    before = params(trainer.model)
    with pytest.raises(ValueError, match=r"eval_dataset\['train'\] is the training set \(at train start\)"):
        trainer.train()
    assert trainer.accountant.steps == 0 and all(torch.equal(p, before[k]) for k, p in params(trainer.model).items())
    trainer.eval_dataset = held_out
    trainer.train()  # evaluated on the held-out set at each step
    assert "eval_loss" in trainer.evaluate()
    with pytest.raises(ValueError, match=r"eval_dataset holds training rows .* \(at evaluation\)"):
        trainer.evaluate(eval_dataset=train.select(range(8)))


def test_evaluation_set_sharing_only_a_label_column_is_not_taken_for_training_rows(tmp_path):
    """A held-out evaluation set of raw text (tokenized by the collator) shares only ``labels`` with the tokenized
    training set: with 3 classes every evaluation row "equalled" a training row, and eval_data_is_public=True was
    refused saying the evaluation set holds training rows. Columns that do not tell rows apart say nothing."""
    from hf_dp.evaluation import training_rows_in

    train = cls_dataset(16, 3)
    raw = Dataset.from_dict({"text": [f"held-out sentence {i}" for i in range(12)],
                             "labels": [i % 3 for i in range(12)]})
    assert training_rows_in(train, raw) is None
    assert training_rows_in(train, train.select(range(8)).remove_columns(["attention_mask"])) is not None
    eval_trainer(tmp_path, train, raw, eval_data_is_public=True)  # constructs


def test_choice_made_on_metrics_of_training_rows_is_named_in_the_guarantee(tmp_path):
    """Without the declaration, evaluating on training rows is allowed (its metrics stay in the local logs), and a
    checkpoint chosen on them makes dp_guarantee say so, not "if the evaluation data is private"."""
    train = cls_dataset(16, 3)
    plain = eval_trainer(tmp_path / "plain", train, train)
    assert "evaluation on training rows" not in plain.dp_guarantee
    chosen = eval_trainer(tmp_path / "best", train, train.select(range(8)), load_best_model_at_end=True,
                          save_strategy="steps", save_steps=1, metric_for_best_model="eval_loss")
    assert ("evaluation on training rows: eval_dataset holds training rows (8 of the 8 evaluation rows compared are "
            "rows of the training set, e.g. evaluation row 0 equals training row 0), and the checkpoint kept "
            "(load_best_model_at_end) was chosen on its metrics") in chosen.dp_guarantee


# ---------------------------------------------------------------------- the precision the model computes in
def autocast_forward(model):
    """The user's own mixed precision: the forward runs under ``torch.autocast`` (bf16 on the CPU)."""
    forward = model.forward

    @functools.wraps(forward)
    def autocast(*args, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return forward(*args, **kwargs)

    model.forward = autocast
    return model


def test_autocast_inside_the_users_forward_trains_within_the_bound(tmp_path):
    """It was refused at the first step: "The hooks' sum of per-example gradients differs from autograd's gradient
    ... a use outside the forward of the module that owns them" — bf16 rounding, judged at float32's tolerance. The
    checks now take the precision a recorded layer computed in (as with bf16=True): removing one example moves the
    summed update (σ = 0, q = 1) by at most C."""

    def build(args, data):
        return DPTrainer(model=autocast_forward(bert().float()), args=args, train_dataset=data)

    sigma_d, sigma_d2 = summed_updates(tmp_path, build=build, data_fn=bert_data)
    assert 0 < distance(sigma_d, sigma_d2) <= C * (1 + 1e-5)


def test_autocast_keeps_finding_a_use_outside_the_owning_forward(tmp_path, caplog):
    """Under the model's half precision the comparisons' relative tolerance is relaxed, but the floor below which a
    gradient counts as rounding noise stays at the parameters' own precision: at 100 bf16 epsilons (0.78 of the
    largest gradient entry) the hooks-vs-autograd check passed a weight used twice, and the run was refused with an
    untrue cause ("an example's loss depends on the other rows of its batch"). The escaped use is found and handled
    by re-running the enclosing module per example; with a batch mean as well, refused naming the escaped use."""
    from helpers import ReadsChildWeight, Rows, Toy, dp_args, toy_loss

    from hf_dp import UnsupportedLayerError

    g = torch.Generator().manual_seed(0)
    rows = Rows([{"x": torch.randn(4, 3, generator=g), "labels": torch.tensor(i % 2)} for i in range(4)])

    def trainer(mixes, out):
        torch.manual_seed(0)
        model = autocast_forward(Toy(ReadsChildWeight(mixes)).float())
        return DPTrainer(model=model, args=dp_args(out, 4, dp_self_check=False), train_dataset=rows,
                         per_example_loss=toy_loss)

    with caplog.at_level("WARNING", logger="hf_dp.clipping.engine"):
        trainer(False, tmp_path / "escaped").train()
    assert "enclosing module of lin.weight" in caplog.text
    with pytest.raises(UnsupportedLayerError, match="a use outside the forward of the module that owns them"):
        trainer(True, tmp_path / "mixes").train()


# ---------------------------------------------------------------------- auto_find_batch_size
def test_auto_find_batch_size_restart_keeps_q_and_takes_the_steps_the_budget_allows(tmp_path):
    """Out of memory in step 2's forward (after one released step): the Trainer begins its loop again with a smaller
    batch size (and max_steps to go). The released step stays counted, the step that failed is discarded, the sampler
    keeps q = 0.2 (micro-batches become smaller: memory only) and the run takes the steps target_epsilon allows (3 in
    all, ε ≤ 2), then stops for the budget. It stopped after 2, saying that one more step would exceed the budget:
    the allowance, computed again at the new loop's start, was counted from train()'s."""
    model = bert()
    forward, sizes = model.forward, []

    @functools.wraps(forward)
    def running_out_of_memory_once(*args, **kwargs):
        sizes.append(kwargs["input_ids"].shape[0])
        if len(sizes) == 22:  # the first-step checks run 20 forwards, step 1 the 21st: the 22nd is step 2's
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return forward(*args, **kwargs)

    model.forward = running_out_of_memory_once
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = neighbour_args(tmp_path, 8, noise_multiplier=None, target_epsilon=2.0, max_steps=3, accountant="rdp",
                              auto_find_batch_size=True)
    trainer = DPTrainer(model=model, args=args, train_dataset=cls_dataset(40, 3))
    trainer.train()
    (mechanism,) = trainer.accountant.history
    assert (mechanism.sample_rate, mechanism.steps) == (0.2, 3)
    assert trainer.privacy_record().epsilon() <= 2.0 and max(sizes[22:]) < 8


# ---------------------------------------------------------------------- a sampler of the user's own
def test_subclass_sampler_that_the_dp_loader_would_ignore_is_refused(tmp_path):
    """A subclass overriding ``_get_train_sampler`` (the usual way to weight classes or examples): unchecked, the
    run trained on uniform Poisson batches, never calling it, and the user believed the sampling was weighted.
    Refused at construction, naming the class and the way to weight examples (their losses)."""

    class Weighted(DPTrainer):
        def _get_train_sampler(self, train_dataset=None):  # pragma: no cover - never called
            return torch.utils.data.WeightedRandomSampler([1.0] * len(self.train_dataset), len(self.train_dataset))

    with pytest.raises(ValueError, match=r"Weighted overrides _get_train_sampler, but DPTrainer draws every training "
                                         r"batch by Poisson sampling.*silently ignored.*per_example_loss"):
        Weighted(model=bert(), args=neighbour_args(tmp_path, 4), train_dataset=bert_data(4))


# ---------------------------------------------------------------------- the optimizer applies every release
def test_trainable_parameters_the_optimizer_does_not_hold_are_refused(tmp_path):
    """An optimizer built on the base model, passed with ``peft_config`` (DPTrainer adds the adapter after it was
    built): unchecked, three steps ran, nothing moved, and ε = 0.66 was reported for them. Refused at train start,
    before any step, naming the adapter's parameters. An adapter switched in by ``set_adapter`` in a callback (the
    optimizer holds the first adapter's): refused before the optimizer step, nothing of that step applied."""
    from helpers import lm_dataset, tiny_llama
    from peft import LoraConfig, get_peft_model
    from transformers import TrainerCallback

    lora = LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)
    torch.manual_seed(0)
    model = tiny_llama()
    args = quick_dp_args(tmp_path / "peft_config", max_steps=2, logging_strategy="no", dp_seed=0)
    trainer = DPTrainer(model=model, args=args, train_dataset=lm_dataset(8), peft_config=lora,
                        optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None))
    with pytest.raises(ValueError, match=r"the optimizer does not hold these trainable parameters \(at train start\): "
                                         r".*q_proj.lora_A.default.weight.*would never train"):
        trainer.train()
    assert trainer.accountant.steps == 0

    class SwitchAdapter(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            model.set_adapter("second")

    model = get_peft_model(tiny_llama(), lora)
    model.add_adapter("second", lora)
    args = quick_dp_args(tmp_path / "set_adapter", max_steps=2, logging_strategy="no", dp_seed=0)
    trainer = DPTrainer(model=model, args=args, train_dataset=lm_dataset(8), callbacks=[SwitchAdapter()])
    with pytest.raises(ValueError, match=r"does not hold .*\(before this optimizer step; nothing of it applied\): "
                                         r".*lora_A.second.weight"):
        trainer.train()
    assert trainer.state.global_step == 1


def test_gradual_unfreezing_from_a_frozen_start_names_the_optimizer_that_trains_it(tmp_path):
    """The encoder frozen before train(), a layer unfrozen by a callback at step 1 (flat clipping rebuilds the engine):
    the Trainer's optimizer, built over the parameters trainable at train start, does not hold the layer. Before
    invariant 14 the layer was clipped and never moved, silently; now refused before the optimizer step, saying how
    to unfreeze during training: an optimizer built over all parameters, with which the layer trains."""
    from transformers import TrainerCallback

    class UnfreezeLayer(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == 1:
                model.bert.encoder.layer[1].requires_grad_(True)

    def trainer(out, optimizer=None):
        model = bert()
        model.bert.requires_grad_(False)
        args = quick_dp_args(out, max_steps=2, logging_strategy="no", dp_seed=0, learning_rate=0.1)
        optimizers = (None, None) if optimizer is None else (optimizer(model.parameters(), lr=0.1), None)
        return DPTrainer(model=model, args=args, train_dataset=cls_dataset(16, 3), callbacks=[UnfreezeLayer()],
                         optimizers=optimizers)

    with pytest.raises(ValueError, match=r"does not hold .*encoder.layer.1.*\(gradual unfreezing\).*"
                                         r"optimizers=\(torch.optim.AdamW\(model.parameters\(\)"):
        trainer(tmp_path / "trainer").train()
    built_over_all = trainer(tmp_path / "all", torch.optim.AdamW)
    before = params(built_over_all.model)
    built_over_all.train()
    assert not torch.equal(before["bert.encoder.layer.1.output.dense.weight"],
                           built_over_all.model.bert.encoder.layer[1].output.dense.weight)
