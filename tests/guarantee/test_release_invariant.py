"""Only the DP release changes what is released (DESIGN invariant 10, issue 22), and refusals that name the cause.

Between two DP steps nothing that is saved, pushed or used by the next step may change except by the optimizer applying
the gradients the DP step wrote: every parameter (trainable or frozen), every buffer (persistent or not), every tensor
in the optimizer's param groups (in the model or not). Each usage below breaks that in a different place (inside the
forward, in the loss, in a callback before / after the optimizer step, before a save) and must be refused before
anything is applied or saved, naming the tensor; changes declared with ``hf_dp.post_processing()`` between steps hold.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F
from helpers import cls_dataset, quick_dp_args, tiny_bert
from transformers import TrainerCallback

from hf_dp import DPTrainer, UnsupportedLayerError, post_processing
from hf_dp.guarantee import ReleasedStateGuard


def args(tmp_path, **kw):
    """q = 1 (4 of 4 examples), fixed dp_seed, two steps."""
    return quick_dp_args(tmp_path, **{"per_device_train_batch_size": 4, "max_steps": 2, "dp_seed": 0,
                                      "logging_strategy": "no", **kw})


def bert():
    torch.manual_seed(0)
    return tiny_bert()


def data():
    return cls_dataset(4, 3)


def refused(trainer, *needles, steps_released: int = 0):
    """``train()`` raises naming every needle, and no step beyond ``steps_released`` was released."""
    with pytest.raises(RuntimeError) as err:
        trainer.train()
    for needle in needles:
        assert needle in str(err.value), str(err.value)
    assert trainer.accountant.steps <= steps_released + 1  # the refused step may be counted, never applied
    return str(err.value)


# ---------------------------------------------------------------------- inside the DP step
def test_frozen_layer_rewriting_its_weight_in_forward_is_refused(tmp_path):
    model = bert()
    norm = model.bert.embeddings.LayerNorm
    norm.requires_grad_(False)

    def rewrite(module, inputs, output):  # a frozen layer that learns from the batch it sees
        with torch.no_grad():
            module.weight.add_(inputs[0].detach().mean())

    norm.register_forward_hook(rewrite)
    trainer = DPTrainer(model=model, args=args(tmp_path), train_dataset=data())
    refused(trainer, "inside a DP step", "bert.embeddings.LayerNorm.weight (frozen parameter)")
    assert trainer.state.global_step == 0


@pytest.mark.parametrize("persistent", [True, False])
def test_frozen_layer_writing_a_buffer_is_refused(tmp_path, persistent):
    """A persistent buffer is also refused by the engine's per-micro-batch check (``ClippingEngine.record``); a
    non-persistent one (not in the checkpoint, but used by the next step) only by the released-state guard."""
    model = bert()
    emb = model.bert.embeddings
    emb.register_buffer("seen", torch.zeros(16), persistent=persistent)

    def record(module, inputs, output):
        module.seen.copy_(output.detach().mean((0, 1)))

    emb.register_forward_hook(record)
    trainer = DPTrainer(model=model, args=args(tmp_path), train_dataset=data())
    with pytest.raises((RuntimeError, UnsupportedLayerError), match="changed (inside|during) a DP step") as err:
        trainer.train()
    assert "bert.embeddings.seen" in str(err.value)
    assert trainer.state.global_step == 0


def test_buffer_replaced_from_the_batch_is_refused(tmp_path):
    """A cache re-registered with the batch's shape (as dynamic rotary scaling re-registers ``inv_freq`` when a batch
    is longer than the cache): a new tensor, seen by identity."""
    model = bert()
    emb = model.bert.embeddings
    emb.register_buffer("cache", torch.zeros(1), persistent=False)

    def recache(module, inputs, output):
        if output.shape[1] > module.cache.numel():
            module.register_buffer("cache", torch.zeros(output.shape[1]), persistent=False)

    emb.register_forward_hook(recache)
    trainer = DPTrainer(model=model, args=args(tmp_path), train_dataset=data())
    refused(trainer, "inside a DP step", "bert.embeddings.cache (non-persistent buffer) (new or replaced)")


def test_frozen_embedding_renormalised_by_the_batch_is_refused(tmp_path):
    """A frozen ``nn.Embedding(max_norm=...)`` renormalises, in place, the rows of the tokens the batch holds: which
    tokens the private batch contained would be written into the released weights. (A trainable one is refused by
    its layer rule at construction.)"""
    model = bert()
    emb = model.bert.embeddings.word_embeddings
    emb.requires_grad_(False)
    emb.max_norm = 1e-3
    trainer = DPTrainer(model=model, args=args(tmp_path), train_dataset=data())
    refused(trainer, "inside a DP step", "bert.embeddings.word_embeddings.weight (frozen parameter)")


def test_post_processing_inside_a_dp_step_is_refused(tmp_path):
    def loss(outputs, labels):
        with post_processing():
            pass
        return F.cross_entropy(outputs.logits, labels, reduction="none")

    trainer = DPTrainer(model=bert(), args=args(tmp_path), train_dataset=data(), per_example_loss=loss)
    refused(trainer, "post_processing() inside a DP step")


# ---------------------------------------------------------------------- tensors outside the model
class AddScaleOptimizer(torch.optim.SGD):
    """What ``optimizer_cls_and_kwargs`` can build: the model's parameter groups plus one more tensor."""

    scale: torch.Tensor | None = None

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.add_param_group({"params": [self.scale]})


