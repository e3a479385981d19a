"""The DP guarantee as a black-box property, over a catalogue of Trainer usages (DESIGN invariant 8, issue 12).

The property: with σ = 0 and q = 1 (SGD, lr = 1, constant schedule, float64), for neighbouring datasets D and D′
(one example removed) the summed clipped update ``Σ = (θ₀ − θ₁) · qN`` moves by at most C; and with a huge σ no
parameter moves without noise (its update is ~ σC/(qN)·√d). Each usage below either holds, or is refused with a
clear error before anything is released.
"""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
from datasets import Dataset
from helpers import lm_dataset, tiny_gpt2, tiny_llama
from helpers.neighbours import (
    C,
    N,
    assert_neighbours_within_c,
    bert,
    bert_data,
    default_build,
    distance,
    neighbour_args,
    params,
    regression_data,
    regression_model,
    summed_updates,
)
from transformers import TrainerCallback

from hf_dp import DPTrainer, UnsupportedLayerError

HUGE_SIGMA = 1e4


def assert_everything_noised(tmp_path, **kw):
    """With σ = 1e4 every parameter that moved moved by noise: ‖Δ_p‖ ≈ σC/(qN)·√d_p (ratio far from 0)."""
    (noised,) = summed_updates(tmp_path, sigma=HUGE_SIGMA, neighbour=False, **kw)  # noise std on Σ = Δ·m is σC
    checked = 0
    for name, s in noised.items():
        if s.numel() < 16 or not bool(s.any()):
            continue
        ratio = float(s.norm()) / (HUGE_SIGMA * C * math.sqrt(s.numel()))
        assert 0.3 < ratio < 3, f"{name} moved by {ratio:.3g}× the noise: trained without (or with other) noise"
        checked += 1
    assert checked > 0


# ---------------------------------------------------------------------- usages that hold
def test_plain_usage_holds(tmp_path):
    assert_neighbours_within_c(tmp_path / "c")
    assert_everything_noised(tmp_path / "noise")


def test_trainer_max_grad_norm_post_processing_holds(tmp_path):
    """A user who keeps the Trainer's own max_grad_norm (global clipping of the already-noised update: post-processing)
    trains: the gradient check allows exactly that one in-place rescale."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_everything_noised(tmp_path / "noise", max_grad_norm=1e12)


def build_model_init(args, data):
    return DPTrainer(model_init=bert, args=args, train_dataset=data)


def test_model_init_holds(tmp_path, caplog):
    """Trainer.train() builds a new model with model_init: the engine is rebuilt for it (call_model_init), not
    only caught later by the per-step trainable-set check."""
    with caplog.at_level("WARNING", logger="hf_dp.trainer"):
        assert_neighbours_within_c(tmp_path / "c", build=build_model_init)
    assert "trainable parameters changed" not in caplog.text
    assert_everything_noised(tmp_path / "noise", build=build_model_init)


def test_model_init_twice_starts_a_fresh_accountant(tmp_path):
    trainer = build_model_init(neighbour_args(tmp_path, 4, sigma=1.0), bert_data(4))
    trainer.train()
    first = trainer.model
    trainer.train()
    assert trainer.model is not first and trainer.accountant.steps == 1


def build_unfreeze_after_construction(args, data):
    model = bert()
    model.bert.embeddings.requires_grad_(False)
    trainer = DPTrainer(model=model, args=args, train_dataset=data)
    model.bert.embeddings.word_embeddings.weight.requires_grad_(True)  # the user fixes it later
    return trainer


def test_parameter_unfrozen_after_construction_holds(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="hf_dp.trainer"):
        sums = assert_neighbours_within_c(tmp_path / "c", build=build_unfreeze_after_construction)
    assert "engine was rebuilt" in caplog.text
    assert bool(sums["bert.embeddings.word_embeddings.weight"].any())  # it did train, clipped
    assert_everything_noised(tmp_path / "noise", build=build_unfreeze_after_construction)


def build_module_replaced(args, data):
    model = bert()
    trainer = DPTrainer(model=model, args=args, train_dataset=data)
    torch.manual_seed(1)
    model.classifier = torch.nn.Linear(16, 3).double()
    return trainer


def test_module_replaced_after_construction_holds(tmp_path):
    assert_neighbours_within_c(tmp_path / "c", build=build_module_replaced)
    assert_everything_noised(tmp_path / "noise", build=build_module_replaced)


class UnfreezeAtStep(TrainerCallback):
    """Gradual unfreezing: a layer frozen once the optimizer is built, made trainable again at the start of step 2."""

    def __init__(self, trainer, step: int = 1):
        self.trainer, self.step = trainer, step

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.model.bert.embeddings.word_embeddings.weight.requires_grad_(False)

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.trainer.model.bert.embeddings.word_embeddings.weight.requires_grad_(True)


def build_gradual_unfreezing(args, data, clipping="flat"):
    model = bert()
    args.clipping = clipping
    trainer = DPTrainer(model=model, args=args, train_dataset=data)
    trainer.add_callback(UnfreezeAtStep(trainer))
    return trainer


def test_callback_unfreezing_mid_run_holds_for_flat_clipping(tmp_path):
    """Step 1 has lr = 0 (warm-up), so step 2 starts from the same θ on D and D′ and its update is one release."""
    sums = assert_neighbours_within_c(tmp_path / "c", build=build_gradual_unfreezing, max_steps=2,
                                      lr_scheduler_type="constant_with_warmup", warmup_steps=1)
    assert bool(sums["bert.embeddings.word_embeddings.weight"].any())
    assert_everything_noised(tmp_path / "noise", build=build_gradual_unfreezing, max_steps=2,
                             lr_scheduler_type="constant_with_warmup", warmup_steps=1)


def test_callback_unfreezing_mid_run_is_refused_for_group_wise_clipping(tmp_path):
    trainer = build_gradual_unfreezing(neighbour_args(tmp_path, 4, max_steps=2), bert_data(4), clipping="per_layer")
    with pytest.raises(RuntimeError, match="changed during training"):
        trainer.train()


def test_gradient_accumulation_holds(tmp_path):
    assert_neighbours_within_c(tmp_path / "c", ga="all")  # one example per chunk, m chunks per step
    assert_everything_noised(tmp_path / "noise", ga="all")


def build_lora(args, data):
    from peft import LoraConfig

    return DPTrainer(model=bert(), args=args, train_dataset=data,
                     peft_config=LoraConfig(r=2, target_modules=["query", "value"], lora_dropout=0.0))


def test_peft_lora_holds(tmp_path):
    sums = assert_neighbours_within_c(tmp_path / "c", build=build_lora)
    moved = [k for k, v in sums.items() if bool(v.any())]
    assert moved and all("lora_" in k or "classifier" in k for k in moved)
    assert_everything_noised(tmp_path / "noise", build=build_lora)


def build_lora_model_init(args, data):
    from peft import LoraConfig

    return DPTrainer(model_init=bert, args=args, train_dataset=data,
                     peft_config=LoraConfig(r=2, target_modules=["query", "value"], lora_dropout=0.0))


def test_peft_lora_with_model_init_holds(tmp_path):
    assert_neighbours_within_c(tmp_path / "c", build=build_lora_model_init)


def test_resume_from_checkpoint_holds(tmp_path):
    """Step 1 (lr = 0) is saved; a new trainer resumes from it and runs step 2: one release, ε over both steps."""
    schedule = dict(lr_scheduler_type="constant_with_warmup", warmup_steps=1)

    def resume(trainer):
        m, out = len(trainer.train_dataset), trainer.args.output_dir
        first = DPTrainer(model=bert(), args=neighbour_args(out, m, save_strategy="steps", save_steps=1, **schedule),
                          train_dataset=trainer.train_dataset)
        first.train()
        trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-1"))
        assert trainer.accountant.steps == 2 == trainer.state.global_step

    assert_neighbours_within_c(tmp_path, train=resume, max_steps=2, **schedule)


def documents_as_chunks(num_docs: int, block: int = 4):
    """``num_docs`` documents of 6-13 tokens chunked *within* documents (``hf_dp.chunk_documents``): each chunk a row
    tagged with its ``document_id``; the last document has at least two chunks."""
    from hf_dp import chunk_documents

    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(2, 61, (int(torch.randint(6, 14, (1,), generator=g)),), generator=g).tolist()
            for _ in range(num_docs)]
    return chunk_documents(Dataset.from_dict({"input_ids": docs}), block_size=block)


def right_pad_collator(rows):
    """Right padding; labels -100 on padding (each chunk's loss is its own tokens')."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, :len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def document_trainer(args, data):
    torch.manual_seed(0)
    return DPTrainer(model=tiny_gpt2().double(), args=args, train_dataset=data, data_collator=right_pad_collator)


