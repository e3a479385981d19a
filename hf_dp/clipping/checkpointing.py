"""Activation checkpointing under DP: a recorded layer's input lives where autograd keeps activations.

The engine needs, for every hooked call of a layer, its input ``a`` and the gradient ``g`` of its output (``layers.py``:
``gᵢᵀaᵢ`` and its norm). Kept in a Python box from the forward to the backward, ``a`` outlives everything activation
checkpointing frees: with every layer's input held to the end of its backward, DP lost the whole saving
(``benchmarks/RESULTS.md``, issue 24: +840 MiB DP vs +220 MiB non-private at T = 512).

Here ``a`` is a **saved tensor of the autograd graph** (:class:`_RecordedCall`, an identity on the layer's output that
``save_for_backward``s its input and receives ``g`` in its ``backward``). Whatever policy decides the lifetime of the
model's own activations then decides the lifetime of ``a`` too, with no case for each:

* no checkpointing: ``a`` lives until its layer's backward, as before;
* non-reentrant checkpointing (``torch.utils.checkpoint(use_reentrant=False)``, transformers' default): inside a
  checkpointed segment, torch's pack hook drops ``a`` in the first forward, and the backward gets the **recomputed**
  ``a`` when the segment is re-run (Chen et al. 2016, "Training deep nets with sublinear memory cost");
* reentrant checkpointing (``use_reentrant=True``): the first forward runs without grad, so nothing is recorded; the
  segment's forward re-run inside the backward records ``a`` and gets ``g`` from its own inner backward;
* ``torch.autograd.graph.save_on_cpu`` / transformers' ``offload=True``: ``a`` is offloaded with the activations.

The generic fallback's module inputs (``fallback.py``: its per-example re-run needs them in the backward) are saved the
same way (:func:`keep_inputs`). The broadcast points (``broadcast.py``) hold gradient edges, not tensors, of the
graph they differentiate through (``GraphTarget``), and batch-less inputs only.

Broadcast points under reentrant checkpointing: a point whose ruled calls run in a segment's no-grad first forward
returns what it will return in the re-run (T5's bias expanded to the batch, which block 0 returns to the next blocks:
the re-run's output must have the first forward's shape). A tensor computed once per batch *outside* the segments and
consumed inside them (DeBERTa's relative embeddings) is refused there (by the mixing point, in the first forward): each
segment's re-run is differentiated by a backward pass of its own, so its gradient arrives in one part per segment.

A forward that runs during the backward is a **recompute**: its hooks must neither number the call again nor count a
use that will not arrive, but must save the same tensors in the same order as the first forward (non-reentrant
checkpointing checks that it does). The engine learns that the backward has begun from :class:`BackwardWatch`: a
tensor hook on each output of the model (every node of the model's forward lies upstream of its outputs, so the
gradient of an output arrives before any checkpointed segment inside the model can be re-run), and the first
:class:`_RecordedCall` backward. Nothing here names a transformers class, and torch's own checkpoint internals are not
read: the mechanism holds for a user's own ``torch.utils.checkpoint`` around a block as for
``gradient_checkpointing_enable()``.

Dropout inside a checkpointed segment: torch restores the RNG state before the recompute (``preserve_rng_state=True``,
its default), so the recomputed ``a`` equals the first forward's (tested in ``tests/clipping/test_checkpointing.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from .rules import UnsupportedLayerError

__all__ = ["BackwardWatch", "clipped_in_backward", "keep_input", "keep_inputs", "recompute_layout"]


class BackwardWatch:
    """Whether the backward of the current recording has begun: any forward after that is a recompute.

    :meth:`attach` hooks the model's outputs at the end of its forward; the first gradient that reaches one of them
    (or a :class:`_RecordedCall`) sets :attr:`started`. One watch per recording (one forward, one backward).
    """

    def __init__(self) -> None:
        self.started = False

    def watch(self, tensor: torch.Tensor) -> None:
        """The first gradient reaching ``tensor`` (an output computed from the model's layers outside the model's own
        forward, e.g. a chunk of the LM head's loss, ``hf_dp/chunked_loss.py``) marks the start of the backward."""
        watch = self

        def mark(_grad: torch.Tensor) -> None:
            watch.started = True

        if tensor.requires_grad:
            tensor.register_hook(mark)

    def attach(self, model: nn.Module):
        """Hook ``model``'s outputs in every forward; returns the handle to remove."""
        watch = self

        def mark(_grad: torch.Tensor) -> None:  # refers to the watch only: no tensor -> hook -> tensor cycle
            watch.started = True

        def hook(_module, _args, output):
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(mark)

        return model.register_forward_hook(hook)


def _tensors(obj, depth: int = 0):
    """The tensors in a model's output: a tensor, or nested tuples, lists and dicts (``ModelOutput`` is a dict)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _tensors(x, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, depth + 1)


#: stands for a saved tensor among a call's inputs (``None`` is an input of its own, e.g. a gated norm's ``gate=None``)
_SAVED = object()


def _saved_inputs(ctx) -> tuple:
    """``ctx.saved_tensors``, or, when the model modified a recorded input in place after the call (autograd's
    version check), hf_dp's refusal naming the layer: its per-example gradient needs that input as it was."""
    try:
        return ctx.saved_tensors
    except RuntimeError as err:
        if "modified by an inplace operation" not in str(err):
            raise
        raise UnsupportedLayerError(
            f"{ctx.layer_name or 'a hooked layer'}: its input was modified in place after the call, and hf_dp needs "
            "that input as it was to form each example's gradient of the layer. Make the in-place operation out of "
            "place in the model, or freeze the layer's parameters (requires_grad_(False)) / train through a PEFT "
            "adapter. Nothing was released.") from err


class _RecordedCall(torch.autograd.Function):
    """Identity on a hooked layer's output ``x`` that saves the layer's input and hands it, with the gradient of
    ``x``, to ``on_grad(inp, grad)`` in the backward.

    ``inp`` goes through ``save_for_backward``, so activation checkpointing drops and recomputes it like any saved
    activation. The output is ``x.detach()``: a new tensor on the same storage that is not a view, so the model may
    modify it in place (a custom Function's view output may not be), and this node still receives the gradient of
    the value the layer returned. ``stop``: ``x`` is a leaf made for the recording (nothing upstream is trainable);
    its gradient is not passed on (no ``.grad`` accumulates on it).
    """

    @staticmethod
    def forward(ctx, x, watch, on_grad, stop, single, name, *inp):
        ctx.layer_name = name
        ctx.save_for_backward(*[t for t in inp if isinstance(t, torch.Tensor)])
        ctx.others = [_SAVED if isinstance(t, torch.Tensor) else t for t in inp]  # non-tensor inputs (all_inputs)
        ctx.watch, ctx.on_grad, ctx.stop, ctx.single = watch, on_grad, stop, single
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        ctx.watch.started = True
        saved = iter(_saved_inputs(ctx))  # under non-reentrant checkpointing: the recomputed input
        inp = [next(saved) if v is _SAVED else v for v in ctx.others]  # a None input stays None
        ctx.on_grad(inp[0] if ctx.single else tuple(inp), grad)
        return (None if ctx.stop else grad, None, None, None, None, None, *([None] * len(ctx.others)))


def keep_input(output: torch.Tensor, inp, watch: BackwardWatch,
               on_grad: Callable[[object, torch.Tensor], None], name: str = "") -> torch.Tensor:
    """The tensor the forward continues with in place of a hooked call's ``output`` (which must require grad):
    ``on_grad(inp, grad)`` is called once in the backward with the call's (detached) input ``inp`` — one tensor, or a
    tuple with ``Rule.all_inputs`` — and the gradient of ``output``, ``inp`` kept as a saved tensor of the graph."""
    single = not isinstance(inp, tuple)
    items = (inp,) if single else inp
    return _RecordedCall.apply(output, watch, on_grad, output.grad_fn is None, single, name, *items)


class _FallbackCall(torch.autograd.Function):
    """Copies of a fallback module's float outputs (``outs``), saving the tensors among the module's inputs and
    handing them, with the gradients of the outputs, to ``on_grads(inputs, grads)`` in the backward (one call for all
    outputs; an output that gets no gradient gets zeros, as ``register_multi_grad_hook`` would give ``None``).

    As :class:`_RecordedCall` does for a ruled layer's input, the inputs the per-example re-run needs
    (``fallback.py``: ``B × T × d`` activations, typically) are saved tensors of the graph, so activation checkpointing
    drops and recomputes them; kept in a Python closure from the first forward, they outlived the checkpoint. The
    outputs are copies (not views): an output that is also an intermediate of another output passes only its own
    uses' gradient, and the model may modify a copy in place. ``stops[j]``: output ``j`` is a leaf made for the
    recording (nothing upstream is trainable); its gradient is not passed on."""

    @staticmethod
    def forward(ctx, watch, on_grads, stops, n_out, name, *tensors):
        ctx.layer_name = name
        ctx.save_for_backward(*tensors[n_out:])
        ctx.watch, ctx.on_grads, ctx.stops, ctx.n_in = watch, on_grads, stops, len(tensors) - n_out
        return tuple(t.clone() for t in tensors[:n_out])

    @staticmethod
    def backward(ctx, *grads):
        ctx.watch.started = True
        ctx.on_grads(_saved_inputs(ctx), grads)  # under non-reentrant checkpointing: the recomputed inputs
        passed = [None if stop else g for g, stop in zip(grads, ctx.stops)]
        return (None, None, None, None, None, *passed, *([None] * ctx.n_in))


def keep_inputs(outs: list[torch.Tensor], inputs: list[torch.Tensor], watch: BackwardWatch,
                on_grads: Callable[[tuple, tuple], None], name: str = "") -> tuple[torch.Tensor, ...]:
    """The tensors the forward continues with in place of a fallback module's float outputs ``outs``: copies, whose
    gradients ``grads`` reach ``on_grads(inputs, grads)`` once in the backward with ``inputs`` (detached tensors)
    kept as saved tensors of the graph (:class:`_FallbackCall`)."""
    stops = [not t.requires_grad for t in outs]
    outs = [t.detach().requires_grad_(True) if stop else t for t, stop in zip(outs, stops)]
    return _FallbackCall.apply(watch, on_grads, stops, len(outs), name, *outs, *inputs)


def recompute_layout(layouts: dict, module_id: int, calls: int, name: str):
    """The input layout (a ruled call's: ``None``, ``"flat"`` or a batch axis; a fallback's: its inputs' layouts) of a
    call of the module
    re-run by activation checkpointing during the backward, which cannot be told apart from the module's other calls:
    the one layout all of the module's ``calls`` forward calls share. Modules called once (every layer of a
    transformer) always qualify."""
    seen = [layouts.get((module_id, k)) for k in range(max(calls, 1))]
    if all(repr(s) == repr(seen[0]) for s in seen):  # repr: a fallback's layout is a list of its inputs' layouts
        return seen[0]
    raise UnsupportedLayerError(
        f"{name} is re-run by activation checkpointing during the backward, and its calls in the forward have inputs "
        f"of different layouts ({', '.join(sorted(set(map(str, seen))))}), so hf_dp cannot tell which call a "
        "recomputed input belongs to. Keep this module outside the checkpointed blocks, or turn activation "
        "checkpointing off.")


@contextlib.contextmanager
def clipped_in_backward(engine, factors: torch.Tensor) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """Inside ``engine.record`` (entered first): a recording whose per-example ``factors`` are known before the backward
    (a check's fixed weights) adds ``Σ_i c_i G_{i,p}`` into ``engine.summed_grads`` parameter by parameter during the
    backward (``ClippingEngine.set_fused_groups``, one group per parameter) and frees each parameter's factors as
    it goes. Without it, every layer's input and output gradient would be kept to the end of the backward: the
    memory of the whole model's activations, which activation checkpointing exists to avoid.

    Yields ``(norms, live)``: ``norms`` is ``{param name: (B,) squared per-example norms}``, filled when the block
    exits (after the backward); ``live`` is the factors on the parameters' device, read when each parameter is
    clipped, so an entry zeroed before the backward (an example with a non-finite loss) is honoured. An example
    whose norm of a parameter is not finite gets factor 0 for that parameter (as ``modes.clip_factors_from_norms``
    gives it in training; ``0 · NaN`` rows are zeroed by the engine)."""
    norms: dict[str, torch.Tensor] = {}
    device = next(iter(engine.params.values())).device if engine.params else factors.device
    live = factors.to(device, copy=True)

    def handler(_k: int, norms_sq: dict[str, torch.Tensor]) -> torch.Tensor:
        norms.update(norms_sq)
        finite = torch.stack([torch.isfinite(v) for v in norms_sq.values()]).all(0)
        return torch.where(finite, live, torch.zeros_like(live))

    engine.set_fused_groups([[n] for n in engine.params], handler)
    try:
        yield norms, live
        engine.finish_fused()  # a parameter some of whose uses got no gradient
    finally:
        engine.set_fused_groups(None, None)
