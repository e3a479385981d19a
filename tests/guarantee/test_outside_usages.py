"""Ordinary Trainer usages found by an outside probe (session 10) that broke the guarantee, each closed by the invariant
it violated rather than by its name.

* The step released is the mechanism the accountant records (DESIGN invariants 4-6): q is read live from the
  arguments and the training set when a step is released, but the loader's sampler drew the step at the rate fixed
  when it was built; C is read at every chunk and for the noise. A callback changing the batch size, the
  accumulation, the training set, or C inside a step is refused before that step is released.
* The optimizer applies the DP release in ``optimizer.step()``: one that updates inside the backward pass (LOMO,
  transformers' ``*_layerwise`` optimizers) would train nothing while reporting ε; refused at train start.
* Each example's loss is formed from the logits (invariants 2, 9): a forward that returns only a batch loss (Liger
  Kernel's fused linear-cross-entropy) is refused with its cause.
* The counterfactual check compares each example with itself alone (invariant 12): a training set whose rows are
  random at each read (``set_transform`` augmentation) was refused with an untrue cause ("depends on the other rows
  of its batch"), because the check re-read other draws than the batch held; now compared with the same draw.
"""

from __future__ import annotations

import random
import sys
import types
import warnings

import pytest
import torch
from helpers import cls_dataset, lm_dataset, tiny_llama
from helpers.neighbours import N, bert, bert_data, neighbour_args, params
from helpers.runs import assert_refused_before_any_release
from transformers import TrainerCallback

from hf_dp import DPTrainer, UnsupportedLayerError


# ---------------------------------------------------------------------- the mechanism of a step
class ChangeAt(TrainerCallback):
    """At the ``at``-th ``event`` (``"step_end"`` or ``"substep_end"``), set ``args`` fields or the trainer's training
    set (``train_dataset=``): the usual way a user schedules a batch size, a clipping norm or a curriculum."""

    def __init__(self, trainer, event: str, at: int, **changes):
        self.trainer, self.event, self.at, self.changes, self.seen = trainer, event, at, changes, 0

    def _fire(self, args):
        self.seen += 1
        if self.seen == self.at:
            for k, v in self.changes.items():
                setattr(self.trainer if k == "train_dataset" else args, k, v)

    def on_step_end(self, args, state, control, **kwargs):
        if self.event == "step_end":
            self._fire(args)

    def on_substep_end(self, args, state, control, **kwargs):
        if self.event == "substep_end":
            self._fire(args)


def noisy_trainer(tmp_path, per_device: int = 8, ga: int = 1):
    """40 examples, expected batch 8 (q = 0.2), σ = 1, four steps."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = neighbour_args(tmp_path, per_device * ga, ga=ga, sigma=1.0, max_steps=4)
    return DPTrainer(model=bert(), args=args, train_dataset=cls_dataset(40, 3))


@pytest.mark.parametrize("change", [dict(per_device_train_batch_size=2), dict(gradient_accumulation_steps=1),
                                    dict(train_dataset=cls_dataset(400, 3))],
                         ids=["batch_size", "accumulation", "training_set"])
def test_sampling_rate_changed_during_train_is_refused_before_its_step(tmp_path, change):
    """Unchecked, a callback shrinking the batch (or growing the training set) after step 2 had the accountant record
    q = 0.05 (0.02) for steps the sampler still drew at q = 0.2: ε several times too small. Refused at step 3, before
    it is released; the two steps released were recorded at the q they were drawn with."""
    trainer = noisy_trainer(tmp_path, per_device=4, ga=2)
    trainer.add_callback(ChangeAt(trainer, "step_end", 2, **change))
    with pytest.raises(RuntimeError, match=r"drawn at sampling rate q = 0.2 .* would record q = "):
        trainer.train()
    assert [(r.sample_rate, r.steps) for r in trainer.accountant.history] == [(0.2, 2)]


def test_accumulation_changed_with_q_kept_is_refused_with_its_cause(tmp_path):
    """Batch size and accumulation changed together (4 x 2 -> 2 x 4: q unchanged) after step 1: the sampler still
    draws each step as 2 chunks while the Trainer runs 4 per step. It was refused at step 2 with an untrue cause ("a
    misalignment between hf_dp's sampler and the Trainer's loop ... please report it"; with loader workers the draws
    cut in two were discarded step after step). Now refused at step 2's start, naming gradient_accumulation_steps;
    step 1 was recorded at the q it was drawn with."""
    trainer = noisy_trainer(tmp_path, per_device=4, ga=2)
    trainer.add_callback(ChangeAt(trainer, "step_end", 1, per_device_train_batch_size=2, gradient_accumulation_steps=4))
    with pytest.raises(RuntimeError, match=r"gradient_accumulation_steps is 4, but .* draws each DP step as 2 chunk"):
        trainer.train()
    assert [(r.sample_rate, r.steps) for r in trainer.accountant.history] == [(0.2, 1)]


def test_clipping_norm_changed_between_chunks_is_refused_and_between_steps_holds(tmp_path):
    """C shrunk after the first of two accumulation chunks: the first chunk's examples were clipped at 100, the noise
    would be σ·1e-4. Refused before the step is released (nothing was). The same change between steps: every chunk
    of a step and its noise use one C, the accountant's σ is unchanged — it runs."""
    trainer = noisy_trainer(tmp_path / "in", per_device=4, ga=2)
    trainer.args.per_sample_max_grad_norm = 100.0
    trainer.add_callback(ChangeAt(trainer, "substep_end", 1, per_sample_max_grad_norm=1e-4))
    before = params(trainer.model)
    with pytest.raises(RuntimeError, match="per_sample_max_grad_norm changed from 100.0 to 0.0001 inside a DP step"):
        trainer.train()
    assert trainer.accountant.steps == 0 and all(torch.equal(p, before[k]) for k, p in params(trainer.model).items())

    trainer = noisy_trainer(tmp_path / "between", per_device=4, ga=2)
    trainer.add_callback(ChangeAt(trainer, "step_end", 2, per_sample_max_grad_norm=1e-4))
    trainer.train()
    assert [(r.noise_multiplier, r.sample_rate, r.steps) for r in trainer.accountant.history] == [(1.0, 0.2, 4)]