def test_document_level_recipe_holds_the_neighbouring_bound(tmp_path):
    """README, 'Document-level DP for language modelling': chunk within documents, privacy_unit='user' with the
    document id. Removing one whole document (all its chunks) moves the summed clipped update by at most C, with
    q = 1 over documents; the same chunks at the example (block) level move it by more than C: the unit matters."""
    n = 4
    chunks = documents_as_chunks(n)
    last = [i for i, d in enumerate(chunks["document_id"]) if d == n - 1]
    assert len(last) >= 2
    user = dict(privacy_unit="user", user_id_column="document_id")
    assert_neighbours_within_c(tmp_path / "doc", build=document_trainer, n=n, data_fn=documents_as_chunks, **user)

    def block_level(rows, out):  # every chunk its own unit, q = 1 over chunks
        trainer = document_trainer(neighbour_args(out, len(rows)), rows)
        before = params(trainer.model)
        trainer.train()
        return {k: (before[k] - v) * len(rows) for k, v in params(trainer.model).items()}

    without = chunks.select([i for i in range(len(chunks)) if i not in last])
    moved = distance(block_level(chunks, tmp_path / "b1"), block_level(without, tmp_path / "b2"))
    assert moved > 1.2 * C


class ReadsTheModel(TrainerCallback):
    """Touches the model without training it: an evaluation-style forward at every step end (post-processing)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, model=None, **kwargs):
        with torch.no_grad():
            model(input_ids=torch.tensor([[3, 4, 5]]))


def test_callback_that_reads_the_model_holds(tmp_path):
    def build(args, data):
        trainer = default_build(args, data)
        trainer.add_callback(ReadsTheModel(trainer))
        return trainer

    assert_neighbours_within_c(tmp_path, build=build)


def test_nan_example_gets_factor_zero_and_the_update_equals_the_finite_oracle(tmp_path, caplog):
    """A NaN regression label: σ = 0, q = 1: the update is the oracle over the finite examples (the model's own loss
    on a batch of one); it is counted, warned about and logged; the logged loss is finite. (The first-step
    self-check is off: it compares against autograd on the same batch, which the NaN example poisons.)"""
    data = regression_data(N)
    model = regression_model()
    oracle = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for i in range(N):
        if i == 2:
            continue
        row = data[i]
        model.zero_grad(set_to_none=True)
        model(input_ids=torch.tensor([row["input_ids"]]), attention_mask=torch.tensor([row["attention_mask"]]),
              labels=torch.tensor([row["labels"]], dtype=torch.float64)).loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
        for n in oracle:
            oracle[n] += min(1.0, C / (norm + 1e-6)) * grads[n]
    model.zero_grad(set_to_none=True)

    trainer = DPTrainer(model=model, args=neighbour_args(tmp_path, N, dp_self_check=False, logging_strategy="steps",
                                                         logging_steps=1), train_dataset=data)
    before = params(model)
    with caplog.at_level("WARNING", logger="hf_dp.trainer"):
        trainer.train()
    for n, p in model.named_parameters():
        torch.testing.assert_close((before[n] - p.detach()) * N, oracle[n], rtol=1e-7, atol=1e-12, msg=n)
    assert trainer.nonfinite_examples == 1 and "non-finite" in caplog.text
    logged = [h for h in trainer.state.log_history if "nonfinite_examples" in h]
    assert logged and logged[0]["nonfinite_examples"] == 1
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)


def test_nan_example_neighbours_and_noise(tmp_path):
    kw = dict(build=lambda args, data: DPTrainer(model=regression_model(), args=args, train_dataset=data),
              data_fn=regression_data, dp_self_check=False)
    assert_neighbours_within_c(tmp_path / "c", **kw)  # D′ drops a finite example; the NaN one is in both
    (noised,) = summed_updates(tmp_path / "noise", sigma=1.0, neighbour=False, **kw)
    assert all(bool(torch.isfinite(v).all()) for v in noised.values())


def test_nan_example_under_group_wise_clipping_is_finite(tmp_path):
    trainer = DPTrainer(model=regression_model(), args=neighbour_args(tmp_path, N, sigma=1.0, clipping="per_layer",
                                                                      dp_self_check=False),
                        train_dataset=regression_data(N))
    trainer.train()
    assert all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())


def test_train_twice_continues_the_accountant(tmp_path):
    trainer = default_build(neighbour_args(tmp_path, 4, sigma=1.0), bert_data(4))
    trainer.train()
    eps_one = trainer.privacy_spent()["epsilon"]
    with pytest.warns(UserWarning, match="accounting continues"):
        trainer.train()
    assert trainer.accountant.steps == 2
    assert trainer.privacy_spent()["epsilon"] > eps_one


def test_train_twice_with_target_epsilon_refuses_when_nothing_is_left(tmp_path):
    args = neighbour_args(tmp_path, 4, sigma=None, target_epsilon=8.0, target_delta=1e-3, max_steps=2)
    trainer = DPTrainer(model=bert(), args=args, train_dataset=bert_data(4))
    trainer.train()
    spent = trainer.privacy_spent()["epsilon"]
    assert spent <= 8.0
    trainer.args.target_epsilon = 0.9 * spent  # the second run asks for a budget the first already used up
    before = params(trainer.model)
    with pytest.warns(UserWarning, match="accounting continues"), pytest.raises(ValueError, match="already spent"):
        trainer.train()
    after = params(trainer.model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert trainer.accountant.steps == 2


def test_train_twice_with_target_epsilon_budget_left(tmp_path):
    args = neighbour_args(tmp_path, 4, sigma=None, target_epsilon=8.0, target_delta=1e-3, max_steps=1)
    trainer = DPTrainer(model=bert(), args=args, train_dataset=bert_data(4))
    trainer.train()
    sigma_one = trainer.noise_multiplier
    with pytest.warns(UserWarning, match="accounting continues"):
        trainer.train()
    assert trainer.accountant.steps == 2 and trainer.noise_multiplier > sigma_one
    assert trainer.privacy_spent()["epsilon"] <= 8.0


# ---------------------------------------------------------------------- interrupted and resumed steps
# A step left half done must go out whole or not at all (DESIGN invariant 11). D′ drops D's *first* example, which is
# the first chunk (GA = m, one example per chunk): the chunk a half-done step leaves behind. Counted again by the next
# release, it would move Σ_D − Σ_D′ to 2·g₀ − g₁ (‖·‖ > C).
def first_removed(m: int) -> Dataset:
    return bert_data(N).select(range(N - m, N))


class _AfterFirstChunk(TrainerCallback):
    """Once, after the first chunk of the first step: raise ``error``, or set the control flag ``flag``."""

    def __init__(self, error: BaseException | None = None, flag: str | None = None):
        self.error, self.flag, self.fired = error, flag, False

    def on_substep_end(self, args, state, control, **kwargs):
        if not self.fired:
            self.fired = True
            if self.error is not None:
                raise self.error
            setattr(control, self.flag, True)


def interrupted_then_train_again(trainer):
    """A notebook: the run is interrupted between two chunks (KeyboardInterrupt), then the cell is run again."""
    trainer.add_callback(_AfterFirstChunk(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert trainer.accountant.steps == 0
    trainer.train()
    assert trainer.accountant.steps == 1


def test_interrupted_train_then_train_again_holds(tmp_path):
    assert_neighbours_within_c(tmp_path, train=interrupted_then_train_again, ga="all", data_fn=first_removed)


def build_epoch_cut(args, data):
    trainer = default_build(args, data)
    trainer.add_callback(_AfterFirstChunk(flag="should_epoch_stop"))
    return trainer


def test_callback_ending_the_epoch_inside_a_step_holds(tmp_path):
    """q = 1, one step per epoch: epoch 1's step is cut after its first chunk, epoch 2's is released."""
    assert_neighbours_within_c(tmp_path, build=build_epoch_cut, ga="all", data_fn=first_removed, max_steps=-1,
                               num_train_epochs=2)


def build_out_of_memory_once(args, data):
    """Micro-batches of 2 (the memory bound ``auto_find_batch_size`` starts from): the step's second micro-batch runs
    out of memory once, after the first (examples 0 and 1) was clipped into the step's sum; accelerate's
    ``find_executable_batch_size`` re-runs the loop with micro-batches of 1."""
    model = bert()
    first_row, fired = data[0]["input_ids"], []

    def forward_pre_hook(module, args_, kwargs):
        ids = kwargs.get("input_ids")
        if not fired and ids is not None and ids.shape[0] >= 2 and ids[0].tolist() != first_row:
            fired.append(True)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    model.register_forward_pre_hook(forward_pre_hook, with_kwargs=True)
    args.auto_find_batch_size = True
    trainer = DPTrainer(model=model, args=args, train_dataset=data)
    trainer._train_batch_size = 2  # the micro-batch bound (memory only); the expected batch stays m (q = 1)
    return trainer


def test_out_of_memory_retry_holds(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="hf_dp.clipping.step"):
        assert_neighbours_within_c(tmp_path, build=build_out_of_memory_once, data_fn=first_removed)
    assert caplog.text.count("OutOfMemoryError escaped") == 2  # once on D, once on D′


# ---------------------------------------------------------------------- usages that are refused
def flattening_build(args, data):
    from transformers import DataCollatorWithFlattening

    torch.manual_seed(0)
    return DPTrainer(model=tiny_gpt2().double(), args=args, train_dataset=data,
                     data_collator=DataCollatorWithFlattening())


def test_padding_free_packing_is_refused_before_training(tmp_path):
    trainer = flattening_build(neighbour_args(tmp_path, 4), lm_dataset(4).remove_columns("attention_mask"))
    with pytest.raises(ValueError, match="Packing is not supported by DPTrainer"):
        trainer.get_train_dataloader()  # the collator is probed on two rows when the loader is built
    before = params(trainer.model)
    with pytest.raises(ValueError, match="Packing is not supported by DPTrainer"):
        trainer.train()
    assert trainer.accountant.steps == 0 and all(torch.equal(before[k], p) for k, p in params(trainer.model).items())


def test_collator_that_drops_a_row_is_refused(tmp_path):
    from transformers import default_data_collator

    def drop_last(features):
        return default_data_collator(features[:-1] if len(features) > 1 else features)

    trainer = DPTrainer(model=bert(), args=neighbour_args(tmp_path, 4), train_dataset=bert_data(4),
                        data_collator=drop_last)
    with pytest.raises(ValueError, match="one row per example"):
        trainer.train()
    assert trainer.accountant.steps == 0


def test_batch_row_check_is_an_overridable_method(tmp_path):
    trainer = default_build(neighbour_args(tmp_path, 4), bert_data(4))
    trainer._check_batch_rows(2, {"input_ids": torch.zeros(2, 3, dtype=torch.long)})
    with pytest.raises(ValueError, match="Packing"):
        trainer._check_batch_rows(2, {"input_ids": torch.zeros(1, 6),
                                      "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]])})
    with pytest.raises(ValueError, match="Packing"):
        trainer._check_batch_rows(1, {"input_ids": torch.zeros(1, 3), "cu_seq_lens_q": torch.tensor([0, 3])})


def test_subclass_train_dataloader_is_refused(tmp_path):
    from torch.utils.data import DataLoader
    from transformers import default_data_collator

    class MyLoader(DPTrainer):
        def get_train_dataloader(self):
            return DataLoader(self.train_dataset, batch_size=2, shuffle=True, collate_fn=default_data_collator)

    trainer = MyLoader(model=bert(), args=neighbour_args(tmp_path, 4), train_dataset=bert_data(4))
    with pytest.raises(ValueError, match="replaces Poisson sampling"):
        trainer.train()
    assert trainer.accountant.steps == 0


def test_subclass_that_returns_the_dp_loader_is_accepted(tmp_path):
    class Wraps(DPTrainer):
        def get_train_dataloader(self):
            self.calls = getattr(self, "calls", 0) + 1
            return super().get_train_dataloader()

    trainer = Wraps(model=bert(), args=neighbour_args(tmp_path, 4, sigma=1.0), train_dataset=bert_data(4))
    trainer.train()
    assert trainer.calls == 1 and trainer.accountant.steps == 1


def test_subclass_compute_loss_is_refused(tmp_path):
    class MyLoss(DPTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch) * 2

    with pytest.raises(ValueError, match="per_example_loss"):
        MyLoss(model=bert(), args=neighbour_args(tmp_path, 4), train_dataset=bert_data(4))


class PlainBackward(DPTrainer):
    """A subclass whose training_step does what the plain Trainer does: backward of the batch loss."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        inputs = self._prepare_inputs(inputs)
        loss = model(**inputs).loss
        loss.backward()
        return loss.detach()