@pytest.mark.parametrize("how", ["optimizers", "create_optimizer", "optimizer_cls_and_kwargs"])
def test_learnable_scalar_outside_the_model_is_refused(tmp_path, how):
    """A temperature handed to the optimizer and used in the loss gets the unclipped gradient of Σ_i L_i."""
    model = bert()
    scale = torch.nn.Parameter(torch.ones(()))

    def loss(outputs, labels):
        return F.cross_entropy(outputs.logits * scale, labels, reduction="none")

    kw = dict(args=args(tmp_path), train_dataset=data(), per_example_loss=loss)
    if how == "optimizers":
        opt = torch.optim.SGD([*model.parameters(), scale], lr=0.1)
        trainer = DPTrainer(model=model, optimizers=(opt, None), **kw)
    elif how == "create_optimizer":
        class WithScale(DPTrainer):
            def create_optimizer(self, *a, **k):
                opt = super().create_optimizer(*a, **k)
                opt.add_param_group({"params": [scale]})
                return opt

        trainer = WithScale(model=model, **kw)
    else:
        AddScaleOptimizer.scale = scale
        trainer = DPTrainer(model=model, optimizer_cls_and_kwargs=(AddScaleOptimizer, {"lr": 0.1}), **kw)
    refused(trainer, "did not write", "['params']", "not part of the model")
    assert float(scale) == 1.0  # never applied


def test_optimizer_tensor_updated_in_place_by_the_loss_is_refused(tmp_path):
    """A tensor in the optimizer's param groups (no gradient) that the loss updates from the batch: used by the next
    step and saved with the optimizer's state."""
    model = bert()
    running = torch.zeros(())
    opt = torch.optim.SGD([{"params": list(model.parameters())}, {"params": [running]}], lr=0.1)

    def loss(outputs, labels):
        losses = F.cross_entropy(outputs.logits, labels, reduction="none")
        running.add_(losses.detach().mean())
        return losses

    trainer = DPTrainer(model=model, args=args(tmp_path), train_dataset=data(), per_example_loss=loss,
                        optimizers=(opt, None))
    refused(trainer, "inside a DP step", "optimizer.param_groups[1]['params'][0]")


# ---------------------------------------------------------------------- between steps: callbacks
class Shrink(TrainerCallback):
    """Changes a weight at one callback event, declared as post-processing or not."""

    def __init__(self, event: str, declared: bool, frozen: bool = False):
        self.event, self.declared, self.frozen = event, declared, frozen
        setattr(self, event, self._change)

    def _change(self, args, state, control, model=None, **kwargs):
        weight = (model.bert.embeddings.LayerNorm if self.frozen else model.classifier).weight
        with torch.no_grad(), post_processing() if self.declared else contextlib.nullcontext():
            weight.mul_(0.5)


EVENT_MESSAGE = {"on_step_begin": "between two DP steps", "on_step_end": "between two DP steps",
                 "on_pre_optimizer_step": "before optimizer.step()", "on_optimizer_step": "between two DP steps"}


@pytest.mark.parametrize("event", list(EVENT_MESSAGE))
def test_callback_changing_weights_between_steps_is_refused(tmp_path, event):
    """A change after the last optimizer step and before the next (or, ``on_pre_optimizer_step``, after the release
    and before ``optimizer.step()``: seen by the optimizer's pre-step hook, after every callback)."""
    trainer = DPTrainer(model=bert(), args=args(tmp_path), train_dataset=data(), callbacks=[Shrink(event, False)])
    refused(trainer, EVENT_MESSAGE[event], "classifier.weight (trainable parameter)", "hf_dp.post_processing()",
            steps_released=1)


def test_callback_changing_a_frozen_weight_before_the_optimizer_step_is_refused(tmp_path):
    model = bert()
    model.bert.embeddings.LayerNorm.requires_grad_(False)
    trainer = DPTrainer(model=model, args=args(tmp_path), train_dataset=data(),
                        callbacks=[Shrink("on_pre_optimizer_step", False, frozen=True)])
    refused(trainer, "bert.embeddings.LayerNorm.weight (frozen parameter)")


