"""The first-step checks (one copy, used by every step strategy, by FSDP and by the SFT trainer).

* :meth:`FirstStepChecks.first_step_check` (always, cheap): every hooked layer's batch axis is proven on the real
  model (:meth:`~FirstStepChecks.probe_layout`), and the hooks' unclipped sum equals autograd's gradient for every
  parameter (:meth:`~FirstStepChecks.check_against_autograd`); a refusal that re-running an enclosing module per
  example may resolve moves those parameters there (``CoveragePlan.enclose``) and checks again (DESIGN invariant 3, 8).
* :meth:`FirstStepChecks.check_single_examples` (``dp_self_check``): each example's norm in its micro-batch equals
  its norm alone (:func:`norm_alone_problem`, also used by ``fsdp.py``).
* :meth:`FirstStepChecks.check_counterfactual` (DESIGN invariant 12): each example's loss, norm and gradient in its
  micro-batch equal those of the example collated alone (driven by ``hf_dp/counterfactual.py``).

They run on the engine's public methods only (``record``, the norms and sums, ``replan``) and its recorder's probe.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .checkpointing import clipped_in_backward
from .coverage import with_enclosable
from .fallback import is_drop_rate, later_batch_axis
from .rules import UnsupportedLayerError

__all__ = ["FirstStepChecks", "check_rtol", "computes_in_half", "eval_mode_check", "holds_half_precision",
           "norm_alone_problem", "rounding_floor", "stand_ins", "train_without_dropout"]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def train_without_dropout(model: nn.Module) -> Iterator[None]:
    """Train mode with dropout off (for the first-step checks), restored on exit.

    Every module stays in train mode (batch statistics, anything else that differs in training, runs as it will);
    dropout is switched off by setting its probability to 0: ``nn.Dropout`` modules' ``p`` and float attributes named
    as drop probabilities (``attention_dropout``, ``dropout_prob``, LayerDrop's ``layerdrop``, stochastic depth's
    ``drop_prob``: :func:`~.fallback.is_drop_rate`). Turning ``training`` off on the dropout
    modules alone is not enough: attention modules pass ``self.dropout.p if self.training`` to sdpa themselves.
    """
    was_training = model.training
    saved: list[tuple[object, str, float]] = []
    for m in model.modules():
        for k, v in vars(m).items():
            if (k == "p" and isinstance(m, nn.modules.dropout._DropoutNd)) or (
                    is_drop_rate(k) and isinstance(v, float)):
                if v:
                    saved.append((m, k, v))
    model.train()
    for m, k, _ in saved:
        setattr(m, k, 0.0)
    try:
        yield
    finally:
        for m, k, v in saved:
            setattr(m, k, v)
        model.train(was_training)


def _rows(x: torch.Tensor) -> int | None:
    """The size of the axis a rule treats as the batch axis, or ``None`` when the input has no such axis."""
    return x.shape[0] if x.dim() >= 2 else None


@contextlib.contextmanager
def stand_ins(model: nn.Module, params: dict[str, nn.Parameter]) -> Iterator[dict[str, nn.Parameter]]:
    """Every trainable parameter replaced, where it is registered, by a fresh ``nn.Parameter`` on the same storage
    (tied parameters by one stand-in): autograd's reference gradient lands on the stand-ins, so the real
    parameters' ``.grad`` and any hooks the user registered on them are never touched."""
    stand_in = {id(p): nn.Parameter(p.detach(), requires_grad=True) for p in params.values()}
    swapped = []
    for module in model.modules():
        for k, p in list(module._parameters.items()):
            if p is not None and id(p) in stand_in:
                swapped.append((module, k, p))
                module._parameters[k] = stand_in[id(p)]
    try:
        yield {n: stand_in[id(p)] for n, p in params.items()}
    finally:
        for module, k, p in swapped:
            module._parameters[k] = p