class ExtraBackward(DPTrainer):
    """A subclass that adds an (unclipped) auxiliary loss after the DP step."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        out = super().training_step(model, dict(inputs), num_items_in_batch)
        inputs = self._prepare_inputs(inputs)
        model(**inputs).loss.backward()
        return out


@pytest.mark.parametrize("cls, match", [(PlainBackward, "did not write"), (ExtraBackward, "changed in place")])
def test_subclass_training_step_with_plain_backward_is_refused(tmp_path, cls, match):
    trainer = cls(model=bert(), args=neighbour_args(tmp_path, 4, dp_self_check=False), train_dataset=bert_data(4))
    before = params(trainer.model)
    with pytest.raises(RuntimeError, match=match):
        trainer.train()
    assert all(torch.equal(before[k], p) for k, p in params(trainer.model).items())  # nothing was applied


class BackwardAtStepBegin(TrainerCallback):
    """Runs a plain backward on private examples before the step: its raw gradient must not reach the optimizer."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        data = self.trainer.train_dataset
        batch = {k: torch.tensor(data[:2][k]) for k in ("input_ids", "attention_mask", "labels")}
        model(**batch).loss.backward()


def test_callback_that_runs_a_backward_before_the_step_holds(tmp_path, caplog):
    """A raw gradient left in ``.grad`` before the step is discarded at the step's first chunk (and the DP step
    writes, never accumulates, the released gradient)."""

    def build(args, data):
        trainer = default_build(args, data)
        trainer.add_callback(BackwardAtStepBegin(trainer))
        return trainer

    with caplog.at_level("WARNING", logger="hf_dp.trainer"):
        assert_neighbours_within_c(tmp_path / "c", build=build)
    assert "discarded" in caplog.text
    assert_everything_noised(tmp_path / "noise", build=build)