# ---------------------------------------------------------------------- the optimizer applies the release
class FusedBackwardSGD(torch.optim.SGD):
    """LOMO's interface (``lomo_optim.Lomo``): the update runs in ``fused_backward(loss, lr)`` (hooks on the
    parameters during the backward) and ``step()`` does nothing; transformers' Trainer calls ``fused_backward``."""

    def fused_backward(self, loss, lr):  # pragma: no cover - never reached under DP
        loss.backward()

    def step(self, closure=None):
        return None


def layerwise_optimizer(model):
    """What transformers builds for ``optim="galore_adamw_layerwise"`` (and every ``*_layerwise`` optim): one
    optimizer per parameter, stepped in a post-accumulate-grad hook, behind a ``LayerWiseDummyOptimizer``."""
    from transformers.trainer_pt_utils import LayerWiseDummyOptimizer

    optimizer_dict = {p: torch.optim.SGD([p], lr=1.0) for p in model.parameters() if p.requires_grad}

    def hook(p):
        optimizer_dict[p].step()
        optimizer_dict[p].zero_grad()

    for p in optimizer_dict:
        p.register_post_accumulate_grad_hook(hook)
    return LayerWiseDummyOptimizer(optimizer_dict=optimizer_dict, lr=1.0)


@pytest.mark.parametrize("make", [lambda m: FusedBackwardSGD(m.parameters(), lr=1.0), layerwise_optimizer],
                         ids=["lomo_fused_backward", "layerwise"])
def test_optimizer_updating_inside_the_backward_is_refused_at_train_start(tmp_path, make):
    """Unchecked, both ran: the DP release was written to .grad, ``step()`` did nothing, no parameter moved, and the
    run reported ε for a model it never trained."""
    model = bert()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = neighbour_args(tmp_path, 4, sigma=1.0)
    trainer = DPTrainer(model=model, args=args, train_dataset=cls_dataset(4, 3), optimizers=(make(model), None))
    before = params(model)
    with pytest.raises(ValueError, match=r"updates the parameters inside the backward pass, not in optimizer.step"):
        trainer.train()
    assert trainer.accountant.steps == 0 and all(torch.equal(p, before[k]) for k, p in params(model).items())