def norm_alone_problem(i: int, batched: float, alone: float, batch_size: int, rtol: float, mode: str) -> str | None:
    """Example ``i``'s norm in its micro-batch against its norm alone: the problem, or ``None`` (equal, or one of
    them non-finite: such an example gets clipping factor 0 in training)."""
    if not (math.isfinite(alone) and math.isfinite(batched)):
        return None
    if abs(alone - batched) > rtol * max(alone, 1e-12) + 1e-12:
        return (f"Example {i}'s gradient norm is {batched:.6g} in its micro-batch of {batch_size} but {alone:.6g} "
                f"alone{mode}")
    return None


def eval_mode_check(check: Callable[[], Any], clean_up: Callable[[], None] | None = None) -> bool:
    """Run ``check``, the eval-mode half of ``dp_self_check`` (examples' norms in the micro-batch equal their norms
    alone), for the local step (``local.py``) and FSDP2's (``fsdp.py``): ``True`` if it ran.

    Some models cannot run a backward pass in eval mode at all: Reformer's reversible layers (Kitaev et al. 2020,
    §3) recompute activations in a custom backward that asserts ``self.training``. Training never runs in eval mode
    (DPTrainer trains in train mode, whose check has just run and passed), so when the model's own forward or backward
    raises here, this half is skipped with a warning naming the error instead of crashing the run (after
    ``clean_up``, which drops what the interrupted check recorded); returns ``False``. A mismatch
    (``UnsupportedLayerError``) is still raised. Under FSDP every rank must raise alike (the model's own assertion
    on its mode does): a rank that ran on would wait in a collective."""
    try:
        check()
    except UnsupportedLayerError:
        raise
    except Exception as e:  # noqa: BLE001 - the model's own error in a mode training never uses
        if clean_up is not None:
            clean_up()
        logger.warning(
            "hf_dp: the eval-mode part of dp_self_check was skipped: the model's forward/backward raised in eval mode "
            "(%s: %s). Training runs in train mode, where the same check (two examples' gradient norms in the "
            "micro-batch equal their norms alone, dropout off) ran and passed; the coverage checks ran as usual.",
            type(e).__name__, " ".join(str(e).split())[:300])
        return False
    return True


class JudgedCalls(dict):
    """The layout probe's store for the B-example run (``Recorder.probing``): each call's input is handed to
    ``judge(key, input)`` when it arrives (:meth:`FirstStepChecks.probe_layout`) and not kept."""

    def __init__(self, judge: Callable[[tuple, object], None]):
        super().__init__()
        self.judge = judge

    def __setitem__(self, key, value) -> None:
        self.judge(key, value)


#: the relative tolerance of the comparisons once the model is seen computing in half precision (bf16 / fp16: the
#: Trainer's ``bf16=True`` or a ``torch.autocast`` of the user's own inside the forward), as
#: ``counterfactual.alone_rtol``
LOW_PRECISION_RTOL = 5e-2


#: the half-precision floating dtypes
HALF_DTYPES = (torch.float16, torch.bfloat16)


def holds_half_precision(net: nn.Module) -> bool:
    """Whether ``net`` holds a half-precision floating parameter, trainable or not (a model loaded in bf16 / fp16; a
    LoRA adapter on a bf16 base computes the base's matmuls in bf16): its forward and backward round at that
    precision whatever the Trainer's ``bf16`` / ``fp16`` say."""
    return any(p.dtype in HALF_DTYPES for p in net.parameters())


def computes_in_half(args: Any, net: nn.Module) -> bool:
    """Whether the comparisons of the first-step checks see half-precision rounding: the Trainer's mixed precision
    (``bf16`` / ``fp16``) or a model holding half-precision parameters (:func:`holds_half_precision`). One answer for
    every check (their relative tolerance is then :data:`LOW_PRECISION_RTOL`)."""
    return bool(getattr(args, "bf16", False) or getattr(args, "fp16", False)) or holds_half_precision(net)