def test_post_processing_callback_holds(tmp_path):
    """hf_dp's CrossModelFlattening adds a data-independent term to the released gradient (after the check, which
    does not refuse it). λ is tiny because Σ = Δ·m scales that term by m, which differs between D and D′."""
    from hf_dp.callbacks import CrossModelFlattening

    reference = {n: p.detach() + 0.1 for n, p in bert().named_parameters()}

    def build(args, data):
        return DPTrainer(model=bert(), args=args, train_dataset=data,
                         callbacks=[CrossModelFlattening(reference, source="public", weight=1e-9)])

    assert_neighbours_within_c(tmp_path, build=build)


def test_unfreezing_inside_a_step_is_refused(tmp_path):
    class UnfreezeBetweenChunks(TrainerCallback):
        def __init__(self, trainer):
            self.trainer = trainer

        def on_substep_end(self, args, state, control, **kwargs):
            self.trainer.model.bert.embeddings.word_embeddings.weight.requires_grad_(True)

    model = bert()
    model.bert.embeddings.word_embeddings.requires_grad_(False)
    trainer = DPTrainer(model=model, args=neighbour_args(tmp_path, 4, ga=2), train_dataset=bert_data(4))
    trainer.add_callback(UnfreezeBetweenChunks(trainer))
    with pytest.raises(RuntimeError, match="middle of a DP step"):
        trainer.train()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(noise_multiplier=float("nan")), "noise_multiplier must be a finite"),
        (dict(noise_multiplier=float("inf")), "noise_multiplier must be a finite"),
        (dict(noise_multiplier=None, target_epsilon=float("inf")), "target_epsilon must be a finite"),
        (dict(noise_multiplier=None, target_epsilon=float("nan")), "target_epsilon must be a finite"),
        (dict(per_sample_max_grad_norm=float("inf")), "per_sample_max_grad_norm must be a finite"),
        (dict(per_sample_max_grad_norm=1e30, noise_multiplier=1e9), "overflows float32"),
        (dict(clipping="per_layer", group_max_grad_norms=[float("inf")]), "group_max_grad_norms must all be finite"),
        (dict(clipping="adaptive_per_layer", quantile_lr=float("inf")), "quantile_lr must be a finite"),
        (dict(clipping="adaptive_per_layer", quantile_noise_multiplier=float("inf")),
         "quantile_noise_multiplier must be a finite"),
        (dict(fp16=True), "bf16=True"),
    ],
)
def test_arguments_that_cannot_be_private_are_refused(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        neighbour_args(tmp_path, 4, **{"noise_multiplier": 1.0, **kwargs})


def test_delta_not_below_one_over_n_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not below 1/N"):
        DPTrainer(model=bert(), args=neighbour_args(tmp_path, 4, sigma=1.0, target_delta=0.5),
                  train_dataset=bert_data(4))
    trainer = DPTrainer(model=bert(), args=neighbour_args(tmp_path, 4, sigma=1.0, target_delta=0.22),
                        train_dataset=bert_data(4))
    trainer.train_dataset = bert_data(5)  # N changed after construction: δ = 0.22 < 1/4 but not < 1/5
    with pytest.raises(ValueError, match="not below 1/N"):
        trainer.train()


def test_empty_training_set_is_refused(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        DPTrainer(model=bert(), args=neighbour_args(tmp_path, 4, sigma=1.0), train_dataset=bert_data(0))


def test_hyperparameter_search_is_noted(tmp_path):
    trainer = build_model_init(neighbour_args(tmp_path, 4, sigma=1.0), bert_data(4))
    assert "hyperparameter" not in trainer.dp_guarantee
    trainer.call_model_init(trial={"learning_rate": 0.5})  # what hyperparameter_search's train(trial=...) calls
    assert "hyperparameter search" in trainer.dp_guarantee


# ---------------------------------------------------------------------- the checks as functions (guarantee.py)
def test_trainable_set_change_decisions():
    from hf_dp.guarantee import check_trainable_set_change

    ok = dict(sharded=False, at_step_boundary=True, at_train_begin=False, group_clipping=None)
    check_trainable_set_change("x", **ok)  # flat clipping at a step boundary: the engine is rebuilt
    check_trainable_set_change("x", **{**ok, "at_step_boundary": False, "at_train_begin": True,
                                       "group_clipping": "per_layer"})  # before train(): any mode
    for change, match in [({"sharded": True}, "Under FSDP"), ({"at_step_boundary": False}, "middle of a DP step"),
                          ({"group_clipping": "per_layer"}, "clipping='per_layer'")]:
        with pytest.raises(RuntimeError, match=match):
            check_trainable_set_change("x", **{**ok, **change})


def test_stale_gradients_are_discarded():
    from hf_dp.guarantee import discard_stale_gradients

    model = torch.nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    assert discard_stale_gradients(model) == 2 and all(p.grad is None for p in model.parameters())
    assert discard_stale_gradients(model) == 0


def test_steps_within_budget_is_the_last_step_under_the_target():
    from hf_dp.guarantee import budget_allows, steps_within_budget

    def eps(n):
        return 0.1 * n

    assert steps_within_budget(eps, 10, None) is None
    assert steps_within_budget(eps, 10, 5.0) == 10  # the whole plan fits
    assert steps_within_budget(eps, 100, 2.55) == 25
    assert steps_within_budget(eps, 100, 0.05) == 0
    assert budget_allows(24, 1, 25) and not budget_allows(25, 1, 25) and budget_allows(10**6, 1, None)


# ---------------------------------------------------------------------- an example's loss is its own (invariant 12)
# The reference is the counterfactual: the example collated ALONE by the same collator (its own length, padding and
# positions), checked on the first micro-batch and on a batch of the training set's shortest and longest rows
# (hf_dp/counterfactual.py). Rows below have very different lengths and are padded by the collator.
LENGTHS = [3, 9, 5, 4, 12]  # D′ drops the longest row: every other row's padding changes


def varlen_lm(m: int, lengths: list[int] = LENGTHS) -> Dataset:
    """Causal-LM rows of their own lengths, unpadded (the collator pads)."""
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(2, 61, (n,), generator=g).tolist() for n in lengths]
    return Dataset.from_dict({"input_ids": ids, "labels": ids}).select(range(m))


def varlen_cls(m: int, lengths: list[int] = LENGTHS) -> Dataset:
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 61, (n,), generator=g).tolist() for n in lengths]
    return Dataset.from_dict({"input_ids": ids, "labels": [i % 3 for i in range(len(lengths))]}).select(range(m))