# ---------------------------------------------------------------------- the loss is formed from the logits
def batch_loss_forward(model):
    """Liger Kernel's ``lce_forward`` in training with labels: the hidden states go straight into a fused
    linear-cross-entropy, the batch's mean loss is returned and the logits are not (``skip_logits``)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    original = model.forward

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        if labels is None or not self.training:
            return original(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        loss = torch.nn.functional.cross_entropy(self.lm_head(hidden[:, :-1]).flatten(0, 1), labels[:, 1:].flatten())
        return CausalLMOutputWithPast(loss=loss, logits=None)

    model.forward = types.MethodType(forward, model)
    return model


def test_forward_without_logits_is_refused_with_its_cause(tmp_path, monkeypatch):
    """``use_liger_kernel=True`` (liger installed: a stand-in that patches the forward as Liger does) is refused at
    construction; the same forward patched by hand fails at the first step, before any release, saying that the
    model returned no logits (it was a bare ``KeyError: 'logits'``)."""
    import transformers.integrations.liger as liger

    monkeypatch.setattr(liger, "is_liger_kernel_available", lambda: True)
    fake = types.ModuleType("liger_kernel.transformers")
    fake._apply_liger_kernel_to_instance = lambda model, **kw: batch_loss_forward(model)
    monkeypatch.setitem(sys.modules, "liger_kernel", types.SimpleNamespace(transformers=fake))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = neighbour_args(tmp_path, 4, use_liger_kernel=True)
    with pytest.raises(ValueError, match="use_liger_kernel=True .* no logits .* lm_loss_chunk_size"):
        DPTrainer(model=tiny_llama().double(), args=args, train_dataset=lm_dataset(4))

    model = batch_loss_forward(tiny_llama().double())
    trainer = DPTrainer(model=model, args=neighbour_args(tmp_path, 4), train_dataset=lm_dataset(4))
    before = params(model)
    with pytest.raises(ValueError, match="has no logits"):
        trainer.train()
    assert trainer.accountant.steps == 0 and all(torch.equal(p, before[k]) for k, p in params(model).items())


@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_per_example_loss_reduced_over_the_batch_is_refused_with_its_cause(tmp_path, reduce):
    """The commonest mistake in a custom ``per_example_loss``: returning the batch's mean. It was refused, but with an
    untrue cause ("the model mixes examples ... find the layer that computes across the batch"): the first-step check
    saw the 1/B-scaled gradients before anything read the loss's shape. Now the shape is checked where every
    per-example loss is produced, first."""

    def batch_loss(outputs, labels):
        ce = torch.nn.functional.cross_entropy(outputs.logits, labels, reduction="none")
        return getattr(ce, reduce)()

    trainer = DPTrainer(model=bert(), args=neighbour_args(tmp_path, N), train_dataset=bert_data(N),
                        per_example_loss=batch_loss)
    assert_refused_before_any_release(trainer, r"one loss per example.*returned \(\) — a loss reduced over the whole "
                                               r"batch")


def test_per_example_loss_squeezed_for_one_example_trains_exactly(tmp_path):
    """A per-example loss ending in ``.squeeze()`` returns () on a micro-batch of one example (each example is run
    alone by the counterfactual check; a Poisson micro-batch may hold one). There a scalar IS that example's loss
    whatever the reduction, so it is taken as shape (1,) (``losses.check_loss_per_example``): with one row per
    micro-batch the step equals the oracle (the model's own loss on a batch of one, clipped and summed). A scalar on
    a micro-batch of several rows stays refused (the test above). Session 10's first version refused it at the first
    step (and, where the counterfactual check is skipped, mid-run on a Poisson micro-batch of one)."""
    from helpers.runs import check_exact

    def squeezed(outputs, labels):
        return torch.nn.functional.cross_entropy(outputs.logits, labels, reduction="none").squeeze()

    check_exact(bert(), bert_data(4), tmp_path, ga=4, per_example_loss=squeezed)


# ---------------------------------------------------------------------- a training set whose rows are random
def augmented(m: int):
    """``bert_data(m)`` with a random augmentation at each read (``set_transform``, as the transformers image
    classification example does with random crops and flips): one of the first two tokens replaced at random."""
    data = bert_data(m)

    def replace_a_token(batch):
        ids = [list(row) for row in batch["input_ids"]]
        for row in ids:
            row[random.randrange(1, 3)] = random.randrange(5, 60)
        return {"input_ids": ids, "attention_mask": batch["attention_mask"], "labels": batch["labels"]}

    data.set_transform(replace_a_token)
    return data


def test_random_transform_of_the_training_set_trains_the_rows_as_drawn(tmp_path):
    """Unfixed, refused at the first step: "example 0's gradient norm is 0.9305 in the batch but 0.9305 alone" — the
    counterfactual re-read the rows and got other draws. Now the re-read is found random and each example is compared
    with its own row of the batch (the same draw). The update is exactly Σ_i clip_C(∇L_i) / N over the rows as the
    step drew them, L_i being the model's own loss on a batch of one (σ = 0, q = 1)."""
    import copy

    from helpers.neighbours import C
    from helpers.oracle import flat_clipped_sum, per_example_grads
    from transformers import default_data_collator

    batches = []

    def recording(features):
        batch = default_data_collator(features)
        batches.append({k: v.clone() for k, v in batch.items()})
        return batch

    model = bert()
    start = copy.deepcopy(model)
    trainer = DPTrainer(model=model, args=neighbour_args(tmp_path, N), train_dataset=augmented(N),
                        data_collator=recording)
    before = params(model)
    trainer.train()
    step = next(b for b in batches if b["input_ids"].shape[0] == N)  # the step's batch (q = 1: all N rows)
    rows = [{k: v[i] for k, v in step.items()} for i in range(N)]
    expected = flat_clipped_sum(per_example_grads(start, rows), C)
    assert trainer.accountant.steps == 1 and any(float(e.abs().max()) > 0 for e in expected.values())
    for n, p in model.named_parameters():
        torch.testing.assert_close((before[n] - p.detach()) * N, expected[n], rtol=1e-6, atol=1e-12, msg=n)


def test_random_transform_still_catches_a_loss_that_mixes_rows(tmp_path):
    """Compared with its own row of the batch, an example whose loss reads the other rows (a batch mean of the logits)
    is still refused before any release, and the message says the training set is random."""

    def mixes_rows(outputs, labels):
        ce = torch.nn.functional.cross_entropy(outputs.logits, labels, reduction="none")
        return ce + 0.1 * outputs.logits.mean()

    trainer = DPTrainer(model=bert(), args=neighbour_args(tmp_path, N), train_dataset=augmented(N),
                        per_example_loss=mixes_rows)
    assert_refused_before_any_release(trainer, "other rows.*training set is random", UnsupportedLayerError)


# ---------------------------------------------------------------- a layer the generic fallback cannot differentiate
def test_adapter_whose_backward_torch_func_cannot_run_is_refused_naming_it(tmp_path):
    """PEFT's SHiRA (sparse high-rank adapter) trains a sparse delta that no rule covers; the generic fallback re-runs
    its layer per example, and torch.func cannot run the sparse backward. That escaped as torch's bare
    ``NotImplementedError: Could not run 'aten::view' ... 'SparseCPU' backend``; it is now a refusal before any
    release that names the layer, the parameter and the way out."""
    from peft import ShiraConfig, TaskType, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(tiny_llama(), ShiraConfig(task_type=TaskType.CAUSAL_LM, r=2, target_modules=["q_proj"]))
    trainer = DPTrainer(model=model.double(), args=neighbour_args(tmp_path, 4), train_dataset=lm_dataset(4))
    assert_refused_before_any_release(trainer, r"q_proj.*shira_weight.*differentiating it on one example at a time "
                                               r"under torch.func.vmap failed.*Freeze", UnsupportedLayerError)


class Gate(torch.nn.Module):
    """A layer of one's own (no rule): ``x · σ(w)``, its per-example gradient from the generic fallback (vmap)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3))

    def forward(self, x):
        return x * torch.sigmoid(self.w)


@pytest.mark.parametrize("where", ["first_step_rerun", "gradients"])
def test_running_out_of_memory_in_the_fallback_is_not_a_refusal_of_the_layer(tmp_path, monkeypatch, where):
    """The fallback's per-example vmap instantiates B × numel gradients: the place a large Poisson batch runs out of
    memory. Every failure there was turned into a refusal of the layer ("torch.func does not support an operation
    ... Freeze these parameters"), an untrue cause, at whichever step the batch was large, and
    ``auto_find_batch_size`` (which retries on out-of-memory errors only) could not retry. Now re-raised as it is
    (at the first step's re-run of the layer and at every step's per-example gradients)."""
    from helpers.runs import train_toy

    import hf_dp.clipping.fallback as fallback

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    real = fallback.vmap

    def vmap(fn, *args, **kwargs):  # the first-step re-run maps in_dims=(None, 0); the gradients' vmap maps all
        return oom if ("in_dims" in kwargs) == (where == "first_step_rerun") else real(fn, *args, **kwargs)

    monkeypatch.setattr(fallback, "vmap", vmap)
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        train_toy(Gate(), tmp_path)
