"""Run-time checks of the DP guarantee (DESIGN invariant 8): what was true at construction is checked again where it
can stop being true, and a violation stops the run before anything is released.

The DP-SGD release of one step (Abadi et al. 2016, Alg. 1) is ``(Σ_{i∈B} clip_C(g_i) + N(0, σ²C²)) / (qN)``. It
is a DP release only if (a) every gradient the optimizer applies is that noised sum — no parameter outside the
clipping engine carries a gradient, none is modified after the release but by post-processing; (b) each ``g_i`` is
one sampled example's gradient — the collated batch has one row per sampled example; (c) the batch is the Poisson
sample the accountant assumes — the Trainer's loader draws from the DP sampler; (d) one non-finite example cannot
poison the sum (it gets clipping factor 0 and its rows are zeroed: ``clipping/modes.py``, ``clipping/engine.py``).
This module holds those checks and the privacy-budget checks (no step is released beyond ``target_epsilon``); the
trainer calls them at train start, at collation, at every step's first chunk and before every optimizer step.
"""

from __future__ import annotations

import contextlib
import math
import os
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["ReleasedStateGuard", "post_processing", "optimizer_tensors", "StepGradientGuard",
           "trainable_set_difference", "describe_difference", "check_trainable_set_change",
           "discard_stale_gradients", "check_step_gradients", "nonfinite_message", "check_batch_rows",
           "check_train_loader", "overriding_class", "check_train_sampler_not_overridden", "check_optimizer_holds",
           "check_delta",
           "check_noise_std", "check_budget_left",
           "steps_within_budget", "budget_allows", "check_not_compiled", "check_something_trainable",
           "setting_notes", "choices_on_eval_metrics", "check_training_setup", "check_step_mechanism",
           "check_optimizer_updates_in_step", "gradient_hooked_parameters", "check_no_gradient_hooks",
           "check_mixed_precision", "check_full_graph_compile"]

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx", "max_length_q", "max_length_k")


# ---------------------------------------------------------------------- the trainable set
def trainable_set_difference(model: nn.Module, engine_params: Mapping[str, nn.Parameter], by_name: bool = False
                             ) -> tuple[list[str], list[str]]:
    """``(added, removed)``: trainable parameters of ``model`` that the engine does not clip, and parameters the
    engine clips that are no longer trainable parameters of ``model`` — compared by identity, not by name (a
    replaced module has new parameters under the old names). ``by_name``: compared by name (FSDP2's engine keeps
    ``meta`` stand-ins, since FSDP swaps the parameters)."""
    if by_name:
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        return sorted(trainable - set(engine_params)), sorted(set(engine_params) - trainable)
    current = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    clipped = {id(p): n for n, p in engine_params.items()}
    added = [n for pid, n in current.items() if pid not in clipped]
    removed = [n for pid, n in clipped.items() if pid not in current]
    return added, removed


def describe_difference(added: list[str], removed: list[str], limit: int = 6) -> str:
    def short(names: list[str]) -> str:
        return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")

    parts = []
    if added:
        parts.append(f"newly trainable or replaced: {short(added)}")
    if removed:
        parts.append(f"no longer trainable or removed: {short(removed)}")
    return "; ".join(parts)


def check_trainable_set_change(what: str, *, sharded: bool, at_step_boundary: bool, at_train_begin: bool,
                               group_clipping: str | None) -> None:
    """The trainable set changed since the engine was built (``what``: :func:`describe_difference`): raise unless
    the engine may be rebuilt now so that every trainable parameter is clipped per example.

    Rebuilding is allowed at train start, and at a step boundary for flat clipping. It is refused under FSDP
    (``sharded``: the engine is built before the model is wrapped), inside a step (the examples of this step already
    clipped did not include the change), and during training under group-wise clipping (``group_clipping``: the
    mode, whose groups, thresholds and noise allocation were fixed at train start).
    """
    if sharded:
        raise RuntimeError(
            f"hf_dp: the trainable parameters changed after DPTrainer was built ({what}). Under FSDP the clipping "
            "engine cannot be rebuilt: set requires_grad before constructing DPTrainer."
        )
    if not at_train_begin and not at_step_boundary:
        raise RuntimeError(
            f"hf_dp: the trainable parameters changed in the middle of a DP step ({what}); the examples of this "
            "step already clipped did not include them. Change requires_grad or modules only at a step boundary "
            "(on_step_begin / on_step_end of a callback) or before train()."
        )
    if not at_train_begin and group_clipping is not None:
        raise RuntimeError(
            f"hf_dp: the trainable parameters changed during training ({what}) under "
            f"clipping={group_clipping!r}, whose groups, thresholds and noise allocation were fixed at train "
            "start. Set requires_grad before train() (or use clipping='flat', whose engine is rebuilt at the "
            "next step)."
        )


# ---------------------------------------------------------------------- only the DP release changes what is released
_ACTIVE_GUARDS: weakref.WeakSet[ReleasedStateGuard] = weakref.WeakSet()
_POST_PROCESSING_DEPTH = [0]

_ADVICE_POST = ("A change computed from the released model alone (an EMA or average of the weights, a perturbation "
                "that is undone, a public-data step) is post-processing: make it inside `with hf_dp.post_processing():`"
                ". A change computed from the training data (a forward or backward on private examples, running "
                "statistics) is not covered by the DP guarantee: remove it.")


def optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """Every tensor in the optimizer's param groups (``param_groups[g]["params"]``), in order (none: no optimizer)."""
    groups = getattr(optimizer, "param_groups", None) or []
    return [t for g in groups for t in g.get("params", ()) if isinstance(t, torch.Tensor)]