def pad_collator(side: str = "right", position_ids: bool = False, mask: bool = True, first_label: bool = True,
                 label_pad: int = -100):
    """Pads ``input_ids`` with 0 (and sequence ``labels`` with -100) to the batch's longest row, on ``side``;
    ``position_ids`` from the attention mask on request; ``mask=False`` gives an all-ones attention mask (the padding
    is attended: an example's loss then depends on its batch's longest row); ``first_label=False`` sets each row's
    first label to -100 (never predicted alone; left-padded, the last padding position would predict it);
    ``label_pad`` pads sequence labels (the pad token id instead of -100 trains on the padding)."""

    def collate(features):
        longest = max(len(f["input_ids"]) for f in features)

        def pad(x, value):
            fill = [value] * (longest - len(x))
            return fill + list(x) if side == "left" else list(x) + fill

        batch = {"input_ids": torch.tensor([pad(f["input_ids"], 0) for f in features]),
                 "attention_mask": torch.tensor([pad([1] * len(f["input_ids"]), 1 if not mask else 0)
                                                 for f in features])}
        labels = [f["labels"] if first_label or not isinstance(f["labels"], list) else [-100] + f["labels"][1:]
                  for f in features]
        batch["labels"] = torch.tensor([pad(x, label_pad) for x in labels] if isinstance(labels[0], list) else labels)
        if position_ids:
            batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        return batch

    return collate


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return tiny_gpt2().double()


