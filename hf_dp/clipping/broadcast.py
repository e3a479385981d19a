"""Model-specific broadcast points: methods that compute a tensor once per batch (no batch axis) which every example
then uses, patched inside :meth:`~hf_dp.clipping.recorder.Recorder.record` so that the layers called inside them get
per-example gradients (T5's relative position bias, DeBERTa-v2's shared relative embeddings and disentangled
attention, MPNet's relative position bias). Each kind is found by method name (``BROADCAST_METHODS``,
``SHARED_METHODS``, ``MIXING_METHODS``) on the modules that contain a hooked layer (``CoveragePlan.broadcast_owners``).

:class:`BroadcastPoints` is a part of :class:`~hf_dp.clipping.recorder.Recorder` (its base class): the points read and
write the recorder's per-micro-batch state (the batch size, the calls captured inside a point, the live shared
tensors) and hand their uses to ``Recorder._add_uses``; they are kept here, in one file, because they are the
model-specific part of recording.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_map

from .coverage import with_enclosable
from .rules import UnsupportedLayerError, Use

__all__ = ["ALL_POINTS", "BROADCAST_METHODS", "BroadcastPoints", "GraphTarget", "MIXING_METHODS", "SHARED_METHODS"]


BROADCAST_METHODS = ("compute_bias",)
#: methods that return a tensor computed once per batch without any batch axis, which every example then uses
#: (DeBERTa-v2's ``get_rel_embedding``: the relative embeddings read directly, then a LayerNorm); see _shared_point
SHARED_METHODS = ("get_rel_embedding",)
#: methods that combine such a shared tensor (projected inside them, batch-less) with the examples and return a result
#: whose first axis holds the examples (``B·k`` rows, example-major; DeBERTa-v2's position-to-content and
#: content-to-position scores; MPNet's relative position bias, looked up with ``(T, T)`` ids and expanded to the batch
#: inside the method); see _mixing_point
MIXING_METHODS = ("disentangled_attention_bias", "disentangled_att_bias", "compute_position_bias")
ALL_POINTS = BROADCAST_METHODS + SHARED_METHODS + MIXING_METHODS


class GraphTarget:
    """A tensor of the graph that a point's batched vector-Jacobian product differentiates to, held without its
    storage: its gradient edge (``torch.autograd.graph.get_gradient_edge``: the node that produced it and which of its
    outputs it is) and its shape. The points' gradient hooks hold these, and the edge of the tensor their product
    starts from, never the tensors: under activation checkpointing a tensor held from the first forward outlives the
    checkpoint (a mixing point's result is ``B·H × T × 2P`` scores per layer), while the graph's own nodes keep only
    what autograd's policy keeps (their saved tensors are recomputed with the segment)."""

    def __init__(self, t: torch.Tensor):
        self.edge = get_gradient_edge(t)
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device

    def zeros(self, b: int) -> torch.Tensor:
        """``(b, *shape)`` zeros: the per-example gradients of a target that the product did not reach."""
        return torch.zeros(b, *self.shape, dtype=self.dtype, device=self.device)


def _batched_grads(start, targets: list[GraphTarget], grads: torch.Tensor) -> tuple:
    """``autograd.grad`` from the edge ``start`` to the targets' edges, ``grads`` batched on the first axis."""
    return torch.autograd.grad([start], [t.edge for t in targets], grads, retain_graph=True, is_grads_batched=True,
                               allow_unused=True)


class _VjpGate(torch.autograd.Function):
    """Identity; its backward passes the gradient on, except inside a mixing point's batched product (which must
    not follow this input: see ``BroadcastPoints._mixing_point``)."""

    @staticmethod
    def forward(ctx, x, closed: Callable[[], bool]):
        ctx.closed = closed
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (None if ctx.closed() else grad), None


def _derived_from(x: torch.Tensor, roots: list, depth: int = 8) -> bool:
    """Whether ``x`` is one of the graph nodes ``roots`` or follows from one through single-input ops only (dropout,
    views, a scale): a shared tensor as a mixing method receives it."""
    node = x.grad_fn
    for _ in range(depth):
        if node is None:
            return False
        if any(node is r for r in roots):
            return True
        nexts = [n for n, _ in node.next_functions if n is not None]
        if len(nexts) != 1:
            return False
        node = nexts[0]
    return False


def _graph_leaves(t: torch.Tensor) -> set[int]:
    """The ids of the leaf tensors (requiring grad) that ``t`` depends on in the autograd graph."""
    if t.grad_fn is None:
        return {id(t)}
    out, seen, todo = set(), set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        var = getattr(node, "variable", None)
        if var is not None:
            out.add(id(var))
        todo += [n for n, _ in node.next_functions]
    return out


def _patch(owner: nn.Module, method: str, wrapped: Callable):
    """Replace ``owner.method`` by ``wrapped``; returns a handle whose ``remove()`` restores it."""
    had_own = method in vars(owner)
    orig = getattr(owner, method)
    setattr(owner, method, wrapped)

    class _Restore:
        @staticmethod
        def remove() -> None:
            if had_own:
                setattr(owner, method, orig)
            else:
                delattr(owner, method)

    return _Restore



def _reentrant_refusal(mixing: str, shared: list[dict]) -> UnsupportedLayerError:
    """The refusal of a mixing point run without gradients while a shared tensor computed with gradients is live:
    reentrant activation checkpointing (``torch.utils.checkpoint(use_reentrant=True)``) runs a checkpointed layer's
    first forward without gradients and differentiates its re-run in the backward by a backward pass of its own, so the
    shared tensor's gradient arrives in one part per checkpointed layer (or not at all through the layer's own ops,
    when the layer receives it detached), and its per-example gradients cannot be assembled from the layers' parts."""
    points = ", ".join(sorted({r["what"] for r in shared}))
    params = ", ".join(dict.fromkeys(n for r in shared for n in r["params"]))
    return UnsupportedLayerError(
        f"{mixing} ran without gradients during a recorded forward pass, with the tensor {points} computes once per "
        "batch outside it: this is activation checkpointing with use_reentrant=True, which re-runs each checkpointed "
        "layer in the backward and differentiates it by a separate backward pass, so the gradient of that shared "
        "tensor arrives in one part per layer and hf_dp cannot form the per-example gradients of " + params + " from "
        "them. Use non-reentrant checkpointing (gradient_checkpointing_kwargs={'use_reentrant': False}, transformers' "
        "default), or freeze " + params + " (requires_grad_(False)) or train with LoRA.")


class BroadcastPoints:
    """The broadcast points of :class:`~hf_dp.clipping.recorder.Recorder` (a mixin: see the module docstring)."""

    def _vjp_closed(self) -> bool:
        """Inside a mixing point's batched vector-Jacobian product (gated inputs pass no gradient then)."""
        return self._in_vjp

    def _install_points(self) -> list:
        """Patch every broadcast point of the plan's modules for one recorded micro-batch; returns the handles."""
        points = [(self._broadcast_point, BROADCAST_METHODS), (self._shared_point, SHARED_METHODS),
                  (self._mixing_point, MIXING_METHODS)]
        return [point(m, k) for point, methods in points for m in self._plan.broadcast_owners for k in methods
                if callable(getattr(m, k, None))]

    def _broadcast_point(self, owner: nn.Module, method: str):
        """Make a batch-broadcast bias exact where it is broadcast (T5-family ``compute_bias``).

        T5/MT5/UMT5/LongT5 compute their relative position bias once per batch: ``compute_bias`` looks up
        ``relative_attention_bias`` with ``(T, T)`` bucket ids (no batch axis) and returns a ``(1, H, T, T)`` tensor
        that the attention scores broadcast over the batch, so the embedding's output gradient is already summed over
        examples. Inside :meth:`record`, the method returns its result expanded to ``(B, H, T, T)`` (same values, same
        arithmetic downstream), whose gradient is per example, ``∂L_i/∂bias``; the ruled layers called inside the
        method (the bias embedding) get their per-example output gradients from it by one batched vector-Jacobian
        product through the method's own ops (``autograd.grad(..., is_grads_batched=True)``), and their rules apply
        unchanged. Returns a handle whose ``remove()`` restores the method.
        """
        orig = getattr(owner, method)

        def wrapped(*args, **kwargs):
            if self._replaying or self._bcast is not None:
                return orig(*args, **kwargs)
            self._bcast = captured = []
            try:
                result = orig(*args, **kwargs)
            finally:
                self._bcast = None
            b = self._batch_size
            if not captured:
                return result
            if not isinstance(result, torch.Tensor) or result.dim() == 0 or result.shape[0] != 1:
                raise with_enclosable(UnsupportedLayerError(
                    f"{type(owner).__name__}.{method} returned shape "
                    f"{tuple(getattr(result, 'shape', ()))}, not a bias with a leading broadcast axis of 1: hf_dp "
                    "cannot give its layers per-example gradients. Freeze " + ", ".join(c[0] for c in captured) + "."),
                    [n for c in captured for n in self._plan.owned(c[1], c[2])])
            expanded = result.expand(b, *result.shape[1:])
            if not result.requires_grad:
                return expanded
            box = [captured]
            start = get_gradient_edge(result)  # the hook refers to no tensor of the forward (see GraphTarget)

            def grad_hook(grad: torch.Tensor) -> None:
                if self._in_vjp:
                    return
                for name, module, rule, inp, out in box.pop():
                    per_example = _batched_grads(start, [out], grad.unsqueeze(1))[0]
                    if per_example is None:
                        per_example = out.zeros(b)
                    uses = rule.uses(module, name, inp.unsqueeze(0).expand(b, *inp.shape), None, per_example)
                    self._add_uses(name, [u for u in uses if self._plan.keeps(u.param)])

            expanded.register_hook(grad_hook)
            return expanded

        return _patch(owner, method, wrapped)

    def _shared_point(self, owner: nn.Module, method: str):
        """Per-example gradients for a tensor computed once per batch with no batch axis (``SHARED_METHODS``).

        DeBERTa-v2's ``get_rel_embedding`` returns ``LayerNorm(rel_embeddings.weight)``, ``(2P, d)``, which every
        layer's :meth:`_mixing_point` projects and combines with each example's queries and keys. Inside :meth:`record`,
        the trainable parameters under ``owner`` are replaced for the call by stand-ins (fresh leaves on the same
        storage, as in the hooks-vs-autograd check), so that the result depends on them in the graph: a parameter read
        directly (``rel_embeddings.weight``, never passed through its module's forward) is reached that way, and the
        ruled calls inside (the LayerNorm) are captured with their inputs and outputs. The mixing points then add, per
        example, the gradient of their scores with respect to those tensors (one batched vector-Jacobian product each);
        when the gradient of the result is complete (its tensor hook: every consumer has run), the captured calls' rules
        apply to their per-example output gradients, and a directly read parameter gets its per-example gradient
        instantiated (``(B, numel)``, a ``ones`` use). Returns a handle whose ``remove()`` restores the method.
        """
        orig = getattr(owner, method)

        def wrapped(*args, **kwargs):
            if self._replaying or self._bcast is not None:
                return orig(*args, **kwargs)
            live = torch.is_grad_enabled() and self._probe is None
            swapped = []
            if live:
                for module in owner.modules():
                    for k, p in list(module._parameters.items()):
                        if p is not None and id(p) in self._names:
                            swapped.append((module, k, p))
                            module._parameters[k] = nn.Parameter(p.detach(), requires_grad=True)
            self._bcast = captured = []
            try:
                result = orig(*args, **kwargs)
            finally:
                self._bcast = None
                stand_ins = [(m, k, m._parameters[k], p) for m, k, p in swapped]
                for module, k, p in swapped:
                    module._parameters[k] = p
            if self._probe is None and not torch.is_grad_enabled():
                # reentrant checkpointing re-runs this point with gradients in the backward: the groups of the
                # parameters it may read directly wait for it (over-waiting only defers them to the end of the step)
                self._sums.expect([self._names[id(p)] for p in owner.parameters() if id(p) in self._names])
            if not live or not isinstance(result, torch.Tensor) or not result.requires_grad:
                return result
            called = {id(c[1]) for c in captured}
            reached = _graph_leaves(result)  # a stand-in the result does not depend on is not used here
            direct = [(self._names[id(p)], p, s) for m, _k, s, p in stand_ins
                      if id(m) not in called and id(s) in reached and self._plan.keeps(p)]
            if not self._watch.started:  # expected once, in the first forward (a recompute's call was expected)
                self._sums.expect([n for n, _p, _s in direct])
            targets = [c[4] for c in captured] + [GraphTarget(s) for _n, _p, s in direct]
            result = result.view_as(result)  # its own node, which the mixing points find their inputs from
            targets.append(GraphTarget(result))  # its per-example gradients must add up to its gradient (the hook)
            record = {"targets": targets, "acc": [None] * len(targets), "result": result,
                      "what": f"{type(owner).__name__}.{method}",
                      "params": [n for c in captured for n in self._plan.owned(c[1], c[2])]
                      + [n for n, _p, _s in direct]}
            self._shared_live.append(record)
            b = self._batch_size

            def grad_hook(_grad: torch.Tensor) -> None:
                if self._in_vjp:  # a mixing point's batched product passes through this tensor
                    return
                if record.get("done"):
                    raise RuntimeError(f"{type(owner).__name__}.{method}: the gradient hook fired twice for one "
                                       "recorded forward pass.")
                record["done"] = True
                acc = record.pop("acc")
                record.pop("targets")
                record.pop("result")
                for (name, module, rule, inp, out), g in zip(captured, acc):
                    g = out.zeros(b) if g is None else g
                    uses = rule.uses(module, name, inp.unsqueeze(0).expand(b, *inp.shape), None, g)
                    self._add_uses(name, [u for u in uses if self._plan.keeps(u.param)])
                for (name, p, _s), g in zip(direct, acc[len(captured):]):
                    g = p.new_zeros(b, p.numel()) if g is None else g.reshape(b, -1)
                    self._add_uses(name, [Use(p, None, g.unsqueeze(1), 1, name)])
                seen = acc[-1]
                total = _grad.new_zeros(_grad.shape) if seen is None else seen.sum(0)
                if not torch.allclose(total, _grad, rtol=1e-3, atol=1e-3 * float(_grad.abs().max()) + 1e-12) \
                        and bool(torch.isfinite(_grad).all()):
                    raise UnsupportedLayerError(
                        f"{type(owner).__name__}.{method}: its result reaches the loss other than through the methods "
                        f"hf_dp splits per example ({', '.join(MIXING_METHODS)}), so the per-example gradients of "
                        + ", ".join([c[0] for c in captured] + [n for n, _p, _s in direct]) + " would miss part of "
                        "their gradient. Freeze them (requires_grad_(False)) or train with LoRA.")

            result.register_hook(grad_hook)
            return result

        return _patch(owner, method, wrapped)

    def _mixing_point(self, owner: nn.Module, method: str):
        """Per-example gradients of batch-less computations inside a method whose result has the examples first
        (``MIXING_METHODS``, DeBERTa-v2's ``disentangled_attention_bias``).

        The method projects the shared relative embeddings (no batch axis) with the layer's query/key ``Linear`` s,
        repeats them over the examples and combines them with each example's queries and keys, returning scores of
        ``B·H`` rows (example-major). Inside :meth:`record`, the ruled calls inside it are captured with their
        (batch-less) inputs and outputs; when the gradient of the scores arrives, example ``i``'s gradient of every
        captured output, and of every tensor of a live :meth:`_shared_point`, is the vector-Jacobian product of the
        scores' gradient restricted to example ``i``'s rows: one batched product (``autograd.grad(...,
        is_grads_batched=True)``) over ``B`` such masked gradients, through the method's own ops. Its memory is ``B``
        times the method's backward (``B² · H · T · 2P`` values for DeBERTa's scores), transient, one layer at a time.
        The captured calls' rules then apply unchanged to their batch-less input expanded to ``B``.
        """
        orig = getattr(owner, method)

        def wrapped(*args, **kwargs):
            if self._replaying or self._bcast is not None:
                return orig(*args, **kwargs)
            shared = [r for r in self._shared_live if "targets" in r]
            if shared and not torch.is_grad_enabled() and self._probe is None:
                raise _reentrant_refusal(f"{type(owner).__name__}.{method}", shared)
            if shared and torch.is_grad_enabled() and self._probe is None:
                # Inputs that carry the examples (not derived from a shared tensor) are gated: the batched product
                # below must reach the shared tensors only through this method's own ops, not through the examples'
                # hidden states (which depend on the shared tensors through earlier layers: their mixing points count
                # that path).
                roots = [r["result"].grad_fn for r in shared]

                def gate(x):
                    if not isinstance(x, torch.Tensor) or not x.requires_grad or _derived_from(x, roots):
                        return x
                    return _VjpGate.apply(x, self._vjp_closed)

                args, kwargs = tree_map(gate, (args, kwargs))
            self._bcast = captured = []
            try:
                result = orig(*args, **kwargs)
            finally:
                self._bcast = None
            if self._probe is not None and isinstance(result, torch.Tensor):  # first_step_check proves the layout
                k = self._calls.get((id(owner), method), 0)
                self._calls[(id(owner), method)] = k + 1
                self._probe[(id(owner), k, method)] = result.detach().clone()
            if (not torch.is_grad_enabled() or self._probe is not None or not isinstance(result, torch.Tensor)
                    or not result.requires_grad or not (captured or shared)):
                return result
            b = self._batch_size
            if result.dim() == 0 or result.shape[0] % b:
                raise UnsupportedLayerError(
                    f"{type(owner).__name__}.{method} returned shape {tuple(result.shape)}, whose first axis does not "
                    f"hold the {b} examples of the micro-batch, so hf_dp cannot split its gradient per example. "
                    "Freeze " + ", ".join([c[0] for c in captured] or ["the parameters it uses"]) + ".")
            targets = [c[4] for c in captured] + [t for r in shared for t in r["targets"]]
            box = [captured]
            start = get_gradient_edge(result)  # the hook refers to no tensor of the forward (see GraphTarget)

            def grad_hook(grad: torch.Tensor) -> None:
                if self._in_vjp:  # this hook is on the tensor the batched product below starts from
                    return
                calls = box.pop()
                rows = grad.reshape(b, -1)
                eye = torch.eye(b, dtype=grad.dtype, device=grad.device)
                masked = (eye.unsqueeze(-1) * rows.unsqueeze(0)).reshape(b, *grad.shape)  # example i's rows only
                self._in_vjp = True
                try:
                    per = _batched_grads(start, targets, masked)
                finally:
                    self._in_vjp = False
                for (name, module, rule, inp, out), g in zip(calls, per):
                    g = out.zeros(b) if g is None else g
                    uses = rule.uses(module, name, inp.unsqueeze(0).expand(b, *inp.shape), None, g)
                    self._add_uses(name, [u for u in uses if self._plan.keeps(u.param)])
                k = len(calls)
                for r in shared:
                    for j in range(len(r["acc"])):
                        g = per[k + j]
                        if g is not None:
                            r["acc"][j] = g if r["acc"][j] is None else r["acc"][j] + g
                    k += len(r["acc"])

            result.register_hook(grad_hook)
            return result

        return _patch(owner, method, wrapped)
