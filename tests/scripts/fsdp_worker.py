"""Worker for tests/distributed/test_fsdp.py: DPTrainer under FSDP2 on CPU (2 processes, gloo), through the test-only
shim.

Run as ``python -m torch.distributed.run --nproc_per_node 2 tests/scripts/fsdp_worker.py OUT``. In one process:

0. a DPTrainer with ``fsdp=``/``fsdp_config=`` but WITHOUT the shim: accelerate silently runs DDP, DPTrainer warns;
1. ``clean``: σ = 0, 2 steps (GA 2, micro-batches of 2), checkpoint every step, then ``save_model``;
2. ``noisy``: σ = SIGMA, 1 step, same seed (same Poisson batches);
3. ``nan``: σ = 0, 1 step, q = 1, one example's loss is NaN (factor 0; pass 2 must not see it);
4. ``escape``: ``dp_self_check=False`` and a model whose forward uses ``ln_f.weight`` outside ``ln_f``'s forward
   (pass 2 is a plain backward, so that use would leak into the update): must be refused before the first update;
5. ``mid_step``: q or C changed by a callback inside a step; ``gradient_hook``: a post-accumulate hook on the sharded
   parameters (FSDP2 runs it on the clipped sum before the noise): refused before it runs;
6. ``eval_raises``: ``clean``'s first step on a model whose own backward raises in eval mode (as Reformer's): the
   eval-mode half of dp_self_check is skipped with a warning, the step trains as ``clean``'s.

Every rank writes the full (gathered) parameters after each step, what it saw, and the run's facts.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
from transformers import TrainerCallback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from cpu_fsdp_shim import CPUFSDPTrainerMixin  # noqa: E402
from helpers import close_distributed, lm_dataset, tiny_gpt2  # noqa: E402

from hf_dp import DPTrainer, DPTrainingArguments  # noqa: E402

C, N, SEED, SIGMA = 0.5, 16, 23, 1.5
FSDP = {"fsdp": True,
        "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]}}


class ShimDPTrainer(CPUFSDPTrainerMixin, DPTrainer):
    pass


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter in full (an all-gather per DTensor: a collective, all ranks call it)."""
    out = {}
    for n, p in model.named_parameters():
        t = p.detach()
        out[n] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


class Snapshots(TrainerCallback):
    def __init__(self):
        self.params: list[dict[str, torch.Tensor]] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.params.append(full_params(model))


def make_args(out_dir: str, sigma: float, steps: int, save: bool) -> DPTrainingArguments:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DPTrainingArguments(
            output_dir=out_dir, noise_multiplier=sigma, per_sample_max_grad_norm=C, per_device_train_batch_size=2,
            gradient_accumulation_steps=2, max_steps=steps, learning_rate=1.0, optim="sgd",
            lr_scheduler_type="constant", weight_decay=0.0, report_to="none",
            save_strategy="steps" if save else "no", save_steps=1, dp_seed=SEED, disable_tqdm=True, **FSDP)


def nan_for_first_example(data):
    """The model's causal-LM loss per example, NaN for the rows that start like example 0 (a poisoned example)."""
    from hf_dp import causal_lm_loss

    first = data[0]["input_ids"][0]

    def loss(outputs, labels):
        losses = causal_lm_loss(outputs, labels)
        poison = torch.where(labels[:, 0] == first, float("nan"), 1.0).to(losses.dtype)
        return losses * poison  # NaN loss and NaN gradient for that example only

    return loss