def collated_build(collator, model_factory=gpt2, **kw):
    def build(args, data):
        return DPTrainer(model=model_factory(), args=args, train_dataset=data, data_collator=collator, **kw)

    return build


def assert_refused_before_release(trainer, error, match):
    before = params(trainer.model)
    with pytest.raises(error, match=match):
        trainer.train()
    assert trainer.accountant.steps == 0 and all(torch.equal(before[k], p) for k, p in params(trainer.model).items())


@pytest.mark.parametrize("model, clipping", [("gpt2", "flat"), ("llama", "flat"), ("bert", "flat"),
                                             ("gpt2", "per_layer")])
def test_right_padding_rows_of_very_different_lengths_hold(tmp_path, model, clipping):
    """Right padding, rows of 3 to 12 tokens in one batch (D′ drops the longest): GPT-2 (absolute positions), Llama
    (rotary), BERT classification; flat and per-layer clipping. No refusal, held exactly."""
    factory, data = {"gpt2": (gpt2, varlen_lm), "llama": (llama, varlen_lm), "bert": (bert, varlen_cls)}[model]
    assert_neighbours_within_c(tmp_path, build=collated_build(pad_collator("right"), model_factory=factory),
                               data_fn=data, clipping=clipping)


def test_transformers_lm_collator_with_a_left_padding_tokenizer_is_refused(tmp_path):
    """The ordinary way to left-pad: a tokenizer with padding_side='left' and transformers' LM collator."""
    from transformers import DataCollatorForLanguageModeling

    tok = word_tokenizer()
    tok.padding_side = "left"
    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    trainer = collated_build(collator)(neighbour_args(tmp_path, N), varlen_lm(N).remove_columns("labels"))
    assert_refused_before_release(trainer, ValueError, "Left padding with GPT2LMHeadModel")


def test_left_padding_with_positions_from_the_layout_breaks_the_bound_unchecked(tmp_path, monkeypatch):
    """Why it is refused: with both checks switched off, removing the longest row moves the update by 2 × C."""
    import hf_dp.trainer

    monkeypatch.setattr(hf_dp.trainer, "check_known_dependences", lambda *a, **k: None)
    monkeypatch.setattr(DPTrainer, "_check_examples_alone", lambda *a, **k: None)
    sigma_d, sigma_d2 = summed_updates(tmp_path, build=collated_build(pad_collator("left")), data_fn=varlen_lm)
    assert distance(sigma_d, sigma_d2) > 1.5 * C


def test_left_padding_with_positions_from_the_layout_is_refused(tmp_path):
    """GPT-2 takes position_ids = cache_position unless given: left-padded, an example's positions depend on the
    longest row of its batch. Refused at train start, with the ways out."""
    trainer = collated_build(pad_collator("left"))(neighbour_args(tmp_path, N), varlen_lm(N))
    assert_refused_before_release(trainer, ValueError, "Left padding.*padding_side = 'right'.*position_ids")


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return tiny_llama().double()


@pytest.mark.parametrize("model_factory, position_ids", [(gpt2, True), (llama, False)], ids=["gpt2", "llama"])
def test_left_padding_with_positions_of_the_example_holds(tmp_path, model_factory, position_ids):
    """Left padding holds exactly when the positions are the example's own: GPT-2 given position_ids from the
    attention mask; Llama's rotary positions are relative (no refusal at train start). The first label is -100."""
    collator = pad_collator("left", position_ids=position_ids, first_label=False)
    assert_neighbours_within_c(tmp_path, build=collated_build(collator, model_factory=model_factory),
                               data_fn=varlen_lm)


def test_left_padded_causal_lm_predicting_its_first_token_from_padding_is_refused(tmp_path):
    """Left-padded, a causal LM's last padding position predicts the example's first token: a loss term the example
    alone does not have, present only when a longer row is in the batch (as with transformers'
    DataCollatorForLanguageModeling and padding_side='left'). Positions are right (Llama: relative): only the
    counterfactual check sees it, at the first step, before anything is released."""
    trainer = collated_build(pad_collator("left"), model_factory=llama)(neighbour_args(tmp_path, N), varlen_lm(N))
    assert_refused_before_release(trainer, UnsupportedLayerError,
                                  "loss depends on the other rows.*left-padded.*predicts the first token.*right")