def _innermost_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The ``torch.optim.Optimizer`` that applies the update, where step hooks fire (accelerate's
    ``AcceleratedOptimizer`` wraps it as ``.optimizer`` without running ``Optimizer.__init__``); None if there is
    none (then the trainer's callbacks bracket the step instead)."""
    inner = optimizer
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer
    if isinstance(inner, torch.optim.Optimizer) and "_optimizer_step_pre_hooks" in vars(inner):
        return inner
    return None


def _key(t: torch.Tensor) -> tuple[int, int]:
    """(version counter, storage pointer): an in-place op bumps the first, ``p.data = x`` changes the second."""
    return t._version, (t.data_ptr() if t.layout == torch.strided else id(t))


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` holds exactly what ``a`` holds (read only when a tracked tensor was replaced: rare, small)."""
    return (a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and a.layout == b.layout
            and bool(torch.equal(a.detach(), b.detach())))


class ReleasedStateGuard:
    """DESIGN invariant 10: between two DP steps nothing that is saved, pushed or used by the next step changes,
    except by the optimizer applying the gradients the DP step wrote.

    Tracked: every parameter (trainable or frozen) and every buffer (persistent or not) of the model, and every
    tensor in the optimizer's param groups, in the model or not. :meth:`snapshot` records each one's identity,
    storage pointer and version counter (every in-place op bumps it: ``add_``, ``copy_``, ``load_state_dict``, an
    optimizer's update); it is taken at train start and after every :func:`post_processing` block, and re-keyed right
    after every ``optimizer.step()``. Compared (:meth:`check`) at each DP step's first chunk (changes between steps,
    walking the modules: a replaced module or parameter is seen), at its release and when the step raises (changes
    inside it: forward, backward, first-step checks; walking again), right before ``optimizer.step()`` (a pre-step
    hook on the ``torch.optim.Optimizer``, after every callback) and before anything is saved; right after
    ``optimizer.step()`` the tensors the optimizer does not hold must be unchanged. The first difference stops the
    run, naming the tensor. Cost: two walks over the modules per step and one integer comparison per tensor at each
    point, host-side only (``benchmarks/guard_cost.py``).

    Not seen: a write through ``p.data`` (``p.data.add_(x)``, ``p.data.copy_(x)``), which has its own version counter
    (``p.data = x`` is seen: the storage changes); state the user's code keeps outside the model and the optimizer;
    the optimizer's own state (moments), which only ``optimizer.step()`` updates. FSDP2 runs without it (README).
    """

    def __init__(self) -> None:
        self.model: nn.Module | None = None
        self.optimizer: Any = None
        self.active = False
        self.in_step = False
        self.hooked = False  # the optimizer's step hooks bracket optimizer.step()
        self.post_processing_blocks = 0  # post_processing() blocks entered while active
        self._tensors: list[torch.Tensor] = []  # every tracked tensor, in walk order (identity)
        self._unique: list[torch.Tensor] = []  # each once (tied weights, the optimizer's model parameters)
        self._keys: list[tuple[int, int]] = []  # of _unique
        self._buffer_values: dict[int, torch.Tensor] = {}  # a copy of every buffer at the snapshot
        self._held: set[int] = set()
        self._handles: list[Any] = []
        self._switched: list[tuple[Any, str]] = []

    # ------------------------------------------------------------------ life cycle
    def start(self, model: nn.Module, optimizer: Any) -> None:
        """At train start (after the optimizer is built and any checkpoint is loaded): hook the optimizer, snapshot."""
        self.stop()
        self.model, self.optimizer = model, optimizer
        inner = _innermost_optimizer(optimizer)
        if inner is not None:
            self._handles = [inner.register_step_pre_hook(self._pre_step_hook),
                             inner.register_step_post_hook(self._post_step_hook)]
            self._wrap_mode_switches(inner)
        self.hooked = inner is not None
        self.active = True
        self.in_step = False
        _ACTIVE_GUARDS.add(self)
        self.snapshot()

    def stop(self) -> None:
        """At train end (or when ``train()`` raises): unhook; nothing is tracked until the next :meth:`start`."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for inner, name in self._switched:
            inner.__dict__.pop(name, None)  # the class's method again
        self._switched = []
        self.active = self.in_step = False
        _ACTIVE_GUARDS.discard(self)
        self._tensors, self._unique, self._keys, self._held = [], [], [], set()
        self._buffer_values = {}

    # ------------------------------------------------------------------ snapshot and comparison
    def _collect(self) -> list[torch.Tensor]:
        out = [t for m in self.model.modules() for d in (m._parameters, m._buffers) for t in d.values()
               if t is not None]
        return out + optimizer_tensors(self.optimizer)

    def snapshot(self) -> None:
        if not self.active:
            return
        self._tensors = self._collect()
        self._unique = list({id(t): t for t in self._tensors}.values())
        self._keys = [_key(t) for t in self._unique]
        self._held = {id(t) for t in optimizer_tensors(self.optimizer)}
        # Buffers are small and change only by writes we refuse: a copy tells an in-place write of the same values
        # (transformers' longrope rotary embedding copies the short-range frequencies into inv_freq in every forward
        # below its length limit) from a change. Taken at train start and after post_processing(), not every step.
        self._buffer_values = {id(b): b.detach().clone() for m in self.model.modules() for b in m._buffers.values()
                               if b is not None}

    def changed(self, skip_held: bool = False, walk: bool = True) -> list[str]:
        """Names of the tracked tensors changed since the last snapshot (``skip_held``: except the optimizer's).

        ``walk``: also walk the modules and the param groups for tensors added, removed or replaced (most of the
        cost); without it, only the snapshot's tensors are compared (right around ``optimizer.step()``, where the
        next walk, at the next step's first chunk or before a save, still sees a replacement made there)."""
        if not self.active:
            return []
        current = None
        if walk:
            current = self._collect()
            if len(current) == len(self._tensors) and all(a is b for a, b in zip(current, self._tensors)):
                current = None  # the same tensors
            else:
                replaced = self._replaced(current)
                if replaced:
                    return replaced
        bad = [t for t, k in zip(self._unique, self._keys) if _key(t) != k and not (skip_held and id(t) in self._held)]
        if bad:
            bad = [t for t in bad if not (id(t) in self._buffer_values and _same_values(self._buffer_values[id(t)], t))]
        if bad:
            names = self._names()
            return list(dict.fromkeys(names.get(id(t), f"a tensor of shape {tuple(t.shape)}") for t in bad))
        if current is not None:  # only replacements by equal values (a cache re-registered as it was): adopted
            self.snapshot()
        return []

    def _replaced(self, current: list[torch.Tensor]) -> list[str]:
        """Names of the tensors added, removed or replaced since the snapshot; a tensor replaced by one of the same
        dtype, shape, device and values is no change (transformers' ``longrope`` rotary embedding re-registers
        ``inv_freq`` from ``original_inv_freq`` in every forward below its length limit)."""
        if len(current) == len(self._tensors):
            pairs = [(a, b) for a, b in zip(self._tensors, current) if a is not b]
            if all(_same_values(a, b) for a, b in pairs):
                return []
        before = {id(t) for t in self._tensors}
        now = {id(t) for t in current}
        names = self._names()
        added = [names.get(id(t), f"a tensor of shape {tuple(t.shape)}") + " (new or replaced)"
                 for t in current if id(t) not in before]
        removed = [f"a tensor of shape {tuple(t.shape)} (removed or replaced)"
                   for t in self._tensors if id(t) not in now]
        return list(dict.fromkeys(added + removed)) or ["the order of the model's tensors (modules moved)"]

    def _names(self) -> dict[int, str]:
        """``{id: "name (kind)"}`` of every tracked tensor (only computed to name a violation)."""
        names: dict[int, str] = {}
        for mname, m in self.model.named_modules(remove_duplicate=False):
            prefix = f"{mname}." if mname else ""
            for n, p in m._parameters.items():
                if p is not None:
                    names.setdefault(id(p), f"{prefix}{n} ({'trainable' if p.requires_grad else 'frozen'} parameter)")
            for n, b in m._buffers.items():
                if b is not None:
                    kind = "non-persistent buffer" if n in m._non_persistent_buffers_set else "buffer"
                    names.setdefault(id(b), f"{prefix}{n} ({kind})")
        for gi, g in enumerate(getattr(self.optimizer, "param_groups", None) or []):
            for pi, t in enumerate(g.get("params", ())):
                names.setdefault(id(t), f"optimizer.param_groups[{gi}]['params'][{pi}] (a tensor of shape "
                                        f"{tuple(t.shape)} that the optimizer trains but is not part of the model)")
        return names

    def check(self, where: str, walk: bool = True) -> None:
        """Refuse any change since the last snapshot; ``where``: ``"between_steps"``, ``"in_step"``,
        ``"before_optimizer_step"``, ``"before_save"`` or ``"post_processing"`` (``walk``: :meth:`changed`)."""
        changed = self.changed(walk=walk)
        if changed:
            self._refuse(changed, where)

    def _refuse(self, changed: list[str], where: str) -> None:
        listed = ", ".join(changed[:8]) + (f" (+{len(changed) - 8} more)" if len(changed) > 8 else "")
        head = "hf_dp: only the DP release may change what is trained, saved or pushed (DESIGN invariant 10), but "
        if where == "in_step":
            msg = (f"these tensors changed inside a DP step (the forward, backward or first-step checks on the private "
                   f"batch): {listed}. A module that writes its own weights or buffers from the batch it sees (running "
                   "statistics, a cache sized by the batch, a renormalisation such as nn.Embedding(max_norm=...), a "
                   "loss that updates a tensor in place) carries private data into the next step and the checkpoint "
                   "without clipping or noise. Make the module stop writing in train mode; a learnable value must be "
                   "a trainable parameter of a supported layer, whose update is the DP release.")
        elif where == "optimizer_step":
            msg = (f"optimizer.step() changed tensors that are not in its param groups: {listed}. Only the "
                   "optimizer's own parameters may be updated, and only from the gradients the DP step wrote.")
        elif where == "optimizer_step_unhooked":  # no step hooks: a later callback's on_pre_optimizer_step, or the step
            msg = (f"these tensors, which the optimizer does not hold, changed after this step's DP release and "
                   f"before the end of optimizer.step(): {listed}. " + _ADVICE_POST)
        else:
            span = {"between_steps": "between two DP steps (after the last optimizer step, before this step's "
                                     "first forward: in a callback, an evaluation, a save)",
                    "before_optimizer_step": "after this step's DP release and before optimizer.step()",
                    "before_save": "since the last optimizer step, before saving",
                    "post_processing": "outside any hf_dp.post_processing() block (before this one began)",
                    "train_end": "after the last optimizer step, before the end of train()"}.get(where, where)
            msg = f"these tensors changed {span}: {listed}. " + _ADVICE_POST
        raise RuntimeError(head + msg + " Training stopped before the change was released.")

    # ------------------------------------------------------------------ the points of the step
    def begin_step(self) -> None:
        """A DP step's first chunk: nothing changed since the last optimizer step (or post-processing)."""
        if self.active:
            self.check("between_steps")
            self.in_step = True

    def before_release(self) -> None:
        """The DP step is about to release (or, at a budget stop, to release nothing): nothing changed inside it."""
        if self.active:
            self.check("in_step")
            self.in_step = False

    def explain(self, err: BaseException) -> None:
        """The DP step raised ``err``: if a tracked tensor changed inside the step (a frozen weight written in the
        forward makes autograd's backward fail first), refuse with that cause instead, chained to ``err``. hf_dp's own
        errors already name their cause (e.g. the engine's check of persistent buffers) and are kept."""
        if not (self.active and self.in_step) or type(err).__module__.startswith("hf_dp."):
            return
        changed = self.changed()
        if changed:
            try:
                self._refuse(changed, "in_step")
            except RuntimeError as refusal:
                raise refusal from err

    def optimizer_stepped(self) -> None:
        """Right after ``optimizer.step()``: what the optimizer does not hold is unchanged; new snapshot."""
        if not self.active:
            return
        changed = self.changed(skip_held=True, walk=False)
        if changed:
            self._refuse(changed, "optimizer_step" if self.hooked else "optimizer_step_unhooked")
        self._keys = [_key(t) for t in self._unique]  # the same tensors (the next walk compares their identity)

    def _wrap_mode_switches(self, inner: Any) -> None:
        """Schedule-free optimizers (Defazio et al. 2024) swap the weights in place in ``train()`` / ``eval()`` (the
        Trainer calls ``eval()`` before evaluating; the DP step calls ``train()`` at each chunk): a function of the
        optimizer's state, so an optimizer operation like its step. Wrapped on the instance while tracking: what
        changed before the switch is checked, the switch itself is taken into the snapshot."""
        for name in ("train", "eval"):
            original = getattr(inner, name, None)
            if not callable(original) or name in inner.__dict__:
                continue

            def switched(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                self.check("in_step" if self.in_step else "between_steps", walk=False)
                out = _original(*args, **kwargs)
                self._keys = [_key(t) for t in self._unique]
                return out

            inner.__dict__[name] = switched
            self._switched.append((inner, name))

    def _pre_step_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.check("before_optimizer_step", walk=False)

    def _post_step_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.optimizer_stepped()


@contextlib.contextmanager
def post_processing() -> Iterator[None]:
    """Declare that the changes to the model or the optimizer's tensors made inside are post-processing of the DP
    release: computed from the released model (and public data) alone, such as an EMA of the weights or a
    perturbation that is undone before the next update (Dwork & Roth 2014, Prop. 2.1: post-processing keeps DP).

    During ``DPTrainer.train()`` every change between DP steps outside such a block is refused
    (:class:`ReleasedStateGuard`); inside a DP step (the forward and backward on the private batch) the block itself
    is refused. The declaration is the user's: hf_dp cannot see what a change was computed from. Outside ``train()``
    it does nothing. hf_dp's own callbacks (``hf_dp.callbacks``) change weights only inside it.
    """
    guards = [g for g in list(_ACTIVE_GUARDS) if g.active]
    outermost = _POST_PROCESSING_DEPTH[0] == 0
    if outermost:
        for g in guards:
            if g.in_step:
                raise RuntimeError(
                    "hf_dp.post_processing() inside a DP step (between its first forward and its release): the model "
                    "is then computing on the private batch, and a change made there is not post-processing of a "
                    "release. Change weights between steps (on_step_begin / on_step_end / on_pre_optimizer_step of a "
                    "callback) instead.")
            g.check("post_processing")
            g.post_processing_blocks += 1
    _POST_PROCESSING_DEPTH[0] += 1
    try:
        yield
    finally:
        _POST_PROCESSING_DEPTH[0] -= 1
        if outermost:
            for g in guards:
                g.snapshot()


# ---------------------------------------------------------------------- the model handed to DPTrainer
def check_not_compiled(model: Any) -> None:
    """Refuse a model wrapped by ``torch.compile`` (an ``OptimizedModule``): the clipping engine hooks the model's
    own layers and calls its forward; the Trainer's own ``torch_compile=True`` compiles the model DPTrainer hooks."""
    from accelerate.utils import is_compiled_module

    if model is not None and is_compiled_module(model):
        raise ValueError(
            "hf_dp: the model was passed through torch.compile (an OptimizedModule). DPTrainer hooks the model's own "
            "layers to clip each example's gradient, and needs the model itself. Pass the uncompiled model and set "
            "DPTrainingArguments(torch_compile=True): the Trainer then compiles it after DPTrainer has hooked its "
            "layers, and the per-example clipping stays exact. (The clipping hooks split the compiled graph, so "
            "expect little or no speed-up, and a slow first step while torch.compile retraces.)"
        )


def check_something_trainable(model: nn.Module) -> None:
    """Refuse a model with no trainable parameter: every DP step would spend privacy budget and change nothing."""
    if model is not None and not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            "hf_dp: the model has no trainable parameter (every parameter has requires_grad=False), so a DP step "
            "would have nothing to update while spending privacy budget. Unfreeze what you want to train (e.g. "
            "`model.classifier.requires_grad_(True)`) before calling train(), or pass peft_config=... to DPTrainer "
            "to train an adapter. To only evaluate a model, use transformers.Trainer.evaluate."
        )


# ---------------------------------------------------------------------- the gradients the optimizer applies
def discard_stale_gradients(model: nn.Module) -> int:
    """At a step's first chunk no parameter should hold a gradient (the Trainer zeroes them after every optimizer
    step); one computed outside the DP step (e.g. a callback's backward in ``on_step_begin``) is dropped, never
    applied, and never mistaken for the hooks' by the self-check. Returns how many were dropped."""
    stale = [p for p in model.parameters() if p.grad is not None]
    for p in stale:
        p.grad = None
    return len(stale)


class StepGradientGuard:
    """Before each optimizer step: every ``.grad`` is the tensor the DP release of this step wrote, unmodified.

    :meth:`released` records, right after ``.grad`` is written, each tensor's identity and version counter. At
    :meth:`check` (``TrainerCallback.on_pre_optimizer_step``) a parameter may carry no gradient or exactly that tensor;
    an in-place change (a plain ``backward()`` accumulates into an existing ``.grad`` in place, bumping its version)
    is refused, except the one in-place rescaling by ``clip_grad_norm_`` the Trainer does before every optimizer step
    (with ``max_grad_norm``, or with an infinite bound to measure the norm): post-processing of the released gradient.
    A step without a release (budget stop) must leave every gradient empty.
    """

    def __init__(self) -> None:
        self._written: dict[int, tuple[torch.Tensor, int, int]] = {}
        self.has_released = False

    def released(self, params: Iterable[nn.Parameter]) -> None:
        grads = [(p, p.grad) for p in params if p.grad is not None]
        # Views of one buffer (the distributed release is one all-reduced flat tensor) share one version counter:
        # an in-place op on each of k views advances it k times. Record k with each gradient.
        shared = Counter(g.untyped_storage().data_ptr() for _, g in grads)
        self._written = {id(p): (g, g._version, shared[g.untyped_storage().data_ptr()]) for p, g in grads}
        self.has_released = True

    def reset(self) -> None:
        self._written = {}
        self.has_released = False

    def check(self, model: nn.Module, allowed_version_bumps: int = 0, optimizer: Any = None) -> None:
        """``optimizer``: its param groups' tensors outside the model are checked too (one handed to the optimizer and
        used in the loss gets an unclipped, un-noised gradient from the backward of ``Σ_i L_i``)."""
        escaped, modified = [], []
        named = list(model.named_parameters())
        in_model = {id(p) for _, p in named}
        outside = [(f"optimizer.param_groups[{gi}]['params'][{pi}] (shape {tuple(t.shape)}, not part of the model)", t)
                   for gi, g in enumerate(getattr(optimizer, "param_groups", None) or [])
                   for pi, t in enumerate(g.get("params", ())) if id(t) not in in_model]
        for name, p in named + outside:
            if p.grad is None:
                continue
            mine = self._written.get(id(p))
            if mine is None or p.grad is not mine[0]:
                escaped.append(name)
            elif p.grad._version > mine[1] + allowed_version_bumps * mine[2]:
                modified.append(name)
        self.reset()
        if escaped:
            raise RuntimeError(
                "hf_dp: before this optimizer step, these parameters carry a gradient that DPTrainer's DP step did "
                f"not write (it was never clipped nor noised): {', '.join(escaped[:8])}"
                + (f" (+{len(escaped) - 8} more)" if len(escaped) > 8 else "") + ". Typical causes: a subclass's "
                "`training_step` that calls `loss.backward()` / `accelerator.backward()` itself instead of "
                "`super().training_step(...)`, a callback that runs a backward pass, or a parameter made trainable "
                "in the middle of a step; or a tensor outside the model handed to the optimizer and used in the loss "
                "(only parameters of the model's supported layers are clipped per example: make it one, or set "
                "requires_grad=False). Compute extra losses through `per_example_loss=` instead. Training stopped "
                "before the optimizer applied it."
            )
        if modified:
            raise RuntimeError(
                "hf_dp: the privatized gradient of these parameters was changed in place after DPTrainer released "
                f"it (e.g. a second backward() accumulated an unclipped gradient into it): "
                f"{', '.join(modified[:8])}. Add any extra loss through `per_example_loss=` so that it is clipped "
                "per example. Training stopped before the optimizer applied it."
            )


def named(names: list[str], shown: int = 6) -> str:
    """The first ``shown`` of ``names`` for a message, and how many more."""
    return ", ".join(names[:shown]) + (f" (+{len(names) - shown} more)" if len(names) > shown else "")


def check_optimizer_holds(optimizer: Any, params: Iterable[tuple[str, nn.Parameter]] | nn.Module, where: str) -> None:
    """Every parameter the DP step releases a gradient for is applied by ``optimizer.step()`` (DESIGN invariant 14).
    One the optimizer does not hold (an optimizer built before ``peft_config`` added the adapter, an adapter switched
    in by ``set_adapter`` during training) is trained by nothing, while its gradient takes part in every example's
    clipping and ε is reported for the run: refused, naming it. Not checked for an optimizer whose param groups are not
    visible. ``params``: ``(name, parameter)`` pairs, or a model (its trainable parameters)."""
    if getattr(optimizer, "param_groups", None) is None:
        return
    if isinstance(params, nn.Module):
        params = [(n, p) for n, p in params.named_parameters() if p.requires_grad]
    held = {id(t) for t in optimizer_tensors(optimizer)}
    missing = [name for name, p in params if id(p) not in held]
    if missing:
        raise ValueError(
            f"hf_dp: the optimizer does not hold these trainable parameters ({where}): "
            f"{named(missing)}"
            + ". The DP step releases a gradient for every trainable parameter and "
            "only optimizer.step() applies it, so they would never train, while their gradients take part in every "
            "example's clipping and ε is reported for the run. Freeze them, or build the optimizer over the model "
            "as it is trained (after peft_config is applied: let the Trainer create it, or pass optimizers= built "
            "on trainer.model; after switching adapters, a new train()). To unfreeze parameters during training "
            "(gradual unfreezing), the optimizer must hold them from the start: the Trainer builds its own over the "
            "parameters trainable when train() begins, so pass optimizers=(torch.optim.AdamW(model.parameters(), "
            "lr=...), None) built over all of them (a frozen parameter gets no gradient and is left alone)."
        )


def gradient_hooked_parameters(params: Iterable[tuple[str, nn.Parameter]] | nn.Module) -> list[str]:
    """Names of the trainable parameters among ``params`` (``(name, parameter)`` pairs, or a model's trainable
    parameters) that carry a hook on their gradient: ``Tensor.register_hook`` (torch keeps it in the leaf's
    ``_backward_hooks``) or ``Tensor.register_post_accumulate_grad_hook`` (``_post_accumulate_grad_hooks``)."""
    if isinstance(params, nn.Module):
        params = [(n, p) for n, p in params.named_parameters() if p.requires_grad]
    return [name for name, p in params if p.requires_grad and (p._backward_hooks or p._post_accumulate_grad_hooks)]


def check_no_gradient_hooks(params: Iterable[tuple[str, nn.Parameter]] | nn.Module, where: str) -> None:
    """No trainable parameter carries a hook on its gradient (DESIGN invariant 14: the release is what trains).

    A parameter's gradient hook (``p.register_hook(fn)``, ``p.register_post_accumulate_grad_hook(fn)``: a masked or
    scaled gradient — training only new tokens' embedding rows, a per-layer gradient scale —, a recorded norm, an
    optimizer step inside the backward) acts on the gradient of the whole batch, never per example, so DP-SGD cannot
    honour it (Abadi et al. 2016, Alg. 1 clips each example's gradient before the sum). Unchecked, it was silently
    dropped by the one-pass step (whose backward leaves the parameters' gradients alone), and under the two-pass step
    (gradient checkpointing) it ran on the clipped sum before the noise: ``g * 100`` moved the update of the
    neighbouring datasets by 100 × C while the noise was calibrated for C; under FSDP2 (which runs the sharded
    parameters' post-accumulate hooks after the reduce-scatter) a hook saw the un-noised clipped sum. Refused at train
    start, at every step's start (a hook added since, e.g. by a callback added after construction, never runs) and
    before every optimizer step (nothing of that step applied)."""
    hooked = gradient_hooked_parameters(params)
    if hooked:
        raise ValueError(
            f"hf_dp: these trainable parameters carry a hook on their gradient ({where}): "
            f"{named(hooked)}"
            + " (Tensor.register_hook / register_post_accumulate_grad_hook). Such a hook acts on the gradient of the "
            "whole batch, but DP-SGD clips each example's gradient and adds noise to their sum: the hook could not "
            "act per example, so it would be silently skipped, or (with gradient checkpointing, or under FSDP) would "
            "see the clipped sum before the noise and could change it beyond the sensitivity the noise is calibrated "
            "for. Remove the hooks (handle.remove()) "
            "before train(). To train only part of a parameter (e.g. new tokens' embedding rows), make that part a "
            "parameter of its own (PEFT's trainable_token_indices) or freeze the rest; scale a layer's updates with "
            "an optimizer param group's lr; a tracker that watches gradients (wandb.watch, WANDB_WATCH='gradients' "
            "or 'all') registers such hooks: leave it off for DP runs."
        )


def check_step_gradients(guard: StepGradientGuard, model: nn.Module, engine_params: Mapping[str, nn.Parameter],
                         allowed_version_bumps: int = 0, optimizer: Any = None) -> None:
    """Before the optimizer step: the gradients are this step's DP release and nothing else
    (:class:`StepGradientGuard`), the trainable set did not change during the step's backward pass (a parameter
    made trainable there got a gradient the engine never clipped), and the optimizer holds every parameter released
    (:func:`check_optimizer_holds`)."""
    check_no_gradient_hooks(engine_params.items(), "before this optimizer step; nothing of it applied")
    released = guard.has_released
    guard.check(model, allowed_version_bumps=allowed_version_bumps, optimizer=optimizer)
    if released and optimizer is not None:
        check_optimizer_holds(optimizer, engine_params.items(), "before this optimizer step; nothing of it applied")
    added, removed = trainable_set_difference(model, engine_params)
    if released and (added or removed):
        raise RuntimeError(
            "hf_dp: the trainable parameters changed during this step's backward pass "
            f"({describe_difference(added, removed)}). Change requires_grad or modules only at a step boundary."
        )


def nonfinite_message(step: int, count: int, total: int) -> str:
    """The warning for ``count`` examples of ``step`` (``total`` so far) with a non-finite loss or gradient norm:
    they got clipping factor 0 (``clipping/modes.py``), so the guarantee holds, but the data needs a look."""
    return (
        f"hf_dp: step {step}: {count} example(s) had a non-finite loss or gradient norm (NaN/inf, e.g. a NaN label); "
        "they got clipping factor 0 (no contribution, the DP guarantee holds) and are left out of the logged loss. "
        f"{total} so far. Check the data."
    )


# ---------------------------------------------------------------------- collated rows
def _batch_rows(batch: Mapping[str, Any]) -> int | None:
    for key in ("labels", "input_ids"):
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return None


def _restarting_positions(batch: Mapping[str, Any]) -> bool:
    """Position ids that fall back to 0 inside a row: several sequences packed into one row."""
    pos = batch.get("position_ids")
    if not isinstance(pos, torch.Tensor) or pos.dim() != 2 or pos.shape[1] < 2:
        return False
    return bool(((pos[:, 1:] == 0) & (pos[:, :-1] > 0)).any())


def check_batch_rows(num_examples: int, batch: Any) -> None:
    """The collated batch must hold one row per sampled example (each row is clipped as one example).

    Padding-free packing (``DataCollatorWithFlattening``, trl's ``packing=True``) concatenates the sampled examples
    into one row: clipped as one example, its sensitivity would be the whole batch's. A collator that drops or merges
    rows changes the sampled set the accountant analyses.
    """
    if not isinstance(batch, Mapping):
        return
    packed = [k for k in _PACKING_KEYS if k in batch]
    rows = _batch_rows(batch)
    if packed or (rows is not None and rows < num_examples and _restarting_positions(batch)):
        raise ValueError(
            f"hf_dp: the data collator packed {num_examples} sampled examples into {rows} row(s) (padding-free "
            f"packing: {', '.join(packed) if packed else 'position_ids restart at 0 inside a row'}). DPTrainer "
            "clips each row as one example, so a packed row's sensitivity would be several examples'. Packing is not "
            "supported by DPTrainer (DPSFTTrainer clips each packed sequence separately); use a padding collator "
            "instead (e.g. DataCollatorWithPadding, DataCollatorForLanguageModeling(mlm=False), or trl with "
            "packing=False)."
        )
    if rows is not None and rows != num_examples:
        raise ValueError(
            f"hf_dp: the data collator turned {num_examples} sampled examples into a batch of {rows} rows. DP-SGD "
            "clips each example's gradient and the accountant analyses the Poisson-sampled set, so the collated "
            "batch must hold exactly one row per example: a collator that drops, merges, splits or duplicates rows "
            "breaks both. Filter or split the dataset before training (Dataset.filter / map), not in the collator."
        )


# ---------------------------------------------------------------------- the train loader
def check_train_loader(loader: Any, dp_sampler: Any) -> None:
    """The loader the Trainer iterates must draw its batches from DPTrainer's Poisson sampler."""
    if dp_sampler is None or getattr(loader, "batch_sampler", None) is not dp_sampler:
        raise ValueError(
            "hf_dp: the train dataloader does not draw its batches from DPTrainer's Poisson sampler: your "
            "get_train_dataloader replaces Poisson sampling (or wraps the loader, e.g. in accelerator.prepare, which "
            "may pad or repeat examples), while ε is computed for Poisson sampling. Remove the override, or return "
            "`super().get_train_dataloader()` unchanged (change the dataset or the data_collator instead)."
        )


# ---------------------------------------------------------------------- subclass overrides
def overriding_class(cls: type, name: str) -> type | None:
    """The class in ``cls``'s MRO that defines ``name`` (None if none does)."""
    return next((c for c in cls.__mro__ if name in vars(c)), None)


def check_train_sampler_not_overridden(cls: type) -> None:
    """Refuse a trainer class of the user's whose ``_get_train_sampler`` the DP train loader would silently ignore
    (a weighted, class-balanced or curriculum sampler): every training batch is drawn by the mechanism's Poisson
    sampler at rate q, the sampling the accountant analyses (DESIGN invariant 4). Checked at construction."""
    owner = overriding_class(cls, "_get_train_sampler")
    if owner is None or owner.__module__.split(".")[0] in ("transformers", "trl", "hf_dp"):
        return
    raise ValueError(
        f"{owner.__name__} overrides _get_train_sampler, but DPTrainer draws every training batch by Poisson "
        "sampling (each example independently with probability q, the sampling the privacy accountant analyses) "
        "and never calls it: your sampler would be silently ignored. To weight examples or classes, weight each "
        "example's loss in per_example_loss=fn (every example's gradient is still clipped at "
        "per_sample_max_grad_norm); a sampler of your own is not covered by the accountant."
    )


# ---------------------------------------------------------------------- arguments that need N or σ
def check_delta(delta: float, n: int) -> None:
    """δ must be below 1/N: releasing one random example in full is already (0, 1/N)-DP."""
    if delta >= 1.0 / n:
        raise ValueError(
            f"target_delta={delta} is not below 1/N = {1.0 / n:.3g} for N={n} privacy units: a mechanism that "
            "publishes one random example in full satisfies (0, 1/N)-DP, so this guarantee protects nobody. Choose "
            "δ well below 1/N (the default is 1/N^1.1; 1/N^2 or 1e-5 for large N are common)."
        )


def check_noise_std(noise_multiplier: float, max_norm: float) -> None:
    """σ·C must be a finite float32 (noise is drawn in the gradient's dtype, float32 at least)."""
    std = float(noise_multiplier) * float(max_norm)
    if not math.isfinite(std) or std >= FLOAT32_MAX:
        raise ValueError(
            f"The noise std σ·C = {noise_multiplier} × {max_norm} overflows float32: the noised gradient would be "
            "non-finite. Lower per_sample_max_grad_norm (C; Li et al. 2022 recommend a small C such as 0.1)."
        )


# ---------------------------------------------------------------------- the privacy budget
def check_budget_left(accountant: Any, target_epsilon: float | None, delta: float) -> None:
    """A second ``train()`` with ``target_epsilon``: refuse when the earlier runs already spent the budget
    (``accountant``: the :class:`~hf_dp.PrivacyAccountant` of the model, which composes over all its runs)."""
    if not accountant.steps or target_epsilon is None:
        return
    spent = accountant.get_epsilon(delta)
    if spent >= target_epsilon:
        raise ValueError(
            f"The privacy budget target_epsilon={target_epsilon} (δ={delta:.3g}) is already "
            f"spent: this model took {accountant.steps} DP steps in earlier train() calls (ε={spent:.4f}), "
            "and ε composes over all of them. Keep the model as it is, or start from a fresh model with a new "
            "DPTrainer (or pass model_init, which builds a fresh model for every train())."
        )


def steps_within_budget(epsilon_after: Callable[[int], float], planned: int, target_epsilon: float | None
                        ) -> int | None:
    """How many more steps the budget allows: the largest ``n <= planned`` with ``epsilon_after(n) <=
    target_epsilon`` (ε is monotone in the steps; bisection), or None when ε is reported rather than targeted."""
    if target_epsilon is None:
        return None
    if planned > 0 and epsilon_after(planned) <= target_epsilon:
        return planned
    lo, hi = 0, max(planned, 1)  # epsilon_after(lo) <= target < epsilon_after(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if epsilon_after(mid) <= target_epsilon else (lo, mid)
    return lo


def budget_allows(steps_this_run: int, n: int, allowed: int | None) -> bool:
    """Whether ``n`` more steps after the ``steps_this_run`` already taken stay within the ``allowed`` steps of this
    run (:func:`steps_within_budget`; None: unlimited). A DP step beyond it is never released."""
    return allowed is None or steps_this_run + n <= allowed


# ---------------------------------------------------------------------- what the guarantee does not cover
def setting_notes(args: Any, noise_multiplier: float | None, early_stopping: bool, hyperparameter_search: bool
                  ) -> list[str]:
    """The run's settings that make its guarantee not the strict (ε, δ)-DP the accountant reports (``dp_guarantee``
    notes; DESIGN invariant 7): no noise, shuffled batches, a fixed ``dp_seed``, choices made on evaluation metrics
    (best checkpoint, ``save_strategy='best'``, ``reduce_lr_on_plateau``, ``early_stopping``), a hyperparameter
    search. ``args``: the run's ``DPTrainingArguments``."""
    notes = []
    if noise_multiplier == 0:
        notes.append("no noise (noise_multiplier=0): not differentially private")
    if not args.poisson_sampling:
        notes.append("shuffled fixed-size batches: the reported ε assumes Poisson sampling")
    if args.dp_seed is not None:
        notes.append("fixed dp_seed: the sampling and the noise are predictable to anyone who knows it")
    notes.extend(note for _, note in choices_on_eval_metrics(args, early_stopping))
    if hyperparameter_search:
        notes.append("hyperparameter search: ε covers one trial's training run; running several trials on the "
                     "private data and selecting among them is not covered")
    return notes


def choices_on_eval_metrics(args: Any, early_stopping: bool) -> list[tuple[str, str]]:
    """The run's choices made on evaluation metrics, each ``(what is chosen, its note)``: the note for evaluation data
    that may be private (:func:`setting_notes`); ``hf_dp/evaluation.py`` names what is chosen when the evaluation
    data is seen to be training rows. One list of such choices for both."""
    out = []
    if args.load_best_model_at_end:
        out.append(("the checkpoint kept (load_best_model_at_end)",
                    "checkpoint selected on evaluation metrics (not covered if the evaluation data is private)"))
    elif args.save_strategy == "best":
        out.append(("the checkpoints saved (save_strategy='best')",
                    "checkpoints saved only when an evaluation metric improved (save_strategy='best'): choosing "
                    "among them is not covered if the evaluation data is private"))
    if args.lr_scheduler_type == "reduce_lr_on_plateau":
        out.append(("the learning rate (reduce_lr_on_plateau)",
                    "learning rate lowered by evaluation metrics (reduce_lr_on_plateau): not covered if the "
                    "evaluation data is private"))
    if early_stopping:
        out.append(("when training stopped (EarlyStoppingCallback)",
                    "training stopped early by evaluation metrics (EarlyStoppingCallback): not covered if the "
                    "evaluation data is private"))
    return out


# ---------------------------------------------------------------------- the mechanism of a step
def drawn_rate(sampler: Any) -> float | None:
    """The rate at which ``sampler`` (``sampling.py``) draws each step: q of Poisson sampling, B/N of shuffled
    batches; ``None`` for a sampler that is not hf_dp's (``check_train_loader`` refuses it at train start)."""
    if getattr(sampler, "sample_rate", None) is not None:
        return float(sampler.sample_rate)
    if getattr(sampler, "batch_size", None) is not None and getattr(sampler, "num_examples", None):
        return sampler.batch_size / sampler.num_examples
    return None


def check_step_mechanism(sampler: Any, sample_rate: float, step_clip: float | None, clip: float | None,
                         chunks: int | None = None) -> None:
    """DESIGN invariants 4-6: the step released is the mechanism the accountant records. The accountant records
    q = B/N from the arguments and the training set as they are when the step is released (read live, so that a
    hyperparameter search may set them), but the loader's sampler drew the step at the rate fixed when it was built
    (``drawn_rate``): a callback that changes ``per_device_train_batch_size``, ``gradient_accumulation_steps`` or
    ``trainer.train_dataset`` during ``train()`` would have ε computed for a q the batches were not drawn with (a
    smaller q: a smaller ε than the run spent). Flat clipping reads C at every chunk and for the noise: C changed
    between the chunks of a step (``step_clip`` at the first chunk, ``clip`` now) would noise at σ·C a sum whose
    examples were clipped at a larger C. Either is refused before the step is released. ``chunks``: the Trainer's
    chunks per step (``gradient_accumulation_steps``, read live); the sampler draws each step as the number of chunks
    fixed when it was built (``num_chunks``). Changed with q kept (batch size and accumulation changed together), the
    Trainer's step would end inside a draw or span two: refused with that cause (it was refused at the next step as
    a sampler/loop misalignment, or, with loader workers, the draws cut in two were discarded step after step)."""
    drawn = drawn_rate(sampler)
    if drawn is not None and not math.isclose(drawn, sample_rate, rel_tol=1e-9, abs_tol=0.0):
        raise RuntimeError(
            f"hf_dp: this step was drawn at sampling rate q = {drawn:.6g} (the train loader's sampler, built at "
            f"train start), but the accountant would record q = {sample_rate:.6g}: per_device_train_batch_size, "
            "gradient_accumulation_steps or the training set (trainer.train_dataset) changed after the loader was "
            "built, so ε would not be the privacy this run spends. Nothing of this step was released. Set them "
            "before train(); to change them, end this train() and call train() again (a new loader is built and "
            "the accountant composes both mechanisms)."
        )
    drawn_chunks = getattr(sampler, "num_chunks", None)
    if chunks is not None and drawn_chunks is not None and drawn_chunks != chunks:
        raise RuntimeError(
            f"hf_dp: gradient_accumulation_steps is {chunks}, but the train loader's sampler, built at train start, "
            f"draws each DP step as {drawn_chunks} chunk(s): gradient_accumulation_steps changed after the loader "
            "was built, so the Trainer's steps would no longer be the sampler's draws (a step ending inside a draw "
            "or spanning two). Nothing of this step was released. Set it before train(); to change it, end this "
            "train() and call train() again (a new loader is built and the accountant composes both mechanisms)."
        )
    if step_clip is not None and clip != step_clip:
        raise RuntimeError(
            f"hf_dp: per_sample_max_grad_norm changed from {step_clip} to {clip} inside a DP step (between its "
            "gradient accumulation chunks): the step's examples would be clipped at one C and noised at σ times "
            "another. Nothing of this step was released. Change C between steps (e.g. in a callback's on_step_end), "
            "not while a step runs."
        )


def check_optimizer_updates_in_step(optimizer: Any) -> None:
    """The DP release is written to ``.grad`` once per step, after every sampled example was clipped and the noise
    added, and the optimizer must apply it in ``optimizer.step()``. An optimizer that updates the parameters inside
    the backward pass instead (LOMO / AdaLomo's ``fused_backward``, Lv et al. 2024; transformers' ``*_layerwise``
    optimizers, whose per-parameter optimizers run in post-accumulate-grad hooks behind a ``LayerWiseDummyOptimizer``)
    never sees that gradient: the DP backward runs with the parameters frozen, so its hooks never fire, and its
    ``step()`` does nothing. The run would train nothing while reporting ε. Refused at train start."""
    inner, seen = optimizer, set()
    while inner is not None and id(inner) not in seen:
        seen.add(id(inner))
        name = type(inner).__name__
        if callable(getattr(inner, "fused_backward", None)) or name == "LayerWiseDummyOptimizer":
            raise ValueError(
                f"The optimizer ({name}) updates the parameters inside the backward pass, not in optimizer.step(). "
                "Under DP the gradient exists only after every sampled example was clipped and the noise added; it "
                "is written to .grad once per step and must be applied by optimizer.step(), so this optimizer would "
                "train nothing. Use an optimizer that steps in optimizer.step() (optim='adamw_torch', 'sgd', "
                "'adafactor', 'galore_adamw' without '_layerwise', ...)."
            )
        inner = getattr(inner, "optimizer", None)


# ---------------------------------------------------------------------- what DPTrainer refuses at construction
def check_mixed_precision(args: Any) -> None:
    """Refuse fp16 and fp8 mixed precision however they are asked for (DESIGN invariant 14: the release is what trains).

    ``fp16=True`` is refused by ``DPTrainingArguments``; but ``TrainingArguments`` also reads
    ``ACCELERATE_MIXED_PRECISION`` from the environment (``accelerate launch --mixed_precision fp16|fp8``, or
    ``mixed_precision:`` in the accelerate config file) into ``args.mixed_precision`` with ``fp16`` left False, and the
    Trainer builds its ``Accelerator`` from that field. fp16: on a GPU accelerate makes a ``GradScaler`` whose ``step``
    multiplies every ``.grad`` by 1/scale (65,536 at first) before the optimizer applies it, so the noised gradient the
    DP release wrote is not what trains. fp8: ``Accelerator.prepare`` (at ``train()``, after DPTrainer hooked the
    model) converts the model's linear layers to fp8 modules (TransformerEngine ``convert_model``, torchao
    ``Float8Linear``; MS-AMP also scales the loss), which no clipping rule was installed on."""
    precision = str(getattr(args, "mixed_precision", "no"))
    source = (f"it comes from the environment (ACCELERATE_MIXED_PRECISION={precision}, set by `accelerate launch "
              f"--mixed_precision {precision}` or by `mixed_precision: {precision}` in the accelerate config)")
    if precision == "fp16":
        raise ValueError(
            f"Mixed precision is fp16 although fp16 is not set: {source}. accelerate's GradScaler would divide the "
            "gradient in `.grad` by its loss scale (65,536 at first) before the optimizer step, and DPTrainer writes "
            "the already noised and normalised gradient there, so the model would barely train while ε is spent. "
            "Launch with `--mixed_precision bf16` (or `no`), or set bf16=True in the arguments."
        )
    if precision == "fp8":
        raise ValueError(
            f"Mixed precision is fp8: {source}. When it prepares the model at train(), accelerate replaces its linear "
            "layers by fp8 modules (TransformerEngine's convert_model, torchao's Float8Linear; MS-AMP also scales "
            "the loss), after DPTrainer installed its per-example clipping hooks on the original layers, and hf_dp "
            "has no per-example rule for those modules. Launch with `--mixed_precision bf16` (or `no`), or set "
            "bf16=True in the arguments."
        )