class EscapingGPT2(type(tiny_gpt2())):
    """GPT-2 whose forward also uses ``transformer.ln_f.weight`` directly (outside ``ln_f``'s forward): a gradient
    that no layer hook sees."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
        w = self.transformer.ln_f.weight.mean()
        out.logits = out.logits * (1 + w - w.detach())
        return out


def run_escape(out_dir: str) -> str:
    torch.manual_seed(0)
    model = EscapingGPT2(tiny_gpt2().config).double()
    args = make_args(out_dir, 0.0, 1, False)
    args.dp_self_check = False
    from hf_dp import causal_lm_loss

    trainer = ShimDPTrainer(model=model, args=args, train_dataset=lm_dataset(N, seed=3),
                            per_example_loss=causal_lm_loss)
    try:
        trainer.train()
    except Exception as err:  # noqa: BLE001 - reported to the test
        return f"{type(err).__name__}: {err}"
    return "trained"


class _TrainModeBackward(torch.autograd.Function):
    """The identity, whose backward asserts that the model ran in train mode (as Reformer's reversible layers'
    recomputation does: ``assert self.training``)."""

    @staticmethod
    def forward(ctx, x, training):
        ctx.training = training
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        assert ctx.training, "this model's backward runs in train mode only"
        return grad, None


class EvalBackwardRaisesGPT2(type(tiny_gpt2())):
    """GPT-2 whose own backward raises in eval mode (the same numbers as GPT-2 in train mode)."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
        out.logits = _TrainModeBackward.apply(out.logits, self.training)
        return out


def run_eval_raises(out_dir: str) -> dict:
    """``clean``'s first step (same init, seed, data, C; dp_self_check on) on a model whose backward raises in eval
    mode: the eval-mode half of the self-check is skipped with a warning; the step trains."""
    import logging

    torch.manual_seed(0)
    model = tiny_gpt2().double()
    model.__class__ = EvalBackwardRaisesGPT2
    warned: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("hf_dp.clipping.checks").addHandler(handler)
    snaps = Snapshots()
    from hf_dp import causal_lm_loss

    trainer = ShimDPTrainer(model=model, args=make_args(out_dir, 0.0, 1, False), train_dataset=lm_dataset(N, seed=3),
                            callbacks=[snaps], per_example_loss=causal_lm_loss)
    try:
        trainer.train()
        outcome = "trained"
    except Exception as err:  # noqa: BLE001 - reported to the test
        outcome = f"{type(err).__name__}: {err}"
    finally:
        logging.getLogger("hf_dp.clipping.checks").removeHandler(handler)
    return {"outcome": outcome, "steps": trainer.accountant.steps, "self_checked": trainer._self_checked,
            "warned": [w for w in warned if "eval-mode part of dp_self_check was skipped" in w], "snaps": snaps.params}


def run(out_dir: str, sigma: float, steps: int, save: bool, nan: bool = False) -> dict:
    torch.manual_seed(0)  # same init on every rank
    model = tiny_gpt2().double()
    snaps = Snapshots()
    data = lm_dataset(N, seed=3)
    args = make_args(out_dir, sigma, steps, save)
    extra = {}
    if nan:
        args.per_device_train_batch_size, args.gradient_accumulation_steps = N // 2, 1  # q = 1 over 2 ranks
        extra["per_example_loss"] = nan_for_first_example(data)
    trainer = ShimDPTrainer(model=model, args=args, train_dataset=data, callbacks=[snaps], **extra)
    trainer.train()
    if save:
        trainer.save_model(os.path.join(out_dir, "final"))
    return {"trainer": trainer, "snaps": snaps.params}


class ChangeArgs(TrainerCallback):
    """Sets ``args`` fields once, at the first ``on_substep_end`` (between a step's two chunks) or at step 2's
    ``on_step_begin`` (its chunks drawn, none run)."""

    def __init__(self, event: str, **changes):
        self.event, self.changes, self.done = event, changes, False

    def _fire(self, args) -> None:
        if not self.done:
            self.done = True
            for k, v in self.changes.items():
                setattr(args, k, v)

    def on_substep_end(self, args, state, control, **kwargs):
        if self.event == "substep_end":
            self._fire(args)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.event == "step_begin" and state.global_step == 1:
            self._fire(args)