@pytest.mark.parametrize("event", list(EVENT_MESSAGE))
def test_callback_changes_declared_as_post_processing_hold(tmp_path, event):
    trainer = DPTrainer(model=bert(), args=args(tmp_path), train_dataset=data(), callbacks=[Shrink(event, True)])
    trainer.train()
    assert trainer.accountant.steps == 2 and trainer._state_guard.post_processing_blocks == 2


class WeightEMA(TrainerCallback):
    """An exponential moving average of the weights, swapped in after every step (a function of the releases)."""

    def __init__(self, decay: float = 0.5):
        self.decay, self.ema = decay, None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        with torch.no_grad(), post_processing():
            params = dict(model.named_parameters())
            if self.ema is None:
                self.ema = {n: p.detach().clone() for n, p in params.items()}
            for n, p in params.items():
                self.ema[n].mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)
                p.copy_(self.ema[n])


def test_weight_ema_declared_as_post_processing_holds_and_is_what_is_saved(tmp_path):
    ema = WeightEMA()
    trainer = DPTrainer(model=bert(), args=args(tmp_path, save_strategy="steps", save_steps=1), train_dataset=data(),
                        callbacks=[ema])
    trainer.train()
    assert trainer.accountant.steps == 2
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p.detach(), ema.ema[n])
    assert os.path.isfile(os.path.join(tmp_path, "checkpoint-2", "model.safetensors"))