def dynamic_rope_llama(rope_type: str = "dynamic", limit: int = 8) -> torch.nn.Module:
    """Llama whose rope scaling changes with the batch's largest position beyond ``limit`` (rows here have up to 12
    tokens)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = tiny_llama().config.to_dict()
    extra = {"original_max_position_embeddings": limit, "short_factor": [1.0] * 4, "long_factor": [2.0] * 4} \
        if rope_type == "longrope" else {}
    cfg.update(max_position_embeddings=limit if rope_type == "dynamic" else 32,
               rope_parameters={"rope_type": rope_type, "factor": 2.0, "rope_theta": 10000.0, **extra})
    return LlamaForCausalLM(LlamaConfig(**cfg)).double()


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_rope_scaling_from_the_longest_row_is_refused_before_training(tmp_path, rope_type):
    trainer = collated_build(pad_collator("right"), model_factory=lambda: dynamic_rope_llama(rope_type))(
        neighbour_args(tmp_path, N), varlen_lm(N))
    assert_refused_before_release(trainer, ValueError, f"rope_type='{rope_type}'.*exceeds 8 .*reach 12 positions"
                                                       ".*fixed rope scaling.*truncate every row to at most 8")


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_rope_scaling_that_no_batch_reaches_holds(tmp_path, rope_type):
    """The same scalings with rows (12 tokens at most) that never reach the length where they start (16): no batch
    changes the frequencies, nothing is refused, and the update is held exactly."""
    assert_neighbours_within_c(tmp_path, data_fn=varlen_lm, build=collated_build(
        pad_collator("right"), model_factory=lambda: dynamic_rope_llama(rope_type, limit=16)))


def test_rope_scaling_dependence_is_also_caught_by_the_counterfactual(tmp_path, monkeypatch):
    """Without the configuration refusal, the counterfactual check itself sees the dynamic scaling (the short rows'
    frequencies change with the longest row of their batch)."""
    import hf_dp.trainer

    monkeypatch.setattr(hf_dp.trainer, "check_known_dependences", lambda *a, **k: None)
    trainer = collated_build(pad_collator("right"), model_factory=dynamic_rope_llama)(neighbour_args(tmp_path, N),
                                                                                     varlen_lm(N))
    assert_refused_before_release(trainer, UnsupportedLayerError, "loss depends on the other rows")


def next_row_token_collator(features):
    """Mixes rows but keeps the row count: each row's last token is replaced by the next row's first token."""
    batch = pad_collator("right")(features)
    ids = batch["input_ids"]
    last = batch["attention_mask"].sum(1) - 1
    ids[torch.arange(len(ids)), last] = ids.roll(-1, 0)[:, 0]
    return batch


def mixup_collator(features):
    """Random mixup on the tokens: each row takes the tokens of a random partner row at random positions."""
    batch = pad_collator("right", mask=False)(features)
    ids = batch["input_ids"]
    partner = torch.randperm(len(ids))
    take = torch.rand(ids.shape) < 0.3
    batch["input_ids"] = torch.where(take, ids[partner], ids)
    return batch


@pytest.mark.parametrize("collator", [next_row_token_collator, mixup_collator], ids=["next_row_token", "mixup"])
def test_collator_that_mixes_rows_is_refused(tmp_path, collator):
    trainer = collated_build(collator, model_factory=bert)(neighbour_args(tmp_path, N), varlen_cls(N))
    assert_refused_before_release(trainer, UnsupportedLayerError, "collator mixes rows")


def test_collator_whose_padding_changes_the_loss_is_refused(tmp_path):
    """All-ones attention mask: BERT attends to the padding, so an example's loss depends on its batch's longest
    row."""
    trainer = collated_build(pad_collator("right", mask=False), model_factory=bert)(neighbour_args(tmp_path, N),
                                                                                   varlen_cls(N))
    assert_refused_before_release(trainer, UnsupportedLayerError, "loss depends on the other rows")


def test_collator_that_trains_on_its_padding_is_refused(tmp_path):
    """Labels padded with the pad token instead of -100 (labels = input_ids after padding): each example is also
    trained to predict padding, as many tokens as its batch's longest row adds."""
    trainer = collated_build(pad_collator("right", label_pad=0))(neighbour_args(tmp_path, N), varlen_lm(N))
    assert_refused_before_release(trainer, UnsupportedLayerError, "loss depends on the other rows")


def padded_length_mean_loss(outputs, labels):
    """A per-example loss that averages over the padded length (a common slip): it depends on the longest row."""
    logits = outputs.logits
    target = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    tokens = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100, reduction="none")
    return tokens.sum(1) / labels.shape[1]


def test_lucky_first_batch_of_equal_lengths_is_caught_by_the_hard_batch(tmp_path):
    """The first micro-batch holds two rows of equal length (no padding: the per-example loss normalised by the
    padded length looks right on it); the batch of the training set's shortest and longest rows exposes it."""
    data = varlen_lm(N, lengths=[5, 5, 5, 5, 12])
    trainer = collated_build(pad_collator("right"), per_example_loss=padded_length_mean_loss)(
        neighbour_args(tmp_path, 4, ga=2), data)
    assert_refused_before_release(trainer, UnsupportedLayerError, "shortest and longest rows")


def word_tokenizer():
    """A word-level tokenizer over the 61 ids of the tiny models: [PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(5, 61)]
    vocab = {w: i for i, w in enumerate(words)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")),
                                   pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                                   mask_token="[MASK]")


class Recording:
    """Wraps a collator and keeps every batch it returns (the training batches, and the checks' collations)."""

    def __init__(self, collator):
        self.collator, self.batches = collator, []

    def __call__(self, features):
        batch = self.collator(features)
        self.batches.append({k: v.clone() for k, v in batch.items()})
        return batch


@pytest.mark.parametrize("seed", [None, 3], ids=["global_rng", "own_generator"])
def test_mlm_masking_collator_is_random_per_row_and_the_update_equals_the_oracle(tmp_path, seed):
    """transformers' MLM collator masks each row independently at random (from the global generator, or its own with
    ``seed=``): it passes the checks (the collator keeps rows apart under the same seed; each row, padding removed,
    scores as in the batch) and the update is exactly Σ_i clip(∇L_i) over the rows as masked in the step, L_i being
    BertForMaskedLM's own loss on a batch of one."""
    import copy

    from helpers import single_example_loss, tiny_bert_mlm
    from transformers import DataCollatorForLanguageModeling

    torch.manual_seed(0)
    model = tiny_bert_mlm().double()
    start = copy.deepcopy(model)
    collator = Recording(DataCollatorForLanguageModeling(word_tokenizer(), mlm=True, mlm_probability=0.5, seed=seed))
    data = varlen_lm(N).remove_columns("labels")
    trainer = DPTrainer(model=model, args=neighbour_args(tmp_path, N), train_dataset=data, data_collator=collator)
    before = params(model)
    trainer.train()
    # the step's batch (q = 1): the first of N rows (the first-step checks collate the same rows again afterwards)
    step = next(b for b in collator.batches if b["input_ids"].shape[0] == N)
    assert bool((step["labels"] != -100).any()) and bool((step["input_ids"] == 4).any())  # masked at random
    oracle = {n: torch.zeros_like(p) for n, p in start.named_parameters()}
    for i in range(N):
        keep = step["attention_mask"][i].bool()
        row = {k: v[i][keep][None] for k, v in step.items()}
        if not bool((row["labels"] != -100).any()):
            continue  # no masked token: no loss
        start.zero_grad(set_to_none=True)
        single_example_loss(start, row).backward()
        grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in start.named_parameters()}
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
        for n in oracle:
            oracle[n] += min(1.0, C / (norm + 1e-6)) * grads[n]
    for n, p in model.named_parameters():
        torch.testing.assert_close((before[n] - p.detach()) * N, oracle[n], rtol=1e-6, atol=1e-12, msg=n)


