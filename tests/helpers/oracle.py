"""The per-example oracle: each example's gradient of the model's own loss on a batch of ONE, clipped by the rule
written out here, summed (Abadi et al. 2016, Alg. 1; He et al. 2023 for group-wise thresholds).

This module never imports hf_dp (``tests/architecture/test_test_layout.py`` checks it): nothing can merge examples
(one forward per example), the loss is the model's own (what the plain ``Trainer`` or PEFT optimises for that
example), and the clipping rule is written out independently of hf_dp's.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn


@contextlib.contextmanager
def loss_keeps_float64():
    """While a model's own HF loss function runs, ``logits.float()`` leaves float64 tensors in float64.

    transformers' loss functions (``loss_utils.ForCausalLMLoss`` ...) upcast logits with ``.float()``, which would
    *downcast* a float64 oracle to float32. Only the loss function's call is affected (``loss_function`` of every
    ``PreTrainedModel``), not the model's forward: the loss is still the model's own code, just not rounded.
    """
    from transformers import PreTrainedModel

    prop = PreTrainedModel.__dict__["loss_function"]
    plain_float = torch.Tensor.float

    def keep64(self, *args, **kwargs):
        return self if self.dtype == torch.float64 and not args and not kwargs else plain_float(self, *args, **kwargs)

    def wrapped_getter(model):
        fn = prop.fget(model)

        def loss_fn(*args, **kwargs):
            torch.Tensor.float = keep64
            try:
                return fn(*args, **kwargs)
            finally:
                torch.Tensor.float = plain_float

        return loss_fn

    PreTrainedModel.loss_function = property(wrapped_getter, prop.fset)
    try:
        yield
    finally:
        PreTrainedModel.loss_function = prop
        torch.Tensor.float = plain_float


def single_example_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """The model's own loss on a batch of ONE example: ``model(**batch).loss`` with ``labels`` in ``batch``.

    This is what the plain ``Trainer`` (or PEFT, for a ``PeftModel``) optimises for that example: the model builds
    its decoder inputs from ``labels`` (seq2seq), pads the labels of virtual tokens (prompt learning), shifts
    (causal LM) and picks its loss by ``config.problem_type`` (classification). Nothing here re-implements hf_dp's
    losses. In float64, HF's ``.float()`` upcast inside the loss is kept from rounding to float32.
    """
    assert next(iter(batch.values())).shape[0] == 1, "a batch of one"
    with loss_keeps_float64():
        out = model(**batch)
    assert out.loss is not None, f"{type(model).__name__} returned no loss for {sorted(batch)}"
    return out.loss


def trainer_loss(model: nn.Module, output_dir, **training_arguments):
    """``loss(model, batch)``: the plain ``transformers.Trainer``'s own ``compute_loss`` on ``batch`` (a Trainer
    built once for ``model`` with these ``TrainingArguments``, e.g. ``label_smoothing_factor=0.1``: its
    ``LabelSmoother``, shifted for causal LMs as the Trainer decides). What the plain Trainer trains for a batch of
    one; for the losses the Trainer computes itself rather than the model."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(output_dir), use_cpu=True, report_to="none", **training_arguments)
    trainer = Trainer(model=model, args=args)

    def loss(net: nn.Module, batch: dict) -> torch.Tensor:
        assert next(iter(batch.values())).shape[0] == 1, "a batch of one"
        return trainer.compute_loss(net, dict(batch))

    return loss


def per_example_grads(model: nn.Module, data, indices: list[int] | None = None, loss=None
                      ) -> list[dict[str, torch.Tensor]]:
    """Gradients of each example's own loss (``single_example_loss``, or ``loss(model, batch)``: e.g.
    :func:`trainer_loss`), one example per forward (a batch of one).

    ``data``: an HF ``Dataset``, a list of dicts or any map-style dataset of rows (lists or tensors without the batch
    axis; string columns are left out). ``indices``: the rows, in order (default: all). A trainable parameter the
    example does not reach gets a zero gradient."""
    loss = single_example_loss if loss is None else loss
    model.train()
    out = []
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    for i in range(len(data)) if indices is None else indices:
        row = data[i]
        batch = {k: torch.as_tensor(v).unsqueeze(0) for k, v in row.items() if not isinstance(v, str)}
        model.zero_grad(set_to_none=True)
        loss(model, batch).backward()
        out.append({n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in params.items()})
    model.zero_grad(set_to_none=True)
    return out