class SwapOptimizer(torch.optim.SGD):
    """Like a schedule-free optimizer: ``eval()`` swaps the weights, in place, to others computed from its state;
    ``train()`` swaps them back (the Trainer calls ``eval()`` before evaluating, the DP step ``train()``)."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.mode = "train"

    @torch.no_grad()
    def eval(self):
        if self.mode == "train":
            for p in (p for g in self.param_groups for p in g["params"]):
                self.state[p]["y"] = p.detach().clone()
                p.mul_(0.5)
            self.mode = "eval"

    @torch.no_grad()
    def train(self):
        if self.mode == "eval":
            for p in (p for g in self.param_groups for p in g["params"]):
                p.copy_(self.state[p]["y"])
            self.mode = "train"


def test_optimizer_that_swaps_weights_for_evaluation_holds(tmp_path):
    trainer = DPTrainer(model=bert(), args=args(tmp_path, eval_strategy="steps", eval_steps=1), train_dataset=data(),
                        eval_dataset=data(), optimizer_cls_and_kwargs=(SwapOptimizer, {"lr": 0.1}))
    trainer.train()
    assert trainer.accountant.steps == 2 and trainer.optimizer.optimizer.mode == "eval"


def test_load_best_model_at_end_holds(tmp_path):
    """Loading the best checkpoint at the end rewrites every parameter in place: the run's releases are over
    (the selection itself is named in ``dp_guarantee``)."""
    trainer = DPTrainer(model=bert(), args=args(tmp_path, eval_strategy="steps", eval_steps=1, save_strategy="steps",
                                                save_steps=1, load_best_model_at_end=True),
                        train_dataset=data(), eval_dataset=data())
    trainer.train()
    assert trainer.accountant.steps == 2 and trainer.state.best_model_checkpoint is not None
    assert "checkpoint selected on evaluation metrics" in trainer.dp_guarantee


def test_parameter_storage_swapped_between_steps_is_refused(tmp_path):
    """``p.data = x`` keeps the Parameter object and its version counter, but not its storage."""

    class Swap(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            model.classifier.weight.data = model.classifier.weight.data * 0.5

    trainer = DPTrainer(model=bert(), args=args(tmp_path), train_dataset=data(), callbacks=[Swap()])
    refused(trainer, "between two DP steps", "classifier.weight", steps_released=1)


def test_module_replaced_between_steps_is_refused(tmp_path):
    class Replace(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            model.classifier = torch.nn.Linear(16, 3)

    trainer = DPTrainer(model=bert(), args=args(tmp_path), train_dataset=data(), callbacks=[Replace()])
    refused(trainer, "between two DP steps", "classifier.weight (trainable parameter) (new or replaced)",
            steps_released=1)


def test_undeclared_change_is_refused_before_the_checkpoint_is_written(tmp_path):
    trainer = DPTrainer(model=bert(), args=args(tmp_path, max_steps=1, save_strategy="steps", save_steps=1),
                        train_dataset=data(), callbacks=[Shrink("on_step_end", False)])
    refused(trainer, "before saving", "classifier.weight", steps_released=1)
    assert not os.path.exists(os.path.join(tmp_path, "checkpoint-1", "model.safetensors"))


# ---------------------------------------------------------------------- the guard on its own
def test_guard_allows_the_optimizer_and_refuses_anything_else():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    model[1].requires_grad_(False)
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    guard = ReleasedStateGuard()
    guard.start(model, opt)
    try:
        guard.begin_step()
        model[0].weight.grad = torch.ones(2, 3)
        guard.before_release()
        opt.step()  # the optimizer's hooks: checked before, new snapshot after
        guard.check("between_steps")
        with torch.no_grad():
            model[1].running_mean.add_(1.0)
        assert guard.changed() == ["1.running_mean (buffer)"]
        with pytest.raises(RuntimeError, match="before optimizer.step()"):
            opt.step()
        with pytest.raises(RuntimeError, match="outside any hf_dp.post_processing"), post_processing():
            pass  # entering refuses what changed before it
        guard.snapshot()
        with torch.no_grad(), post_processing():
            model[1].running_mean.add_(1.0)  # declared: accepted, new snapshot
        guard.check("between_steps")
    finally:
        guard.stop()
    opt.step()  # stopped: the hooks are gone


class WritesABuffer(torch.optim.SGD):
    """An optimizer whose step also writes a tensor it does not hold."""

    def __init__(self, params, buffer, **kw):
        super().__init__(params, **kw)
        self.buffer = buffer

    @torch.no_grad()
    def step(self, closure=None):
        out = super().step(closure)
        self.buffer.add_(1.0)
        return out


def test_guard_refuses_an_optimizer_step_that_changes_what_it_does_not_hold():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    opt = WritesABuffer(model[0].parameters(), model[1].running_mean, lr=0.1)
    guard = ReleasedStateGuard()
    guard.start(model, opt)
    try:
        with pytest.raises(RuntimeError, match=r"optimizer.step\(\) changed tensors that are not in its param groups: "
                                                r"1.running_mean \(buffer\)"):
            opt.step()
    finally:
        guard.stop()


def test_guard_blind_spot_writes_through_data_are_not_seen():
    """Documented in the README: ``p.data`` has its own version counter, so ``p.data.add_()`` is invisible."""
    model = torch.nn.Linear(3, 2)
    guard = ReleasedStateGuard()
    guard.start(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model.weight.data.add_(1.0)
    assert guard.changed() == []
    with torch.no_grad():
        model.weight.add_(1.0)
    assert guard.changed() == ["weight (trainable parameter)"]
    guard.stop()


# ---------------------------------------------------------------------- refusals that name the cause (invariant 6)
def test_compiled_model_is_refused_pointing_to_torch_compile(tmp_path):
    with pytest.raises(ValueError, match=r"torch.compile.*torch_compile=True"):
        DPTrainer(model=torch.compile(bert()), args=args(tmp_path), train_dataset=data())


def test_model_with_nothing_trainable_is_refused_at_train_start(tmp_path):
    """Built on a frozen model, a trainer may still be read (its accountant, the plan, a card: e.g. on a
    ``merge_and_unload()`` result); ``train()`` is refused with the cause."""
    trainer = DPTrainer(model=bert().requires_grad_(False), args=args(tmp_path), train_dataset=data())
    with pytest.raises(ValueError, match="no trainable parameter.*requires_grad_"):
        trainer.train()
    assert trainer.accountant.steps == 0


def test_model_frozen_before_train_is_refused_at_train_start(tmp_path):
    """Frozen after construction: refused at train start with the cause (it was a bare StopIteration in the step)."""
    trainer = DPTrainer(model=bert(), args=args(tmp_path), train_dataset=data())
    trainer.model.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        trainer.train()
    assert trainer.accountant.steps == 0


def test_callback_freezing_everything_mid_run_is_refused_with_the_cause(tmp_path):
    class FreezeAll(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            model.requires_grad_(False)

    trainer = DPTrainer(model=bert(), args=args(tmp_path), train_dataset=data(), callbacks=[FreezeAll()])
    with pytest.raises(ValueError, match="no trainable parameter"):
        trainer.train()
    assert trainer.accountant.steps == 1


def test_the_guard_leaves_the_optimizer_after_train(tmp_path):
    """Tracking ends with train() (also when it raises): the optimizer's step hooks are removed."""
    trainer = DPTrainer(model=bert(), args=args(tmp_path), train_dataset=data(),
                        callbacks=[Shrink("on_step_end", False)])
    with pytest.raises(RuntimeError):
        trainer.train()
    inner = trainer.optimizer.optimizer
    assert not trainer._state_guard.active and not inner._optimizer_step_pre_hooks
    with torch.no_grad():
        trainer.model.classifier.weight.mul_(2.0)  # after train(): the user's own business
    trainer.save_model(str(tmp_path / "saved"))