def test_mlm_masking_collator_still_catches_a_loss_that_depends_on_padding(tmp_path):
    """With a random collator each example is compared with its own row of the batch, padding removed by its
    attention mask (the same random draw): a per-example loss averaged over the padded length is still refused."""
    from helpers import tiny_bert_mlm
    from transformers import DataCollatorForLanguageModeling

    def padded_mean(outputs, labels):
        tokens = torch.nn.functional.cross_entropy(outputs.logits.transpose(1, 2), labels, reduction="none")
        return tokens.sum(1) / labels.shape[1]

    torch.manual_seed(0)
    trainer = DPTrainer(model=tiny_bert_mlm().double(), args=neighbour_args(tmp_path, N), per_example_loss=padded_mean,
                        train_dataset=varlen_lm(N).remove_columns("labels"),
                        data_collator=DataCollatorForLanguageModeling(word_tokenizer(), mlm_probability=0.5))
    assert_refused_before_release(trainer, UnsupportedLayerError, "loss depends on the other rows.*collator is random")


def test_batch_dependent_rope_is_found_in_every_spelling():
    from transformers import Gemma3TextConfig, LlamaConfig, PretrainedConfig

    from hf_dp.counterfactual import batch_dependent_rope

    assert batch_dependent_rope(LlamaConfig()) is None
    assert batch_dependent_rope(LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0})) == "dynamic"
    assert batch_dependent_rope(LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 2.0})) is None
    per_layer = Gemma3TextConfig()
    assert batch_dependent_rope(per_layer) is None
    per_layer.rope_parameters["full_attention"]["rope_type"] = "dynamic"  # per attention type (Gemma 3)
    assert batch_dependent_rope(per_layer) == "dynamic"
    outer = PretrainedConfig()
    outer.text_config = LlamaConfig(rope_scaling={"type": "dynamic", "factor": 2.0})  # a sub-config, old key
    assert batch_dependent_rope(outer) == "dynamic"


def test_hard_batch_is_the_shortest_and_longest_rows():
    from hf_dp.counterfactual import hard_batch_indices

    rows = [{"input_ids": [1] * n} for n in [4, 2, 9, 5, 7]]
    assert hard_batch_indices(rows, size=2) == [1, 2]
    assert hard_batch_indices(rows, size=3) == [1, 2, 3]
    masked = [{"input_ids": [1] * 6, "attention_mask": [1] * n + [0] * (6 - n)} for n in [3, 6, 1]]  # pre-padded
    assert hard_batch_indices(masked, size=2) == [2, 1]


def test_longest_position_a_batch_can_reach():
    """Every row is scanned (Arrow column lengths), plus what the collator adds (here a BOS token)."""
    from hf_dp.counterfactual import longest_position, longest_row

    data = varlen_lm(N)  # rows of 3..12 tokens
    assert longest_row(data) == 12 == longest_row(data.select(range(N))) == longest_row(list(data))
    features = [data[0], data[2]]  # 3 and 5 tokens, collated with a BOS: 6 positions
    batch = {"input_ids": torch.zeros(2, 6, dtype=torch.long)}
    assert longest_position(data, features, batch) == 13
    assert longest_position(data, features, {"position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])}) == 12


def test_collator_randomness_and_row_isolation_as_functions():
    import os

    from hf_dp.counterfactual import check_collator_keeps_rows_apart, collator_randomness

    rows = [{"input_ids": [i + 2] * 4, "labels": i} for i in range(4)]
    plain = pad_collator("right")

    def masking(features):  # per-row random masking (MLM-like)
        batch = plain(features)
        batch["input_ids"] = torch.where(torch.rand(batch["input_ids"].shape) < 0.5, 4, batch["input_ids"])
        return batch

    def os_random(features):  # randomness no seed controls (a whole row of draws: two calls never agree by chance)
        batch = plain(features)
        row = batch["input_ids"][0]
        row[:] = torch.tensor(list(os.urandom(row.numel())), dtype=row.dtype) % 50 + 2
        return batch

    class OwnGenerator:  # per-row masking drawn from the collator's own generator
        def __init__(self):
            self.generator = torch.Generator().manual_seed(5)

        def __call__(self, features):
            batch = plain(features)
            draw = torch.rand(batch["input_ids"].shape, generator=self.generator)
            batch["input_ids"] = torch.where(draw < 0.5, 4, batch["input_ids"])
            return batch

    own = OwnGenerator()
    before = own.generator.get_state()
    assert collator_randomness(own, rows) == "seeded"
    check_collator_keeps_rows_apart(own, rows)
    assert torch.equal(before, own.generator.get_state())  # its draws in training are not shifted by the checks
    assert collator_randomness(plain, rows) == "none"
    assert collator_randomness(masking, rows) == "seeded"
    assert collator_randomness(os_random, rows) == "unseeded"
    state = torch.get_rng_state()
    check_collator_keeps_rows_apart(masking, rows)
    check_collator_keeps_rows_apart(plain, rows)
    assert torch.equal(state, torch.get_rng_state())  # the checks never shift the training run's random stream
    with pytest.raises(UnsupportedLayerError, match="row 0's 'input_ids'"):
        check_collator_keeps_rows_apart(next_row_token_collator, rows)


@pytest.mark.parametrize("alone, match", [
    (lambda loss: loss, None),
    (lambda loss: loss * 1.01, "example 1's loss is"),  # another value
    (lambda loss: loss + 0.5 * (loss - loss.detach()), "example 1's gradient norm"),  # same value, longer gradient
    (lambda loss: 2 * loss.detach() - loss, "clipped sum of 0.weight differs"),  # same value and norm, opposite
], ids=["same", "loss", "norm", "direction"])
def test_counterfactual_compares_loss_norm_and_the_whole_vector(alone, match):
    """ClippingEngine.check_counterfactual on a two-layer net: each comparison catches what the others cannot."""
    from hf_dp.clipping.engine import ClippingEngine

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    x = torch.randn(3, 3, dtype=torch.float64)
    engine = ClippingEngine(net)

    def losses(rows):
        return net(rows).squeeze(-1).pow(2)

    runs = {i: (lambda i=i: (alone if i == 1 else (lambda v: v))(losses(x[i:i + 1]))) for i in range(3)}
    check = lambda: engine.check_counterfactual(lambda: losses(x), 3, 3, runs, rtol=1e-6)  # noqa: E731
    if match is None:
        check()
    else:
        with pytest.raises(UnsupportedLayerError, match=match):
            check()
    assert all(p.grad is None for p in net.parameters())  # the check leaves .grad untouched
