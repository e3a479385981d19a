"""The per-micro-batch recorder: forward hooks on the plan's layers keep each call's input, tensor hooks on its output
receive the output gradient, and the layer's rule turns the pair into uses (``G_i = L_iᵀ R_i``, ``rules/``), handed to
:class:`~hf_dp.clipping.sums.ClippedSums`. Modules without a rule get the fallback's hook (``fallback.py``: re-run per
example). Installed for one micro-batch by :meth:`Recorder.record`, removed after it.

Extension point: :meth:`Recorder.layer_hook` returns the forward hook of one ruled layer; a subclass overrides it to
record differently (``clipping/fsdp.py``: hooks keyed by attribute, outputs kept for a second backward pass). A
subclass keeps the contract: the hook returns ``None`` or the tensor the forward continues with; inside
:meth:`Recorder.probing` it only stores the call's input under the key ``Recorder._next_call`` gives; it hands its
uses to :class:`~hf_dp.clipping.sums.ClippedSums`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .broadcast import BroadcastPoints, GraphTarget
from .checkpointing import BackwardWatch, keep_input, keep_inputs, recompute_layout
from .coverage import CoveragePlan, with_enclosable
from .fallback import Fallback
from .regroup import Segments
from .rules import Rule, UnsupportedLayerError, Use
from .sums import ClippedSums

__all__ = ["Recorder"]


#: stands for a tensor input of a fallback call among its other inputs (the tensors are saved in the graph)
_SAVED = object()


def _persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a checkpoint saves (``state_dict``), by qualified name."""
    out = {}
    for mname, module in model.named_modules():
        for bname, buf in module._buffers.items():
            if buf is not None and bname not in module._non_persistent_buffers_set:
                out[f"{mname}.{bname}" if mname else bname] = buf
    return out


def _detached(inp):
    """A hooked call's input (a tensor, or every input with ``Rule.all_inputs``), detached."""
    if isinstance(inp, tuple):
        return tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in inp)
    return inp.detach()


