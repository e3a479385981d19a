"""Ordinary usages from a sixth outside probe (session 14), each closed by the invariant it violated.

* The release is what trains (DESIGN invariant 14): ``accelerate launch --mixed_precision fp16`` (or
  ``mixed_precision: fp16`` in the accelerate config) reaches the Trainer as the environment variable
  ``ACCELERATE_MIXED_PRECISION``, which ``TrainingArguments`` reads into ``args.mixed_precision`` with ``fp16`` left
  False; ``fp16=True``'s refusal never saw it, and on a GPU accelerate's ``GradScaler`` divides the noised gradient
  by its loss scale before the optimizer applies it. ``--mixed_precision fp8`` makes accelerate swap the hooked
  linear layers for fp8 modules at ``train()``. Both refused when the arguments are built (and by the trainer). The
  card named the precision from ``bf16`` / ``fp16`` only: under ``--mixed_precision bf16`` it said "no"; it now says
  what the Accelerator ran with.
* A refusal states its true cause (or a number given as text is a number): a YAML config's ``target_delta: 1e-5`` is
  the string "1e-5" (YAML 1.1), which failed with Python's bare ``TypeError``; hf_dp's numbers are now converted as
  the command line converts them.
* A released step is the mechanism recorded (invariant 6): ``trainer.args`` replaced by another arguments object
  after construction mixed two configurations (the loop, σ and the card's hyperparameters from the new one; C, q, δ
  and the clipping from the old); refused at train start, and at every step when a callback replaces it.
* A refusal states its true cause and what to do: ``--dynamo_use_fullgraph`` (``ACCELERATE_DYNAMO_USE_FULLGRAPH``)
  with compilation on failed at the first step with dynamo's "Unsafe side effect"; refused at construction naming
  the setting. ``label_names=["target"]`` failed at train start with a bare ``KeyError: 'labels'``; refused at
  construction naming the ``labels`` key DPTrainer reads. An iterable (streamed) training set was refused with "needs a
  map-style train_dataset of known size N"; it now names the iterable set and the way to a map-style one.

What the probe found holding is listed in the README ("Checked at run time / refused") and in the session's report.
"""

from __future__ import annotations

import pytest
import torch
from helpers import cls_dataset
from helpers.neighbours import C, bert, bert_data, distance, neighbour_args, summed_updates

from hf_dp import DPTrainer


# ---------------------------------------------------------------------- configuration from the environment
@pytest.mark.parametrize("precision, cause", [
    ("fp16", r"Mixed precision is fp16 although fp16 is not set: it comes from the environment "
             r"\(ACCELERATE_MIXED_PRECISION=fp16.*GradScaler would divide the gradient"),
    ("fp8", r"Mixed precision is fp8: it comes from the environment \(ACCELERATE_MIXED_PRECISION=fp8.*replaces its "
            r"linear layers by fp8 modules.*after DPTrainer installed its per-example clipping hooks")],
    ids=["fp16", "fp8"])