def check_rtol(args: Any, net: nn.Module, rtol: float = 1e-3) -> float:
    """The relative tolerance of a first-step comparison: ``rtol``, or :data:`LOW_PRECISION_RTOL` when the model
    computes in half precision (:func:`computes_in_half`)."""
    return max(rtol, LOW_PRECISION_RTOL) if computes_in_half(args, net) else rtol


def rounding_floor(dtype: torch.dtype, scale: float) -> float:
    """The magnitude below which an entry of a gradient of a ``dtype`` parameter is rounding noise, given the largest
    entry ``scale`` of the whole gradient: 100 epsilons of float32 / float64 (a gradient zero in exact arithmetic,
    e.g. an attention key bias, is not zero after rounding), 4 of bf16 / fp16. Measured on tiny BERT, GPT-2 and
    Llama held in bf16 (session 12): the hooks' sum and autograd's differ by at most 0.47 bf16 epsilons of the
    largest entry, while 100 bf16 epsilons (0.78 of the largest entry) let a weight used a second time outside its
    layer's forward pass unseen (0.39 of the largest entry)."""
    if not dtype.is_floating_point:
        return 0.0
    return (4 if dtype in HALF_DTYPES else 100) * torch.finfo(dtype).eps * scale


def half_precision_of(uses: dict) -> torch.dtype | None:
    """The half-precision dtype (bf16 / fp16) a recorded layer computed in (its output gradient or input), if any: the
    precision the model's forward and backward actually ran at, whatever set it."""
    for use_list in uses.values():
        for use in use_list:
            for t in (use.left, use.right):
                if isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16):
                    return t.dtype
    return None