def check_full_graph_compile(args: Any) -> None:
    """Refuse ``torch.compile(fullgraph=True)``, which accelerate applies at ``train()`` when compilation is on
    (``torch_compile=True`` or ``ACCELERATE_DYNAMO_BACKEND`` / ``accelerate launch --dynamo_backend``) and
    ``ACCELERATE_DYNAMO_USE_FULLGRAPH`` is true (``--dynamo_use_fullgraph``, or the accelerate config).

    The clipping hooks record each layer's input and output gradient in Python state outside the graph (a side
    effect dynamo cannot trace into one graph), so the first forward failed inside the DP step with dynamo's
    "Unsupported HOP: Unsafe side effect ... Mutating a variable from outside the scope of this HOP", naming neither
    hf_dp nor the setting. Without ``fullgraph`` the model compiles around the hooks (and trains exactly, slowly)."""
    backend = str(args.torch_compile_backend) if getattr(args, "torch_compile", False) else os.environ.get(
        "ACCELERATE_DYNAMO_BACKEND", "no")
    fullgraph = os.environ.get("ACCELERATE_DYNAMO_USE_FULLGRAPH", "false").strip().lower() in (
        "1", "true", "t", "yes", "y", "on")
    if backend.strip().lower() in ("", "no", "none") or not fullgraph:
        return
    raise ValueError(
        f"torch.compile with fullgraph=True (ACCELERATE_DYNAMO_USE_FULLGRAPH, set by `accelerate launch "
        f"--dynamo_use_fullgraph` or the accelerate config; backend {backend!r}) cannot trace DPTrainer's per-example "
        "clipping hooks, which record each layer's input and output gradient outside the graph; the first forward "
        "would fail inside the DP step with dynamo's 'Unsafe side effect'. Drop fullgraph "
        "(ACCELERATE_DYNAMO_USE_FULLGRAPH=false): the model then compiles around the hooks and trains exactly, "
        "though with little or no speed-up (README, 'Refusals that name the cause')."
    )