def test_fp16_or_fp8_from_accelerate_launch_is_refused_with_the_arguments(tmp_path, monkeypatch, precision, cause):
    """``accelerate launch --mixed_precision fp16|fp8 train.py`` with ``DPTrainingArguments`` declaring neither fp16
    nor bf16: ``TrainingArguments`` reads ``ACCELERATE_MIXED_PRECISION`` into ``args.mixed_precision`` and the Trainer
    builds its Accelerator from it. fp16: on a GPU a GradScaler multiplies ``.grad`` by 1/65,536 before
    ``optimizer.step()`` (on this CPU accelerate makes none; the setting is what a GPU run of the same script does).
    fp8: at ``train()`` accelerate swaps the hooked linear layers for fp8 modules (here accelerate refuses first: no fp8
    backend installed, so the fp8 case runs the arguments' check only). Nothing of hf_dp refused either; now the
    arguments do, and a trainer given arguments whose precision was set afterwards."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", precision)
    with pytest.raises(ValueError, match=cause + r".*Launch with `--mixed_precision bf16`"):
        neighbour_args(tmp_path, 4)
    if precision == "fp16":  # (fp8 on this machine: accelerate refuses first, no fp8 backend installed)
        monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
        args = neighbour_args(tmp_path, 4)
        args.mixed_precision = precision
        with pytest.raises(ValueError, match=cause):
            DPTrainer(model=bert(), args=args, train_dataset=bert_data(4))


def test_bf16_from_accelerate_launch_stays_within_the_bound_and_the_card_says_bf16(tmp_path, monkeypatch):
    """``--mixed_precision bf16`` (no loss scaling) trains: removing one example moves the summed update by at most C;
    the card's hyperparameters say bf16 (they said "no", read from ``args.bf16`` alone)."""
    from hf_dp.release import card_hyperparameters

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    sigma_d, sigma_d2 = summed_updates(tmp_path)
    assert 0 < distance(sigma_d, sigma_d2) <= C * (1 + 1e-6)
    hyper = dict(card_hyperparameters(neighbour_args(tmp_path, 4), None, 4, 1))
    assert hyper["mixed_precision"] == "bf16"


def test_full_graph_compile_from_accelerate_launch_is_refused_naming_the_setting(tmp_path, monkeypatch):
    """``accelerate launch --dynamo_backend eager --dynamo_use_fullgraph``: accelerate compiles the model with
    ``fullgraph=True`` at ``train()``; dynamo cannot trace the clipping hooks' side effects, and the first step failed
    with "Unsupported HOP: Unsafe side effect ... Mutating a variable from outside the scope of this HOP", naming
    neither hf_dp nor the setting. Refused at construction with the way out; without fullgraph the same backend is
    accepted (it compiles around the hooks: within the bound, checked by hand, 21-26 s of CPU for one tiny step)."""
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "eager")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_FULLGRAPH", "true")
    with pytest.raises(ValueError, match=r"torch.compile with fullgraph=True \(ACCELERATE_DYNAMO_USE_FULLGRAPH.*"
                                         r"backend 'eager'\) cannot trace DPTrainer's per-example clipping hooks.*"
                                         r"Drop fullgraph"):
        DPTrainer(model=bert(), args=neighbour_args(tmp_path, 4), train_dataset=bert_data(4))
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_FULLGRAPH", "false")
    trainer = DPTrainer(model=bert(), args=neighbour_args(tmp_path, 4), train_dataset=bert_data(4))
    assert trainer.accelerator.state.dynamo_plugin.backend.value == "EAGER"  # compiled at train(), not run here


def test_arguments_replaced_after_construction_are_refused_before_anything_is_trained(tmp_path):
    """``trainer.args = other_args`` (a notebook's second configuration, built beforehand): the Trainer's loop, the σ
    taken at ``train()`` and the card's hyperparameters read the new object, while C, q, δ and the clipping stayed
    those of the arguments given to the DPTrainer (a copy with C × 100 trained at the old C while the card's
    hyperparameters said the new one). Refused at train start, before any step; in-place changes are followed."""
    from helpers.runs import assert_refused_before_any_release

    other = neighbour_args(tmp_path / "other", 4, per_sample_max_grad_norm=100 * C)
    trainer = DPTrainer(model=bert(), args=neighbour_args(tmp_path, 4), train_dataset=bert_data(4))
    trainer.args = other
    assert_refused_before_any_release(trainer, r"trainer.args was replaced by another arguments object after the "
                                               r"DPTrainer was built.*Set fields on trainer.args in place")