class FirstStepChecks:
    """The first-step checks of one :class:`~hf_dp.clipping.engine.ClippingEngine` (see the module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        #: the half-precision dtype the model was seen computing in (:func:`half_precision_of`); the comparisons'
        #: relative tolerances follow it (rounding, not a mixing of examples or an escaped use, is then at the 1e-2
        #: level); the floor below which a gradient entry is rounding noise stays at the parameters' own precision
        #: (:func:`rounding_floor`)
        self.half_precision: torch.dtype | None = None

    def _see_precision(self) -> None:
        self.half_precision = self.half_precision or half_precision_of(self.engine.recorded_uses())

    def _rtol(self, rtol: float) -> float:
        return max(rtol, LOW_PRECISION_RTOL) if self.half_precision is not None else rtol

    def recorded_norms(self, run: Callable[[], torch.Tensor], rows: int, segments: torch.Tensor | None = None,
                       context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                       ) -> torch.Tensor:
        """The flat per-example gradient norms (float64) of one recorded run: ``run()`` runs the model on a micro-batch
        of ``rows`` rows (``segments``: packed, :meth:`ClippingEngine.record`) and returns the per-example losses;
        the forward and backward run inside ``context()`` (the trainer's autocast, as in a DP step)."""
        with context(), self.engine.record(rows, segments=segments):
            losses = run()
            if losses.requires_grad:
                losses.sum().backward()
        self._see_precision()
        return self._total_norms(rows)

    @torch.no_grad()
    def _total_norms(self, batch_size: int) -> torch.Tensor:
        try:
            norms = self.engine.per_example_norms_sq()
        finally:
            self.engine.clear()
        if not norms:
            return torch.zeros(batch_size, dtype=torch.float64)
        return torch.stack([v.double() for v in norms.values()]).sum(0).sqrt()

    def _saved_state(self):
        saved = (self.engine.summed_grads, self.engine.fused_groups)
        self.engine.set_fused_groups(None, None)  # the checks compare plain per-parameter norms
        self.engine.summed_grads = {}
        return saved

    def _restore_state(self, saved) -> None:
        self.engine.clear()
        self.engine.summed_grads = saved[0]
        self.engine.set_fused_groups(*saved[1])
        for p in self.engine.params.values():
            p.grad = None

    def first_step_check(self, run_losses: Callable[[slice], torch.Tensor], batch_size: int,
                         rtol: float = 1e-3) -> None:
        """The cheap check, always on (once per training run, before the first update is released).

        ``run_losses(sl)`` runs the model on examples ``sl`` of a micro-batch of ``batch_size`` (≥ 2 when the training
        set has two examples) and returns their per-example losses.

        1. **Batch axes are proven, never guessed**: the model runs (no backward) on the ``B`` examples and on the first
           alone;
           for every call of every hooked layer, the axis its rule treats as the batch axis must scale with the
           number of examples. A layer whose input is the same for 1 and B examples has no batch axis (computed once
           and broadcast to all examples, e.g. a relative-position bias) and is refused whatever the sizes
           (a sequence length equal to the micro-batch size cannot pass for a batch axis). An input with ``k > 1``
           rows per example (tokens flattened to ``(B·T, d)``, MoE style) is accepted when its rows are example-major
           (the first ``k`` rows for ``B`` examples equal the rows for the first alone) and reshaped to ``(B, T, d)``.
        2. **Hooks vs autograd**: on up to two examples, the hooks' unclipped sum ``Σ_i G_i`` equals autograd's
           gradient for every parameter (computed on stand-in parameters: ``.grad`` and user hooks stay untouched).
           A use of a parameter outside the forward of the module that owns it (``module.weight`` read directly by a
           parent, a functional call) would escape clipping.

        Raises :class:`UnsupportedLayerError` naming the layer and the cause.
        """
        saved = self._saved_state()
        first = None
        try:
            while True:
                try:
                    if batch_size >= 2:
                        self.probe_layout(run_losses, batch_size)
                    self.check_against_autograd(run_losses, min(batch_size, 2), rtol)
                    break
                except UnsupportedLayerError as err:
                    first = first or err
                    if not self.engine.replan(getattr(err, "enclosable", None)):
                        if err is first:
                            raise
                        raise UnsupportedLayerError(
                            f"{first}\nhf_dp then tried to compute them by re-running an enclosing module per example "
                            f"(the generic fallback), which was refused too:\n{err}") from err
        finally:
            self._restore_state(saved)
        self.engine.log_fallbacks()

    def probe_layout(self, run_losses: Callable[[slice], torch.Tensor], batch_size: int) -> None:
        """Check 1 of :meth:`first_step_check`: the model runs (no backward) on ``batch_size`` examples and on the first
        alone, and every hooked call's batch axis is proven from the inputs it saw; what is proven is given to the
        recorder (``Recorder.set_layouts``) for every later micro-batch."""
        engine, recorder = self.engine, self.engine.recorder
        plan = engine.plan
        seen = {}
        big = batch_size
        layout, mapped = recorder.layouts, recorder.fallback_layouts
        names = {id(m): (n, type(m).__name__) for n, m, _ in plan.layers}
        rules: dict[int, tuple] = {}
        for _, m, r in plan.layers:
            rules.setdefault(id(m), (m, r))  # a ruled module's rule, not its side fallback's entry (listed after)
        problems, concerned = [], []

        def judge(key, two) -> None:  # one call's input for B examples against the first example's alone
            one = seen[1].get(key)
            if one is None or two is None:
                return
            if len(key) == 3:  # a mixing point's result (_mixing_point): its rows must be example-major
                r1 = one.shape[0] if one.dim() else 0
                if not (r1 and two.dim() == one.dim() and two.shape[0] == big * r1 and two.shape[1:] == one.shape[1:]
                        and torch.allclose(two[:r1].double(), one.double(), rtol=1e-3, atol=1e-5)):
                    owner = next((n for n, m in self.engine.model.named_modules() if id(m) == key[0]), "?")
                    problems.append(
                        f"{owner}.{key[2]} (call {key[1] + 1}): its result ({tuple(two.shape)} for {big} examples, "
                        f"{tuple(one.shape)} for the first alone) does not hold the examples' rows first and one "
                        "example at a time, so hf_dp cannot split the gradient of the batch-less tensors it uses per "
                        "example. Freeze the parameters it uses (e.g. the relative embeddings and position "
                        "projections) or train with LoRA.")
                return
            if key[0] in plan.fallbacks:
                # each fallback proves its inputs' batch axes (fallback.py; recurrent.py its own, sequence-first too)
                mapped[key] = plan.fallbacks[key[0]].probe_layout(two, one, big)
                return
            name, cls = names[key[0]]
            call = f"{name} ({cls}, call {key[1] + 1} in the forward)"
            n_before = len(problems)
            axis = later_batch_axis(two, one, big)
            if axis:
                layout[key] = axis  # e.g. Longformer's sequence-first (T, B, d) projections
                return
            r2, r1 = _rows(two), _rows(one)
            if r2 is not None and r1 is not None and r2 == big * r1:
                later = [j for j in range(1, two.dim()) if two.dim() == one.dim() and two.shape[j] == big
                         and one.shape[j] == 1]
                if r1 == 1 and later and two.shape[1:] != one.shape[1:]:
                    problems.append(
                        f"{call}: both the first axis and axis {later[0]} of its input grow from 1 to {big} with the "
                        f"examples ({tuple(one.shape)} for the first alone, {tuple(two.shape)} for {big}), and its "
                        "other axes change with the batch, so hf_dp cannot tell which axis holds the examples (e.g. "
                        "Longformer's global-attention rows, one per global token, padded to the largest number of "
                        "global tokens in the batch, with the examples on axis 1). Give every example the same "
                        "number of global tokens (the classification default: the first token only), or freeze the "
                        "layer (requires_grad_(False)) or use LoRA on the other layers.")
                    concerned.extend(plan.owned(*rules[key[0]]))
                    return
                if r1 == 1:
                    layout.pop(key, None)
                    return
                same = torch.equal(two[:r1], one) if not one.is_floating_point() else torch.allclose(
                    two[:r1].double(), one.double(), rtol=1e-3, atol=1e-5)
                if same:
                    layout[key] = "flat"
                    return
                problems.append(
                    f"{call}: its input has {r1} rows per example ({tuple(two.shape)} for {big} examples) that are "
                    "not grouped example by example, so its rows cannot be assigned to examples. Freeze the layer.")
            elif r2 is not None and r2 == r1 == 1:
                problems.append(
                    f"{call}: its input is broadcast across the batch (first axis 1 for 1 and {big} examples, shape "
                    f"{tuple(two.shape)}), so its gradient would merge all examples. Materialise that input per "
                    "example (e.g. expand it to the batch size before the layer) or freeze the layer.")
            elif r2 is None or r2 == r1:
                problems.append(
                    f"{call}: its input has no batch axis (shape {tuple(two.shape)} for micro-batches of 1 and {big} "
                    "examples): it is computed once and its result is broadcast to every example (e.g. a relative-"
                    "position bias shared by the batch), so its gradient merges all examples and per-example clipping "
                    "cannot bound one example's contribution. Freeze its parameters (requires_grad_(False)) or train "
                    "with a PEFT adapter (LoRA) on the other layers.")
            else:
                problems.append(
                    f"{call}: the first axis of its input has {r2} rows for {big} examples but {r1} for one, so hf_dp "
                    "cannot tell which rows belong to which example. Freeze the layer.")
            if len(problems) > n_before:
                concerned.extend(plan.owned(*rules[key[0]]))
        # The first example alone, then the B examples, each call judged as it comes: a copy of every call's input
        # for B examples would be the memory of the whole model's activations (what activation checkpointing saves).
        with recorder.probing() as calls, torch.no_grad(), engine.record(1, freeze=False):
            run_losses(slice(0, 1))
        seen[1] = calls
        with recorder.probing(JudgedCalls(judge)), torch.no_grad(), engine.record(big, freeze=False):
            run_losses(slice(0, big))
        recorder.set_layouts(layout, mapped)
        if problems:
            raise with_enclosable(UnsupportedLayerError("Per-example gradients cannot be formed for these layers:\n  "
                                                        + "\n  ".join(problems)), concerned)

    def check_against_autograd(self, run_losses: Callable[[slice], torch.Tensor], n: int, rtol: float) -> None:
        """Check 2 of :meth:`first_step_check`: on ``n`` examples, the hooks' unclipped sum equals autograd's gradient
        (taken on stand-ins) for every parameter."""
        cuda = sorted({p.device.index or 0 for p in self.engine.params.values() if p.device.type == "cuda"})
        # sweepfix: both runs see the same random draws
        with self.engine.record(n), torch.random.fork_rng(devices=cuda):
            torch.manual_seed(0)
            losses = run_losses(slice(0, n))
            if losses.requires_grad:
                losses.sum().backward()
        self._see_precision()
        rtol = self._rtol(rtol)
        self.engine.per_example_norms_sq()
        self.engine.accumulate_clipped(torch.ones(n, dtype=torch.float64, device=losses.device))
        hooked = self.engine.summed_grads
        self.engine.summed_grads = {}
        with stand_ins(self.engine.model, self.engine.params) as replaced, torch.random.fork_rng(devices=cuda):
            torch.manual_seed(0)
            losses = run_losses(slice(0, n))
            if losses.requires_grad:
                losses.sum().backward()
        escaped = []
        # A gradient that is zero in exact arithmetic (e.g. an attention key bias: softmax is invariant to it) is
        # rounding noise in both computations: below a floor set by the dtype's precision and the scale of the whole
        # gradient, it is not compared with its own (noise) magnitude. A parameter the hooks never saw while autograd
        # gives it any nonzero gradient is an escaped use whatever its size.
        scale = max((float(g.grad.abs().max()) for g in replaced.values()  # sweepfix: empty parameters skipped
                     if g.grad is not None and g.grad.numel() and torch.isfinite(g.grad).all()), default=0.0)
        for name, p in self.engine.params.items():
            ref, mine = replaced[name].grad, hooked.get(name)
            if (ref is None and mine is None) or p.numel() == 0:  # sweepfix: an empty parameter has nothing to compare
                continue
            unseen = mine is None
            ref = torch.zeros_like(p) if ref is None else ref
            mine = torch.zeros_like(ref) if mine is None else mine.to(ref.dtype)
            if not torch.isfinite(ref).all():
                continue  # a non-finite example: it gets clipping factor 0 in training
            if unseen and bool(ref.any()):
                escaped.append(f"{name} (owned by {', '.join(self.engine.plan.owners.get(id(p), ['?']))})")
                continue
            floor = rounding_floor(ref.dtype, scale)
            tol = rtol * max(float(ref.abs().max()), floor / rtol, 1e-12)
            if not torch.allclose(mine, ref, rtol=rtol, atol=tol):
                escaped.append(f"{name} (owned by {', '.join(self.engine.plan.owners.get(id(p), ['?']))})")
        if escaped:
            raise with_enclosable(UnsupportedLayerError(
                "The hooks' sum of per-example gradients differs from autograd's gradient for these trainable "
                "parameters, so their gradient could not be clipped per example:\n  " + "\n  ".join(escaped)
                + "\nTypical cause: a use outside the forward of the module that owns them, which the per-layer "
                "hooks do not see (a parent module reads `child.weight` directly, or applies it with a functional "
                "call; its uses are then covered by re-running the smallest enclosing module per example when "
                "one can be, which is not the case here), or random operations hf_dp cannot switch off for this "
                "check (dropout applied functionally with a probability read from the config). Freeze these "
                "parameters "
                "(`model.get_parameter(name).requires_grad_(False)`; a parameter tied to another, like an input "
                "embedding tied to the LM head, is then frozen in both places) or train "
                "the model through a PEFT adapter (LoRA)."
            ), [e.split(" (owned by")[0] for e in escaped])

    def check_single_examples(self, run_losses: Callable[[slice], torch.Tensor], batch_size: int,
                              num_single: int = 2, rtol: float = 1e-3, mode: str = "") -> None:
        """The expensive check (``dp_self_check``): each of the first ``num_single`` examples' gradient norm in its
        micro-batch equals its norm alone, so nothing mixes examples (batch statistics, attention across the batch,
        inputs shared by the batch). Needs ``batch_size ≥ 2`` to mean anything; non-finite examples are skipped
        (they get clipping factor 0 in training)."""
        saved = self._saved_state()
        try:
            batched = self.recorded_norms(lambda: run_losses(slice(0, batch_size)), batch_size)
            for p in self.engine.params.values():
                p.grad = None
            for i in range(min(num_single, batch_size)):
                # per example: unit regrouping is exact tensor algebra, tested separately
                alone = float(self.recorded_norms(lambda i=i: run_losses(slice(i, i + 1)), 1)[0])
                problem = norm_alone_problem(i, float(batched[i]), alone, batch_size, self._rtol(rtol), mode)
                if problem is not None:
                    raise UnsupportedLayerError(
                        f"{problem}: the model or the per-example loss mixes examples (batch statistics, "
                        "attention or pooling across the batch, or an input shared by the batch; a per_example_loss "
                        "that reads other examples' outputs, such as in-batch negatives, or that divides by a count "
                        "over the batch, such as its number of tokens), so per-example clipping would not bound an "
                        "example's contribution. Find the layer that computes across the batch and freeze it or "
                        "replace it by a per-example one; make per_example_loss compute each example's loss from its "
                        "own row of the outputs only."
                    )
        finally:
            self._restore_state(saved)

    def check_counterfactual(self, run_batch: Callable[[], torch.Tensor], rows: int, num_examples: int,
                             alone: dict[int, Callable[[], torch.Tensor]], rtol: float = 1e-3,
                             segments: torch.Tensor | None = None, what: str = "",
                             units: torch.Tensor | None = None) -> None:
        """Each example's loss and gradient in its micro-batch equal those of the example *alone* (DESIGN inv. 12).

        ``run_batch()`` runs the model on a collated micro-batch of ``rows`` rows holding ``num_examples`` examples
        (``segments``: packed rows, :meth:`record`) and returns their losses ``(num_examples,)``; ``alone[i]()`` runs
        example ``i`` as it would be had it been sampled alone (collated alone by the training collator: its own
        length, padding and positions) and returns its loss ``(1,)``. Compared, for every ``i`` in ``alone``:

        1. the loss ``L_i`` in the batch with ``L_i`` alone;
        2. the norm of ``G_i`` from the hooks in the batch (what the DP step clips) with autograd's ``‖∇L_i‖`` alone;
        3. the full vector: the hooks' weighted sum ``Σ_i c_i G_i`` (what the DP step releases, with random factors
           ``c_i ∈ [0.5, 1.5]`` for the checked examples and 0 for the others) with ``Σ_i c_i ∇L_i`` alone, for every
           parameter. With distinct random factors a mismatch of any one example's vector cannot cancel.

        Autograd's gradients are taken on stand-in parameters (``.grad`` and user hooks are never touched). Raises
        :class:`UnsupportedLayerError` naming the example, what differs and by how much. ``what`` names the batch.

        ``units``: ``(rows,)``, the example ``0..num_examples-1`` each model row belongs to, when an example is several
        model rows (a preference row's two sequences, ``hf_dp/preference.py``): norms and factors are then per example,
        the norm of the sum over its rows (the engine's ``record`` with ``units``).
        """
        if not alone:
            return
        saved = self._saved_state()
        try:
            gen = torch.Generator().manual_seed(12345)
            factors = torch.zeros(num_examples, dtype=torch.float64)
            checked = sorted(alone)
            factors[checked] = 0.5 + torch.rand(len(checked), generator=gen, dtype=torch.float64)
            # The factors are known before the backward: each parameter is clipped inside it, as in training
            # (checkpointing.clipped_in_backward), not all factors kept to its end (the memory of a step's activations).
            # An example with a non-finite loss gets factor 0 (as in training), set before the backward; one whose
            # norm of a parameter is not finite gets factor 0 for that parameter (clipped_in_backward), and its
            # gradient of that parameter is left out of the reference below too.
            with self.engine.record(rows, segments=segments, units=units), \
                    clipped_in_backward(self.engine, factors) as (sq, live):
                losses = run_batch()
                if losses.shape != (num_examples,):
                    raise ValueError(f"per_example_loss must return shape ({num_examples},), got "
                                     f"{tuple(losses.shape)}.")
                live[~torch.isfinite(losses.detach()).to(live.device)] = 0.0
                if losses.requires_grad:
                    losses.sum().backward()
            self._see_precision()
            rtol = self._rtol(rtol)
            losses = losses.detach().double().cpu()
            factors[~torch.isfinite(losses)] = 0.0
            hook_norms = (torch.stack([v.double() for v in sq.values()]).sum(0).sqrt().cpu() if sq
                          else torch.zeros(num_examples, dtype=torch.float64))
            unseen = {n: ~torch.isfinite(v.double().cpu()) for n, v in sq.items()}  # left out per parameter
            hooked, self.engine.summed_grads = self.engine.summed_grads, {}
            self.engine.clear()
            names = list(self.engine.params)
            ref: dict[str, torch.Tensor] = {}
            problems = []
            for i in checked:
                with stand_ins(self.engine.model, self.engine.params) as replaced:
                    single = alone[i]()
                    grads = [None] * len(names)
                    if single.requires_grad:
                        # .backward(), not autograd.grad: reentrant activation checkpointing (transformers'
                        # default under peft.prepare_model_for_kbit_training) supports only .backward()
                        single.sum().backward()
                        grads = [replaced[n].grad for n in names]
                single = float(single.detach().double().reshape(-1)[0])
                norm_sq = 0.0
                for n, g in zip(names, grads):
                    if g is None or not torch.isfinite(g).all():
                        continue
                    norm_sq += float(g.double().pow(2).sum())
                    if n not in unseen or not bool(unseen[n][i]):
                        ref[n] = ref.get(n, 0) + float(factors[i]) * g.double()
                mine, theirs = float(losses[i]), single
                if not (math.isfinite(mine) and math.isfinite(theirs)):
                    continue  # a non-finite example gets clipping factor 0 in training
                if abs(mine - theirs) > rtol * max(abs(theirs), 1e-8) + 1e-10:
                    problems.append(f"example {i}'s loss is {mine:.8g} in the batch but {theirs:.8g} alone")
                    continue
                norm = math.sqrt(norm_sq)
                if abs(float(hook_norms[i]) - norm) > rtol * max(norm, 1e-12) + 1e-12:
                    problems.append(f"example {i}'s gradient norm is {float(hook_norms[i]):.8g} in the batch (what "
                                    f"is clipped) but {norm:.8g} alone")
            if not problems:
                scale = max((float(g.abs().max()) for g in ref.values() if g.numel()), default=0.0)
                for n in names:
                    r, m = ref.get(n), hooked.get(n)
                    if r is None and m is None:
                        continue
                    r = torch.zeros_like(self.engine.params[n], dtype=torch.float64) if r is None else r
                    m = torch.zeros_like(r) if m is None else m.to(r.device, torch.float64)
                    floor = rounding_floor(self.engine.params[n].dtype, scale)
                    tol = rtol * max(float(r.abs().max()) if r.numel() else 0.0, floor / rtol, 1e-12)
                    if not torch.allclose(m, r, rtol=rtol, atol=tol):
                        problems.append(f"the clipped sum of {n} differs from the sum of the examples' gradients "
                                        f"alone (max difference {float((m - r).abs().max()):.3g})")
                        break
            if problems:
                raise UnsupportedLayerError(
                    f"An example's loss depends on the other rows of its batch{what}: " + "; ".join(problems) + ".")
        finally:
            self._restore_state(saved)