def run_mid_step(out_dir: str) -> dict:
    """q or C changed by a callback inside a step (``Mechanism.check_step`` under FSDP): the outcome and the steps the
    accountant recorded, ``(q, steps)``."""
    results = {}
    for name, event, change in [("c_between_chunks", "substep_end", {"per_sample_max_grad_norm": 1e-4}),
                                ("q_after_draw", "step_begin", {"per_device_train_batch_size": 1}),
                                ("c_before_chunks", "step_begin", {"per_sample_max_grad_norm": C / 2})]:
        torch.manual_seed(0)
        args = make_args(os.path.join(out_dir, name), SIGMA, 2, False)
        trainer = ShimDPTrainer(model=tiny_gpt2().double(), args=args, train_dataset=lm_dataset(N, seed=3),
                                callbacks=[ChangeArgs(event, **change)])
        try:
            trainer.train()
            outcome = "trained"
        except RuntimeError as err:
            outcome = f"RuntimeError: {err}"
        results[name] = {"outcome": outcome, "history": [(r.sample_rate, r.steps) for r in trainer.accountant.history]}
    return results


def run_gradient_hook(out_dir: str) -> dict:
    """A post-accumulate hook on every sharded parameter, registered by a callback added after construction (its
    ``on_train_begin`` runs after DPTrainer's): FSDP2 runs such hooks after the reduce-scatter, on the clipped sum
    before the noise. The outcome and how many times the hook ran."""
    seen = []

    class Watch(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(lambda t: seen.append(1))

    torch.manual_seed(0)
    trainer = ShimDPTrainer(model=tiny_gpt2().double(), args=make_args(out_dir, SIGMA, 1, False),
                            train_dataset=lm_dataset(N, seed=3))
    trainer.add_callback(Watch())
    try:
        trainer.train()
        outcome = "trained"
    except ValueError as err:
        outcome = f"ValueError: {err}"
    return {"outcome": outcome, "hook_ran": len(seen), "steps": trainer.accountant.steps}


def main(out: str) -> None:
    # 0. FSDP asked for, no shim: accelerate drops the plugin on CPU (DDP) and DPTrainer says so.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = DPTrainer(model=tiny_gpt2().double(), args=make_args(os.path.join(out, "ddp"), 0.0, 1, False),
                          train_dataset=lm_dataset(N, seed=3))
    fallback = {"is_fsdp_enabled": plain.is_fsdp_enabled, "distributed_type": str(plain.accelerator.distributed_type),
                "warned": any("FSDP was requested" in str(w.message) for w in caught)}
    del plain

    clean = run(os.path.join(out, "clean"), 0.0, 2, save=True)
    noisy = run(os.path.join(out, "noisy"), SIGMA, 1, save=False)
    nan = run(os.path.join(out, "nan"), 0.0, 1, save=False, nan=True)
    escape = run_escape(os.path.join(out, "escape"))
    mid_step = run_mid_step(os.path.join(out, "mid_step"))
    gradient_hook = run_gradient_hook(os.path.join(out, "gradient_hook"))
    eval_raises = run_eval_raises(os.path.join(out, "eval_raises"))
    tr = clean["trainer"]
    rank = tr.args.process_index
    torch.save({"clean": clean["snaps"], "noisy": noisy["snaps"], "nan": nan["snaps"],
                "eval_raises": eval_raises.pop("snaps")},
               os.path.join(out, f"params_rank{rank}.pt"))
    local_shard_numel = sum(p.to_local().numel() for p in tr.model.parameters())
    with open(os.path.join(out, f"info_rank{rank}.json"), "w") as f:
        json.dump({
            "world_size": tr.args.world_size, "is_fsdp_enabled": tr.is_fsdp_enabled,
            "model_class": type(tr.model).__name__, "sharded": local_shard_numel < sum(
                p.numel() for p in tr.model.parameters()),
            "expected_batch_size": tr.expected_batch_size, "sample_rate": tr.sample_rate,
            "steps": tr.accountant.steps, "epsilon_noisy": noisy["trainer"].privacy_spent()["epsilon"],
            "stats": tr._fsdp.stats, "self_checked": tr._self_checked, "fallback": fallback,
            "nan_stats": nan["trainer"]._fsdp.stats, "nan_nonfinite": nan["trainer"].nonfinite_examples,
            "escape": escape, "mid_step": mid_step, "gradient_hook": gradient_hook, "eval_raises": eval_raises,
        }, f)


if __name__ == "__main__":
    main(sys.argv[1])
    close_distributed()