class Recorder(BroadcastPoints):
    """Records the uses of one micro-batch at a time (see the module docstring) for the plan's parameters.

    Args:
        model: the model the hooks go on; ``params``: its trainable parameters by name, frozen while recording;
        names: parameter id → name; plan: the :class:`~hf_dp.clipping.coverage.CoveragePlan` (replaced by
        :meth:`use_plan`); sums: where the uses go.

    State proven at the first step (kept across micro-batches, reset by :meth:`use_plan`): which calls hold the
    examples' tokens flattened or on a later axis (:meth:`set_layouts`), which fallback inputs carry the batch axis,
    which layers' forms were verified.
    """

    def __init__(self, model: nn.Module, params: dict[str, nn.Parameter], names: dict[int, str], plan: CoveragePlan,
                 sums: ClippedSums):
        self.model = model
        self.params = params
        self._names = names
        self._plan = plan
        self._sums = sums
        self._segments: Segments | None = None
        self._window: tuple[int, int] | None = None  # positions of the packed rows the current calls see
        self._verified: set[int] = set()
        self._captures: list[tuple[int, contextlib.AbstractContextManager]] = []  # open Rule.capture contexts
        self._batch_size: int | None = None
        self._calls: dict = {}
        self._replaying = False
        #: per (module, call index in the forward): "flat" when the input is (B·T, ...) example-major, or the index
        #: of a later batch axis (sequence-first inputs), as proven by the first-step checks; per fallback call: which
        #: input leaves carry the batch axis
        self._layout: dict[tuple[int, int], object] = {}
        self._mapped: dict[tuple[int, int], list] = {}
        self._probe: dict[tuple, object] | None = None
        self._bcast: list | None = None  # the ruled calls inside a broadcast point (see _broadcast_point)
        self._in_vjp = False  # inside a mixing point's batched vector-Jacobian product
        self._shared_live: list[dict] = []  # the shared tensors of the current forward (see _shared_point)
        self._watch = BackwardWatch()  # a forward after the backward began is a recompute (checkpointing.py)

    def use_plan(self, plan: CoveragePlan) -> None:
        """Record for a new plan from now on; what the first step proved is proven again."""
        self._plan = plan
        self._verified = set()
        self._layout, self._mapped = {}, {}

    @contextlib.contextmanager
    def positions(self, start: int, stop: int) -> Iterator[None]:
        """The ruled calls made inside see positions ``start:stop`` of the micro-batch's rows, not all of them (the LM
        head on one chunk of the sequence, ``hf_dp/chunked_loss.py``): with padding-free packed rows their uses are
        split per packed example over those positions (``regroup.Segments.window``). Entered around the call itself,
        so a recompute by activation checkpointing sees the same window."""
        saved, self._window = self._window, (int(start), int(stop))
        try:
            yield
        finally:
            self._window = saved

    def backward_starts_at(self, tensor: torch.Tensor) -> None:
        """In a recording: ``tensor`` is computed from the model's layers outside the model's own forward (a chunk of
        the LM head's loss, ``hf_dp/chunked_loss.py``); the first gradient reaching it marks the backward's start,
        after which a forward is a recompute (``checkpointing.BackwardWatch``)."""
        self._watch.watch(tensor)

    @property
    def packed(self) -> bool:
        """Whether the micro-batch being recorded is padding-free packed rows (several examples per row)."""
        return self._segments is not None

    @property
    def layouts(self) -> dict[tuple[int, int], object]:
        """The proven layouts of the ruled calls whose input is not plain batch-first (a copy)."""
        return dict(self._layout)

    @property
    def fallback_layouts(self) -> dict[tuple[int, int], list]:
        """Which input leaves of each fallback call carry the batch axis, as proven (a copy)."""
        return dict(self._mapped)

    def set_layouts(self, layouts: dict[tuple[int, int], object], fallback_layouts: dict[tuple[int, int], list]
                    ) -> None:
        """What the first-step probe proved (``checks.py``): used by every later micro-batch."""
        self._layout, self._mapped = dict(layouts), dict(fallback_layouts)

    @contextlib.contextmanager
    def probing(self, store: dict | None = None) -> Iterator[dict]:
        """Inside it, :meth:`record` only stores each hooked call's input (the first-step layout probe): yields
        ``{call key: input}`` (a fallback call's key: its input leaves; a mixing point's: ``(id, call, method)``).
        ``store``: where the calls go instead of a new dict (``checks.py`` passes one that judges each call as it
        arrives and keeps none, so the probe does not hold every layer's input at once)."""
        self._probe = seen = {} if store is None else store
        try:
            yield seen
        finally:
            self._probe = None

    @contextlib.contextmanager
    def record(self, batch_size: int, freeze: bool = True, segments: torch.Tensor | None = None) -> Iterator[None]:
        """Record the uses of one micro-batch of ``batch_size`` rows (see :meth:`ClippingEngine.record`): the
        stored uses of the previous one are dropped; ``segments`` (packed rows) splits every use into per-example
        blocks (:class:`~hf_dp.clipping.regroup.Segments`). The model's persistent buffers must not change inside it.
        """
        self._sums.clear()
        self._batch_size = batch_size
        self._calls = {}
        self._watch = BackwardWatch()  # a forward after the backward began is a recompute (checkpointing.py)
        self._segments = None if segments is None else Segments(segments)
        plan = self._plan
        handles = []
        for n, m, r in plan.layers:
            if r.name == "fallback":  # a module without a rule, an enclosing module, or a ruled module's side fallback
                fb = plan.side_of.get(id(m)) or plan.fallbacks.get(id(m))
                if fb is not None:  # (none: every parameter it owns is computed by an enclosing module's fallback)
                    handles.append(m.register_forward_hook(self._fallback_hook(n, m, fb), with_kwargs=True))
                continue
            if id(m) in plan.dormant:  # every parameter its rule covers is computed by an enclosing module's fallback
                continue
            if r.capture is not None:  # rules that factor functional calls inside the forward (layers.Rule.capture)
                handles += [m.register_forward_pre_hook(self._capture_pre_hook(n, m, r)),
                            m.register_forward_hook(self._capture_post_hook)]
            else:
                handles.append(m.register_forward_hook(self.layer_hook(n, m, r), with_kwargs=True))
        handles += [m.register_forward_pre_hook(self._expand_broadcast_ids, with_kwargs=True)
                    for _, m, r in plan.layers if r.name == "embedding"]
        handles.append(self._watch.attach(self.model))
        self._shared_live = []
        handles += self._install_points()
        buffers = {n: b._version for n, b in _persistent_buffers(self.model).items()}
        if freeze:
            for p in self.params.values():
                p.requires_grad_(False)
        try:
            yield
        finally:
            while self._captures:  # a forward that raised never reached its post hook
                self._captures.pop()[1].__exit__(None, None, None)
            for p in self.params.values():
                p.requires_grad_(True)
            for h in handles:
                h.remove()
            self._shared_live = []
        changed = [n for n, b in _persistent_buffers(self.model).items() if buffers.get(n, b._version) != b._version]
        if changed:
            self._sums.clear()
            raise UnsupportedLayerError(
                "These buffers changed during a DP step: " + ", ".join(changed) + ". A buffer written inside a "
                "step may be computed from the private batch without noise (running statistics, counters, caches), "
                "and hf_dp cannot tell that it is not (a spectral-norm power iteration reads only the weights); it "
                "is saved in the checkpoint next to a DP guarantee. Make the module stop updating it in train mode (a "
                "non-persistent buffer written in a step is refused too: it is used by the next step)."
            )

    @contextlib.contextmanager
    def _replay(self) -> Iterator[None]:
        """The fallback's per-example re-run: every hook of this recorder stays silent inside it."""
        before, self._replaying = self._replaying, True
        try:
            yield
        finally:
            self._replaying = before

    def _next_call(self, module: nn.Module) -> tuple[int, int]:
        k = self._calls.get(id(module), 0)
        self._calls[id(module)] = k + 1
        return id(module), k
    def _expand_broadcast_ids(self, module: nn.Module, args: tuple, kwargs: dict):
        """Materialise per-example ids for an embedding fed ids broadcast over the batch.

        HF models look up position (and sometimes token-type) embeddings with ids of shape ``(1, T)`` and rely on
        broadcasting; the gradient of that lookup would then be summed over examples. Expanding the ids to
        ``(B, T)`` gives the same outputs, repeated per example, and per-example gradients (DESIGN invariant 2).
        """
        b = self._batch_size
        ids = args[0] if args else None
        if self._replaying or self._bcast is not None or b is None or b == 1 or not isinstance(ids, torch.Tensor) \
                or ids.dim() < 2 or ids.shape[0] != 1:
            return None
        return (ids.expand(b, *ids.shape[1:]), *args[1:]), kwargs

    def _add_uses(self, name: str, uses: list[Use], window: tuple[int, int] | None = None) -> None:
        """Check and store one hooked call's uses (called from the gradient hooks; :meth:`ClippedSums.add_uses`)."""
        b = self._batch_size
        for u in uses:
            if u.batch_size != b:
                if u.batch_size == 1:
                    cause = ("its input is broadcast across the batch (first axis 1), e.g. position_ids of shape "
                             "(1, T) or a prompt computed once: materialise the input per example")
                elif u.batch_size % b == 0:
                    cause = (f"its input looks like the examples' tokens flattened into {u.batch_size} rows (B·T); "
                             "hf_dp reshapes such inputs once ClippingEngine.first_step_check has proven them "
                             "example-major (DPTrainer runs it at the first step)")
                else:
                    cause = ("its input has no batch axis (computed once and shared by all examples): freeze its "
                             "parameters or use LoRA on the other layers")
                raise with_enclosable(UnsupportedLayerError(
                    f"{name} saw a batch of {u.batch_size} in a micro-batch of {b} examples: {cause}."),
                    [self._names[id(v.param)] for v in uses if id(v.param) in self._names])
        if self._segments is not None:  # padding-free packed rows: one block per example
            segments = self._segments if window is None else self._segments.window(*window)
            uses = [segments.split_use(u) for u in uses]
        self._sums.add_uses(uses)

    def layer_hook(self, name: str, module: nn.Module, rule: Rule):
        """The forward hook (``register_forward_hook(..., with_kwargs=True)``) that records the uses of the ruled
        layer ``module`` (qualified name ``name``) by its ``rule``. The extension point for other ways of recording
        (``clipping/fsdp.py``); see the module docstring for the contract."""
        attach = self._attach(name, module, rule)

        def hook(mod, args, kwargs, output):
            if self._replaying:
                return None
            inp = (*args, *kwargs.values()) if rule.all_inputs else (args[0] if args else next(iter(kwargs.values())))
            return attach(inp, output)

        return hook

    def _capture_pre_hook(self, name: str, module: nn.Module, rule: Rule):
        attach = self._attach(name, module, rule)

        def pre_hook(mod, args):
            if torch.is_grad_enabled() and not self._replaying and self._probe is None:
                ctx = rule.capture(module, name, self._batch_size, attach)
                ctx.__enter__()
                self._captures.append((id(module), ctx))

        return pre_hook

    def _capture_post_hook(self, mod, args, output):
        if self._captures and self._captures[-1][0] == id(mod):
            self._captures.pop()[1].__exit__(None, None, None)

    def _attach(self, name: str, module: nn.Module, rule: Rule):
        """``attach(inp, output) -> output``: hook the gradient of ``output`` (a call of ``module``, or with
        ``Rule.capture`` a functional call inside its forward, on ``inp``) so that it adds the rule's uses; returns the
        tensor the forward continues with."""
        owned = self._plan.owned(module, rule)

        def hook(inp, output):
            if self._replaying:
                return output
            # A forward during the backward re-runs a checkpointed segment (checkpointing.py): its call was numbered
            # (and expected, below) in the first forward.
            recompute = self._watch.started and self._probe is None
            key = None if recompute else self._next_call(module)
            if self._probe is None and torch.is_grad_enabled() and not isinstance(output, torch.Tensor):
                # never skip a ruled call silently (also inside a broadcast point)
                raise with_enclosable(UnsupportedLayerError(
                    f"{name} ({type(module).__name__}) returned a {type(output).__name__}, not a tensor, while its "
                    f"{rule.name!r} rule factors a layer whose call returns one tensor (e.g. nn.Linear's "
                    "F.linear(x, weight, bias)); its per-example gradient cannot be formed from this call. Freeze its "
                    "parameters (requires_grad_(False)) or train the model through a PEFT adapter (LoRA)."), owned)
            if self._bcast is not None:  # inside a broadcast point: its per-example gradient comes from there
                if self._probe is not None:
                    return output
                if not recompute:  # as below: expected once, in the first forward (with or without gradients)
                    self._sums.expect(owned)
                if not torch.is_grad_enabled():
                    # reentrant checkpointing's first forward: the point learns that a ruled call ran inside it (its
                    # result must have the shape it will have when the segment is re-run with gradients)
                    self._bcast.append((name, module, rule, None, None))
                    return output
                if not output.requires_grad:
                    output = output.detach().requires_grad_(True)
                # A copy (batch-less, small) goes on: the model may modify it in place (DeBERTa's
                # `pos_query_layer /= scale` on a view), which rebases the copy in the graph but not the edge its
                # gradient enters by, which is what the point differentiates to (GraphTarget: no tensor is held).
                copy = output.clone()
                self._bcast.append((name, module, rule, _detached(inp), GraphTarget(copy)))
                return copy
            if self._probe is not None:
                self._probe[key] = inp.detach().clone() if isinstance(inp, torch.Tensor) else None
                return output
            if not torch.is_grad_enabled():
                self._sums.expect(owned)  # reentrant checkpointing records this call when it re-runs it
                return output
            inp = _detached(inp)
            b = self._batch_size
            layout = self._layout.get(key) if not recompute else recompute_layout(
                self._layout, id(module), self._calls.get(id(module), 0), name)
            flat = layout == "flat"
            axis = layout if isinstance(layout, int) else 0
            if flat:
                if inp.shape[0] % b:
                    raise UnsupportedLayerError(
                        f"{name}: its input has {inp.shape[0]} rows, not a multiple of the micro-batch size {b}, "
                        "although the first step proved it holds the examples' tokens flattened (B·T rows).")
                inp = inp.reshape(b, -1, *inp.shape[1:])
            elif axis:
                inp = inp.movedim(axis, 0)  # the batch axis proven at the first step comes first for the rule
            if rule.verify is not None and id(module) not in self._verified:
                seen = output.reshape(b, -1, *output.shape[1:]) if flat else output.movedim(axis, 0)
                try:
                    rule.verify(module, name, inp, seen)
                except UnsupportedLayerError as err:  # not the form its rule assumes: its parent may be re-run
                    raise with_enclosable(err, owned) from None
                self._verified.add(id(module))
            if not output.requires_grad:
                # Nothing upstream is trainable: start the graph here so the output gradient reaches the hook.
                output = output.detach().requires_grad_(True)

            # The input is a saved tensor of the graph (checkpointing.keep_input), not held here: activation
            # checkpointing drops it in the first forward and recomputes it for the backward. The callback must not
            # refer to `output` (a tensor -> node -> callback -> tensor cycle the garbage collector cannot free).
            box = [True]
            shape = output.shape
            window = self._window

            def grad_hook(inp, grad: torch.Tensor) -> None:
                if self._in_vjp:  # a mixing point's batched product passes by (gated: no gradient here)
                    return
                if not box:
                    raise RuntimeError(f"{name}: the gradient hook fired twice for one recorded forward pass "
                                       "(a second backward through the same graph is not supported while recording).")
                box.pop()
                grad = grad.detach().reshape(shape)
                if flat:
                    grad = grad.reshape(b, -1, *grad.shape[1:])
                elif axis:
                    grad = grad.movedim(axis, 0)
                uses = [u.by_example(b) for u in rule.uses(module, name, inp, None, grad)
                        if self._plan.keeps(u.param)]
                self._add_uses(name, uses, window)

            if not recompute:
                self._sums.expect(owned)
            return keep_input(output, inp, self._watch, grad_hook, name)

        return hook

    def _fallback_hook(self, name: str, module: nn.Module, fb: Fallback):
        """Forward hook of a module without a rule (or of the parameters its rule does not cover): per-example
        gradients by re-running it (``fallback.py``)."""
        owned = [self._names[id(fb.param(n))] for n in fb.param_names]
        counter = fb if fb.ruled else module  # a side fallback's calls are numbered apart from its module's rule's

        def hook(mod, args, kwargs, output):
            if self._replaying:
                return None
            # As for a ruled call (_attach): a forward during the backward re-runs a checkpointed segment; its call
            # was numbered and expected in the first forward, and its layout is the one its calls were proven to share.
            recompute = self._watch.started and self._probe is None
            key = None if recompute else self._next_call(counter)
            if self._probe is not None:
                leaves, _ = tree_flatten((args, kwargs))
                self._probe[key] = [x.detach().clone() if isinstance(x, torch.Tensor) and x.dim() > 0 else
                                    (x if isinstance(x, int) and not isinstance(x, bool) else None) for x in leaves]
                return None
            if not torch.is_grad_enabled():
                # reentrant checkpointing runs this call again, with gradients, in the backward: its group must wait
                # for it (a group clipped before all its uses arrive would clip an example's gradient in parts)
                self._sums.expect(owned)
                return None
            leaves, spec = tree_flatten(output)
            if not any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in leaves):
                return None
            b = self._batch_size
            if type(fb) is Fallback:  # every call: the first-step checks run with dropout off, training does not
                fb.check_dropout()  # (recurrent.py refuses recurrent dropout itself)
            saved_args = tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, (args, kwargs))
            proven = self._mapped.get(key) if not recompute else recompute_layout(
                self._mapped, id(counter), self._calls.get(id(counter), 0), name)
            mapped = fb.mapped_leaves(*saved_args, b, proven)
            if id(module) not in self._verified:
                with self._replay():
                    fb.verify(*saved_args, output, b, mapped)
                self._verified.add(id(module))
            # Each float output is returned as a fresh copy (checkpointing.keep_inputs), so that its gradient holds
            # only the uses *after* the module: an output that is also an intermediate of another output (eager
            # attention returns its weights, from which it computes its output) would otherwise pass the other
            # output's gradient twice through the vector-Jacobian product. The module's tensor inputs, which the
            # per-example re-run needs, are saved tensors of the graph, not held here: activation checkpointing drops
            # them in the first forward and recomputes them for the backward. Nothing here refers to a tensor.
            arg_leaves, arg_spec = tree_flatten(saved_args)
            inputs = [x for x in arg_leaves if isinstance(x, torch.Tensor)]
            others = [_SAVED if isinstance(x, torch.Tensor) else x for x in arg_leaves]
            del saved_args, arg_leaves
            floats = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            box = [True]

            def grads_hook(saved: tuple, grads: tuple) -> None:
                if self._in_vjp:
                    return
                if not box:
                    raise RuntimeError(f"{name}: the gradient hook fired twice for one recorded forward pass.")
                box.pop()
                it = iter(saved)
                a, k = tree_unflatten([next(it) if v is _SAVED else v for v in others], arg_spec)
                with self._replay():
                    per = fb.per_example_grads(a, k, list(grads), list(grads), mapped, b)
                uses = per if isinstance(per, list) else [  # recurrent.py returns Use factors itself
                    Use(fb.param(n), None, g.unsqueeze(1), 1, name) for n, g in per.items()]
                self._add_uses(name, [u for u in uses if id(u.param) in self._names])

            if not recompute:
                self._sums.expect(owned)
            copies = keep_inputs([leaves[i] for i in floats], inputs, self._watch, grads_hook, name)
            for i, t in zip(floats, copies):
                leaves[i] = t
            return tree_unflatten(leaves, spec)

        return hook