def check_training_setup(args: Any, *, compute_loss_func: Any, train_dataset: Any, deepspeed: bool,
                         neftune_noise_alpha: Any) -> None:
    """Refuse, at construction, a Trainer set-up under which the DP step would not be the mechanism the accountant
    records: a batch-normalised ``compute_loss_func``, an iterable training set (N unknown, no Poisson sampling),
    several GPUs in one process (``torch.nn.DataParallel``),
    DeepSpeed sharding, processes launched but run independently (each spends the budget again), NEFTune's
    data-dependent noise, Liger Kernel's fused linear-cross-entropy (no logits, one batch loss), a
    ``train_sampling_strategy`` other than ``"random"`` (the DP loader never builds the Trainer's sampler). ``args``:
    the run's ``DPTrainingArguments``."""
    if compute_loss_func is not None:
        raise ValueError(
            "compute_loss_func normalises the loss over the batch, which breaks per-example clipping. Pass "
            "per_example_loss=fn with fn(outputs, labels) -> one loss per example instead."
        )
    if isinstance(train_dataset, torch.utils.data.IterableDataset):
        raise ValueError(
            f"train_dataset is an iterable dataset ({type(train_dataset).__name__}: a streamed `datasets` set, "
            "`to_iterable_dataset()`, or a torch IterableDataset), which has no length and no random access, but DP "
            "training draws each step's batch by Poisson sampling over N indexed rows (q = B/N, the rate the "
            "accountant records). Pass a map-style dataset: load without streaming=True (or "
            "`Dataset.from_generator(...)` / `Dataset.from_list(list(stream))` for a stream that fits on disk).")
    check_mixed_precision(args)  # also set on the arguments after they were built
    check_full_graph_compile(args)
    names = list(getattr(args, "label_names", None) or [])
    if names and "labels" not in names:
        raise ValueError(
            f"label_names={names}: DPTrainer reads every batch's targets from the `labels` key (it passes them to "
            "the per-example loss and calls the model without them), so a batch keyed otherwise has no targets "
            "for it. Rename the column (e.g. `train = train.rename_column('target', 'labels')`) and set "
            "label_names=['labels']; a per_example_loss(outputs, labels) receives them as `labels`."
        )
    n_gpu = getattr(args, "n_gpu", 1)
    if isinstance(n_gpu, int) and n_gpu > 1:
        raise ValueError(
            f"{n_gpu} GPUs are visible to one process, so the Trainer would wrap the model in torch.nn.DataParallel, "
            "which splits each micro-batch over replicas of the model run in parallel threads. hf_dp's per-example "
            "hooks and first-step checks are built for one forward of the model per micro-batch, on one process per "
            "device (DDP, FSDP2), and DataParallel is not supported (transformers refuses its own module hooks under "
            "it for the same reason: the replicas are new modules). Launch one process per GPU (`accelerate launch "
            "--multi_gpu` or `torchrun`: DDP, one noise draw per step) or make one GPU visible "
            "(CUDA_VISIBLE_DEVICES=0)."
        )
    if deepspeed:
        raise ValueError(
            "DPTrainer does not support DeepSpeed sharding: the per-example hooks need whole parameters on each "
            "rank. Use multi-process DDP (`accelerate launch --multi_gpu`), FSDP2 with clipping='flat', and for "
            "models placed across devices, clipping='per_device'."
        )
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and args.world_size != launched:
        raise ValueError(
            f"{launched} processes were launched (WORLD_SIZE={launched}) but the Trainer runs them as "
            f"{args.world_size} independent process(es) (parallel_mode={args.parallel_mode.value}): each "
            "would train on all the data with its own noise, and every extra model released spends the privacy "
            "budget again. On CPU-only machines launch with `accelerate launch --multi_gpu --num_processes N` "
            "(gloo) or pass use_cpu=True / `--use_cpu` so transformers sets up distributed training."
        )
    if neftune_noise_alpha is not None:
        raise ValueError(
            "NEFTune (neftune_noise_alpha) adds noise to the input embeddings scaled by the padded batch's length, a "
            "statistic of the other sampled examples, outside the DP mechanism; unsupported with DPTrainer. Set "
            "neftune_noise_alpha=None."
        )
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy not in (None, "random"):
        raise ValueError(
            f"train_sampling_strategy={strategy!r} asks the Trainer's sampler for the order of the training rows, but "
            "DPTrainer draws every training batch by Poisson sampling (each row independently with probability q, the "
            "sampling the accountant assumes: DESIGN invariant 4) and never builds that sampler, so the setting "
            "would be silently ignored. Leave train_sampling_strategy='random' (the default); to waste less "
            "padding, use smaller micro-batches (lower per_device_train_batch_size and raise "
            "gradient_accumulation_steps by the same factor: q = B/N unchanged) or truncate the rows; a curriculum "
            "or length grouping cannot be expressed by Poisson sampling."
        )
    if getattr(args, "use_liger_kernel", False):
        raise ValueError(
            "use_liger_kernel=True patches the model at train() with Liger Kernel's Triton kernels: by default its "
            "fused linear-cross-entropy, under which the forward returns no logits but one loss averaged over the "
            "whole batch, from which the per-example losses DP clips cannot be formed; and its other kernels "
            "(RMSNorm, SwiGLU, RoPE, ...) replace layers whose per-example gradients hf_dp has not verified. Set "
            "use_liger_kernel=False; for the memory of a large vocabulary's logits use lm_loss_chunk_size (the LM "
            "head and loss in chunks of positions, per example)."
        )