def test_arguments_replaced_by_a_callback_during_train_are_refused_before_the_next_release(tmp_path):
    """The same replacement made by a callback during ``train()`` (lead, session 14): the mechanism checks at every
    step's start and release that ``trainer.args`` is the object it reads, so the step after the replacement is
    refused before anything of it is released; the step before it stands, recorded at its own C."""
    import dataclasses

    from helpers import quick_dp_args
    from transformers import TrainerCallback

    class Replace(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            trainer.args = dataclasses.replace(args, per_sample_max_grad_norm=100 * args.per_sample_max_grad_norm)

    args = quick_dp_args(tmp_path, max_steps=3, logging_strategy="no")
    trainer = DPTrainer(model=bert(), args=args, train_dataset=cls_dataset(16, 3), callbacks=[Replace()])
    with pytest.raises(ValueError, match=r"trainer.args was replaced by another arguments object.*Nothing of this "
                                         r"step was released"):
        trainer.train()
    assert trainer.accountant.steps == 1
    assert trainer.privacy_record().per_sample_max_grad_norm == args.per_sample_max_grad_norm


# ---------------------------------------------------------------------- data
def test_targets_under_another_label_name_are_refused_at_construction(tmp_path):
    """A model of one's own whose forward takes its targets as ``target`` and ``label_names=["target"]`` (the Trainer's
    way to name them): the run failed at train start with a bare ``KeyError: 'labels'`` (the counterfactual's
    collation). DPTrainer reads the targets from ``labels``; refused at construction saying so and how to rename."""

    class Targets(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert()

        def forward(self, input_ids, attention_mask=None, target=None):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask, labels=target)

    def loss(outputs, labels):
        return torch.nn.functional.cross_entropy(outputs.logits, labels, reduction="none")

    data = bert_data(4).rename_column("labels", "target")
    with pytest.raises(ValueError, match=r"label_names=\['target'\]: DPTrainer reads every batch's targets from the "
                                         r"`labels` key.*rename_column\('target', 'labels'\)"):
        DPTrainer(model=Targets(), args=neighbour_args(tmp_path, 4, label_names=["target"]), train_dataset=data,
                  per_example_loss=loss)


def test_a_streamed_training_set_is_refused_naming_the_way_to_a_map_style_one(tmp_path):
    """``load_dataset(..., streaming=True)`` / ``to_iterable_dataset()``: no length, so no Poisson sampling at rate
    q = B/N. Refused at construction with that cause and the way out (it said only "needs a map-style dataset")."""
    with pytest.raises(ValueError, match=r"train_dataset is an iterable dataset \(IterableDataset.*no length.*Poisson "
                                         r"sampling.*load without streaming=True"):
        DPTrainer(model=bert(), args=neighbour_args(tmp_path, 4), train_dataset=cls_dataset(4, 3).to_iterable_dataset())


# ---------------------------------------------------------------------- arguments from a YAML file
def test_privacy_numbers_from_a_yaml_config_are_numbers(tmp_path):
    """``HfArgumentParser(DPTrainingArguments).parse_yaml_file``: YAML 1.1 reads ``1e-5`` (no decimal point) as the
    string "1e-5", and the parser passes it on as text. ``target_delta: 1e-5`` (the usual way to write δ) failed with
    Python's bare "'<' not supported between instances of 'int' and 'str'". The privacy numbers are now converted as
    the command line converts them; text that is no number is refused naming the field."""
    from transformers import HfArgumentParser

    from hf_dp import DPTrainingArguments

    config = tmp_path / "dp.yaml"
    config.write_text(f"output_dir: {tmp_path}\nuse_cpu: true\nreport_to: none\nnoise_multiplier: 1.0\n"
                      "target_delta: 1e-5\nper_sample_max_grad_norm: 1e-2\ngroup_max_grad_norms: [1e-2, 1.0]\n")
    (args,) = HfArgumentParser(DPTrainingArguments).parse_yaml_file(str(config))
    assert (args.target_delta, args.per_sample_max_grad_norm, args.group_max_grad_norms) == (1e-5, 1e-2, [1e-2, 1.0])
    with pytest.raises(ValueError, match=r"target_delta='1e-5x' is not a number; give it as a number"):
        DPTrainingArguments(output_dir=str(tmp_path), use_cpu=True, noise_multiplier=1.0, target_delta="1e-5x")


# ---------------------------------------------------------------------- layers run on a data-dependent set of tokens
def test_activated_lora_is_refused_at_construction(tmp_path):
    """Activated LoRA (``alora_invocation_tokens``) runs lora_A / lora_B on the tokens after each row's invocation
    sequence, gathered over the batch into one flat input: how many rows each example has depends on its data. When
    the first batch's rows held the invocation at one position, the layout proven there split a later batch at the
    wrong rows, silently (the next test shows it on a model of one's own); otherwise the first step refused with
    advice about `target_modules`. Refused at construction with the cause and the way out (plain LoRA)."""
    from helpers import lm_dataset, tiny_llama
    from peft import LoraConfig, TaskType

    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"Adapter 'default' is an activated LoRA \(alora_invocation_tokens=\[7, 8\]\)"
                                         r".*depends on the example's data.*Train a plain LoRA adapter"):
        DPTrainer(model=tiny_llama(), args=neighbour_args(tmp_path, 4), train_dataset=lm_dataset(4),
                  peft_config=LoraConfig(task_type=TaskType.CAUSAL_LM, r=2, target_modules=["q_proj", "v_proj"],
                                         alora_invocation_tokens=[7, 8]))