def loop_grads(model: nn.Module, inputs: list[torch.Tensor], loss_fn) -> list[dict[str, torch.Tensor]]:
    """Per-example gradients of a plain module: ``loss_fn(model(x[None])).sum()`` for each input ``x`` alone."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out = []
    for x in inputs:
        model.zero_grad(set_to_none=True)
        loss_fn(model(x.unsqueeze(0))).sum().backward()
        out.append({n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in params.items()})
    model.zero_grad(set_to_none=True)
    return out


def example_norms(grads: list[dict[str, torch.Tensor]]) -> list[float]:
    """‖g_i‖ over all parameters, per example."""
    return [float(torch.sqrt(sum(t.pow(2).sum() for t in g.values()))) for g in grads]


def sorted_norms(grads: list[dict[str, torch.Tensor]], names: list[str]) -> list[float]:
    """The examples' norms over the parameters ``names`` (one group), ascending."""
    return sorted(math.sqrt(sum(float(g[n].pow(2).sum()) for n in names)) for g in grads)


def flat_clipped_sum(grads: list[dict[str, torch.Tensor]], max_norm: float) -> dict[str, torch.Tensor]:
    """Σ_i min(1, C / (‖g_i‖ + 1e-6)) g_i with one norm over all parameters."""
    total = {n: torch.zeros_like(t) for n, t in grads[0].items()}
    for g in grads:
        norm = torch.sqrt(sum(t.pow(2).sum() for t in g.values()))
        c = min(1.0, max_norm / (float(norm) + 1e-6))
        for n in total:
            total[n] += c * g[n]
    return total


def user_gradients(grads: list[dict[str, torch.Tensor]], owners: list, contribution: str
                   ) -> list[dict[str, torch.Tensor]]:
    """Each user's gradient ``g_u = w Σ_{i∈u} g_i`` (users in sorted order; ``w = 1/n_u`` for ``"mean"``, 1 for
    ``"sum"``): the unit that user-level DP clips."""
    out = []
    for user in sorted(set(owners)):
        mine = [g for g, o in zip(grads, owners) if o == user]
        w = 1.0 / len(mine) if contribution == "mean" else 1.0
        out.append({n: w * sum(g[n] for g in mine) for n in grads[0]})
    return out


def automatic_clipped_sum(grads: list[dict[str, torch.Tensor]], max_norm: float, gamma: float
                          ) -> dict[str, torch.Tensor]:
    """Σ_i C / (‖g_i‖ + γ) · g_i, one norm over all parameters (automatic clipping, Bu et al. 2023, AUTO-S)."""
    total = {n: torch.zeros_like(t) for n, t in grads[0].items()}
    for g in grads:
        norm = math.sqrt(sum(float(t.pow(2).sum()) for t in g.values()))
        for n in total:
            total[n] += max_norm / (norm + gamma) * g[n]
    return total


def group_clipped_sum(grads, groups: list[list[str]], thresholds: list[float]) -> dict[str, torch.Tensor]:
    """Σ_i Σ_k min(1, C_k / (‖g_{i,k}‖ + 1e-6)) g_{i,k}: group-wise clipping (He et al. 2023); flat clipping is one
    group with one threshold."""
    total = {n: torch.zeros_like(t) for n, t in grads[0].items()}
    for g in grads:
        for names, c_k in zip(groups, thresholds):
            norm = math.sqrt(sum(float(g[n].pow(2).sum()) for n in names))
            factor = min(1.0, c_k / (norm + 1e-6))
            for n in names:
                total[n] += factor * g[n]
    return total