class SelectsTokens(torch.nn.Module):
    """A model of one's own whose middle layer runs on the tokens a row selects by its data (``x[..., 0] > 0``),
    gathered over the batch (``h[mask]``: a flat ``(Σ_i k_i, 4)`` input), as activated LoRA does."""

    def __init__(self):
        super().__init__()
        self.embed, self.sel, self.head = (torch.nn.Linear(3, 4), torch.nn.Linear(4, 4),
                                           torch.nn.Linear(4, 2))

    def forward(self, x, labels=None):
        from helpers import LossOut

        h = self.embed(x.to(self.embed.weight.dtype))
        mask = x[..., 0] > 0
        out = h.clone()
        out[mask] = out[mask] + torch.tanh(self.sel(h[mask]))
        logits = self.head(out).mean(1)
        return LossOut(logits, None if labels is None else torch.nn.functional.cross_entropy(logits, labels))


def rows_selecting(kept):
    """One row per entry: 4 tokens of width 3, the first ``k`` selected (first coordinate > 0)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    rows = []
    for i, k in enumerate(kept):
        x = torch.randn(4, 3, generator=g)
        x[:, 0] = x[:, 0].abs() + 0.1
        x[k:, 0] = -x[k:, 0]
        rows.append({"x": x.tolist(), "labels": i % 2})
    return Dataset.from_list(rows)


@pytest.mark.xfail(strict=True, reason="a flat layout ((Σ_i k_i, d) rows, the examples' rows one after the other) is "
                                       "proven on the first micro-batch and the hard batch only, then read as k rows "
                                       "per example at every later micro-batch; a later batch whose examples select "
                                       "other numbers of rows is split at the wrong rows, silently, when the total is "
                                       "a multiple of the batch size (otherwise: a mid-training refusal). Not yet "
                                       "checked per micro-batch (clipping/recorder.py)")
def test_a_layer_on_data_selected_tokens_trains_exactly_or_is_refused_before_release(tmp_path):
    """8 rows selecting 2 tokens each except rows 4 and 5 (1 and 3): the first micro-batch (rows 0, 1) and the hard
    batch (rows 0, 7, 3) select 2 per example, so the layout is proven as 2 rows per example; the micro-batch of rows
    4 and 5 (4 rows) is then split 2 + 2. The update is not the oracle's (embed.weight differs); nothing refuses."""
    from helpers import check_exact, toy_loss

    torch.manual_seed(0)
    check_exact(SelectsTokens(), rows_selecting((2, 2, 2, 2, 1, 3, 2, 2)), tmp_path, ga=4, per_example_loss=toy_loss)


def test_a_layer_on_data_selected_tokens_is_exact_when_every_row_selects_as_many(tmp_path):
    from helpers import check_exact, toy_loss

    torch.manual_seed(0)
    check_exact(SelectsTokens(), rows_selecting((2,) * 8), tmp_path, ga=4, per_example_loss=toy_loss)
