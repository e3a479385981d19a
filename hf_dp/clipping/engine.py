"""The per-example gradient engine: hooks, per-example norms and clipped sums, without per-example gradients.

During :meth:`ClippingEngine.record`, every covered layer keeps its input ``a`` (forward hook) and the gradient
``g`` of its output (a tensor hook), and the trainable parameters are temporarily marked ``requires_grad=False``
so that autograd never computes the unclipped parameter gradients (which would be thrown away). One backward of
``Σ_i L_i`` then yields, per layer, the factors of every example's gradient (see ``layers.py``). From them:

* :meth:`per_example_norms_sq` computes ``‖G_{i,p}‖²`` for every parameter ``p`` — by the ghost norm
  ``⟨L_i L_iᵀ, R_i R_iᵀ⟩`` (Li et al. 2022, §4, App. F) or by instantiating ``G_i``, whichever is cheaper
  (:func:`use_ghost_norm`, the one place that decides);
* :meth:`accumulate_clipped` adds ``Σ_i c_i G_{i,p}`` for given per-example factors ``c`` — "book-keeping"
  (Bu et al. 2023): one matmul per layer from the stored factors, no second backward.

A parameter used by several layers (tied GPT-2 ``wte``/``lm_head``) has one per-example gradient, the sum of its
uses; its norm includes the cross terms ``⟨L_u L_vᵀ, R_u R_vᵀ⟩``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .checkpointing import BackwardWatch, clipped_in_backward, keep_input, recompute_layout
from .fallback import Fallback, _is_drop_rate
from .layers import Rule, UnsupportedLayerError, Use, find_rule, rule_parameters
from .recurrent import fallback_for

__all__ = ["ClippingEngine", "GroupHandler", "use_ghost_norm", "UnsupportedLayerError", "train_without_dropout"]

GroupHandler = Callable[[int, dict[str, torch.Tensor]], torch.Tensor]

logger = logging.getLogger(__name__)


#: fused (per-layer) clipping: a dense layer is instantiated when its Grams cost more than ``_GHOST_TIME_RATIO`` × the
#: size of its per-example gradient (``T² (d_L + d_R) ≥ 100 d_L d_R``), fitted to single-thread CPU timings of the
#: benchmark layouts at T = 64, 128, 256 (``benchmarks/rules.py --paths``, table in benchmarks/RESULTS.md)
_GHOST_TIME_RATIO = 100
#: ... and only when its per-example gradients take at most this many times the memory of its stored factors
_INSTANTIATE_MEMORY_RATIO = 2


def use_ghost_norm(uses: list[Use], fused: bool = False, memory_ratio: float = _INSTANTIATE_MEMORY_RATIO) -> bool:
    """Whether a parameter's per-example norms are computed by Gram matrices (ghost) rather than by instantiation.

    Ghost costs ``O(T²)`` per example and use pair (two ``T × T`` Grams), instantiation ``O(d_L · d_R)`` memory and
    ``O(T · d_L · d_R)`` time (Li et al. 2022, App. F: ghost wins when ``2T² < p · d``). The same rule holds for index
    (embedding) uses, with ``d_L`` the table size ``V``: a large vocabulary is ghost-normed, a tiny table (e.g. 32
    relative-position buckets × heads) looked up at ``T²`` positions is instantiated. That rule is about memory: in
    flat clipping the instantiated gradients are kept until the step's factors are known.

    ``fused=True`` (per-layer clipping inside the backward pass, where an instantiation lives only while its layer is
    clipped): a dense layer with one use is instantiated when that is faster — ghost then pays the Grams
    ``2T²(d_L + d_R)`` *and* the book-keeping matmul ``2T d_L d_R`` per example, instantiation one batched matmul of the
    same ``2T d_L d_R`` plus passes over ``d_L d_R`` values (norm, clipped sum), so instantiation wins unless the
    per-example gradient is large against the Grams (``T²(d_L + d_R) < 100 d_L d_R``, measured) — and when its memory
    stays within ``memory_ratio`` × the layer's stored factors ``T (d_L + d_R)`` (2; 1 when the instantiation is kept
    to the end of the backward pass in place of the factors: flat clipping with norms at arrival).
    """
    if fused and len(uses) == 1 and uses[0].kind == "dense":
        u = uses[0]
        t, d_l, d_r = u.seq_len, u.left_dim, u.right.shape[-1]
        if d_l * d_r <= memory_ratio * t * (d_l + d_r):
            return t * t * (d_l + d_r) < _GHOST_TIME_RATIO * d_l * d_r
    total_t = sum(u.seq_len for u in uses)
    return 2 * total_t * total_t < uses[0].left_dim * uses[0].right.shape[-1]


def _acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """Norms and sums are computed in at least float32 (fp16/bf16 under autocast are upcast)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _left_dense(u: Use, dtype: torch.dtype) -> torch.Tensor:
    if u.left is None:
        return u.right.new_ones(u.batch_size, u.seq_len, 1, dtype=dtype)
    return u.left.to(dtype)


def _left_gram(u: Use, v: Use, dtype: torch.dtype) -> torch.Tensor:
    """``L_u L_vᵀ`` per example, ``(B, T_u, T_v)``, without materialising one-hot matrices."""
    if u.kind == "index" and v.kind == "index":
        return (u.left.unsqueeze(2) == v.left.unsqueeze(1)).to(dtype)
    if u.kind == "index":
        return _left_gram(v, u, dtype).transpose(1, 2)
    lu = _left_dense(u, dtype)
    if v.kind == "index":  # (L_u L_vᵀ)[t, s] = L_u[t, ids_v[s]]
        b, tu, tv = lu.shape[0], lu.shape[1], v.left.shape[1]
        return lu.gather(2, v.left.unsqueeze(1).expand(b, tu, tv))
    return torch.bmm(lu, _left_dense(v, dtype).transpose(1, 2))


_GRAM_CACHE = 4


def _self_gram(x: torch.Tensor, dtype: torch.dtype, cache: dict | None) -> torch.Tensor:
    """``X_i X_iᵀ`` per example, ``(B, T, T)``, for a dense factor ``(B, T, d)``.

    With ``cache`` (one norm pass, or flat clipping's norms at arrival over one backward), a tensor read by several
    layers — the query, key and value projections' common input, whose parameters come one after another — has its
    Gram computed once. The key is the storage address, shape, strides, dtype and version counter of ``x``; the entry
    holds ``x`` itself, so its storage cannot be freed and reused by another tensor while the entry lives. Only the
    last ``_GRAM_CACHE`` entries are kept (memory: a few ``(B, T, T)`` matrices).
    """
    if cache is not None:
        key = (x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, x._version, dtype)
        hit = cache.get(key)
        if hit is not None:
            return hit[1]
    y = x.to(dtype)
    gram = torch.bmm(y, y.transpose(1, 2))
    if cache is not None:
        cache[key] = (x, gram)
        if len(cache) > _GRAM_CACHE:
            del cache[next(iter(cache))]
    return gram


def _instantiate(u: Use, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-example gradients ``(B, d_L, d_R)`` of one use (a dense one written into ``out`` if given)."""
    r = u.right.to(dtype)
    if u.left is None:
        return r.sum(1, keepdim=True)
    if u.kind == "index":  # one index_add over all (example, token) rows into a (B·V, d) table
        b, t, d = r.shape
        rows = (u.left + torch.arange(b, device=u.left.device).view(-1, 1) * u.left_dim).reshape(-1)
        out = r.new_zeros(b * u.left_dim, d).index_add_(0, rows, r.reshape(-1, d))
        return out.view(b, u.left_dim, d)
    return torch.bmm(u.left.to(dtype).transpose(1, 2), r, out=out)


def _scratch_for(u: Use, dtype: torch.dtype, scratch: dict | None) -> torch.Tensor | None:
    """A reused ``(B, d_L, d_R)`` buffer for a dense use's instantiation on CPU, or ``None``.

    On CPU a fresh allocation of 32 MiB or more is mapped anew from the OS each time and its pages faulted in on first
    write: ≈ 0.45 ms per MiB, a third of the batched matmul for BERT's FFN at T = 128 (benchmarks/RESULTS.md, the
    floor). Per-layer clipping drops an instantiation as soon as its layer is clipped, so one buffer serves every layer
    of a backward pass (:meth:`ClippingEngine._process_group`; freed in :meth:`ClippingEngine.finish_fused`).
    """
    if scratch is None or u.kind != "dense" or u.right.device.type != "cpu":
        return None
    b, d_l, d_r = u.right.shape[0], u.left_dim, u.right.shape[-1]
    n = b * d_l * d_r
    buf = scratch.get(dtype)
    if buf is None or buf.numel() < n:
        scratch.pop(dtype, None)  # the smaller one is freed before the larger one is allocated
        buf = scratch[dtype] = torch.empty(n, dtype=dtype, device=u.right.device)
    return buf[:n].view(b, d_l, d_r)


def _as_ones(u: Use) -> Use:
    """The same use with its per-example gradients instantiated as ``(B, 1, numel)`` (kind ``"ones"``).

    Used when one parameter's uses factor differently (a fallback use next to a rule's use, e.g. a tied embedding
    whose input-side module has no rule): their per-example gradients are then summed as flat vectors.
    """
    if u.kind == "ones" and u.seq_len == 1 and u.right.shape[-1] == u.param.numel():
        return u
    g = _instantiate(u, _acc_dtype(u.right))
    return Use(u.param, None, g.reshape(g.shape[0], 1, -1), 1, u.module_name)


def _scale_examples(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``x[i] · c_i`` for ``x`` of shape ``(B, ...)`` and ``c`` of shape ``(B,)``, as a 2-D broadcast: on CPU the same
    product broadcast from ``(B, 1, 1)`` takes a slow path (≈ 6× slower at ``(32, 128, 256)``; benchmarks/RESULTS.md).
    """
    b = x.shape[0]
    return (x.reshape(b, -1) * c.view(b, 1)).reshape(x.shape)


def _clipped_sum(u: Use, factors: torch.Tensor, dtype: torch.dtype, zeroed: bool = True) -> torch.Tensor:
    """``Σ_i c_i L_iᵀ R_i`` as a ``(d_L, d_R)`` matrix: one matmul (or one ``index_add``) over all tokens.

    The factors scale the smaller operand (one pass over ``(B, T, min(d_L, d_R))``). The rows of an example with
    ``c_i = 0`` (a non-finite example, ``modes.clip_factors_from_norms``) are zeroed rather than scaled: ``0 · NaN =
    NaN`` inside the matmul would poison every coordinate of the sum. ``zeroed=False`` (the caller found no zero
    factor) skips those two full passes: with every ``c_i ≠ 0`` they are the identity.
    """
    d_r = u.right.shape[-1]
    c = factors.to(dtype)
    r = u.right.to(dtype)
    keep = c.view(-1, 1, 1) != 0 if zeroed else None
    if keep is not None:
        r = torch.where(keep, r, 0.0)
    if u.left is None:  # Σ_i c_i Σ_t R_{i,t}
        return (c.view(1, -1) @ r.sum(1)).view(1, d_r)
    if u.kind == "index":
        out = r.new_zeros(u.left_dim, d_r)
        return out.index_add_(0, u.left.reshape(-1), _scale_examples(r, c).reshape(-1, d_r))
    left = u.left.to(dtype)
    if keep is not None:
        left = torch.where(keep, left, 0.0)
    if left.shape[-1] <= d_r:
        left = _scale_examples(left, c)
    else:
        r = _scale_examples(r, c)
    return left.reshape(-1, u.left_dim).t() @ r.reshape(-1, d_r)


@contextlib.contextmanager
def train_without_dropout(model: nn.Module) -> Iterator[None]:
    """Train mode with dropout off (for the first-step checks), restored on exit.

    Every module stays in train mode (batch statistics, anything else that differs in training, runs as it will);
    dropout is switched off by setting its probability to 0: ``nn.Dropout`` modules' ``p`` and float attributes named
    as drop probabilities (``attention_dropout``, ``dropout_prob``, LayerDrop's ``layerdrop``, stochastic depth's
    ``drop_prob``: :func:`_is_drop_rate`). Turning ``training`` off on the dropout
    modules alone is not enough: attention modules pass ``self.dropout.p if self.training`` to sdpa themselves.
    """
    was_training = model.training
    saved: list[tuple[object, str, float]] = []
    for m in model.modules():
        for k, v in vars(m).items():
            if (k == "p" and isinstance(m, nn.modules.dropout._DropoutNd)) or (
                    _is_drop_rate(k) and isinstance(v, float)):
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


def _uses_batch_statistics(module: nn.Module) -> bool:
    """BatchNorm (any dimension, Sync, Lazy) normalises with statistics over the batch in train mode, and
    InstanceNorm with ``track_running_stats`` updates running statistics from the data."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return True
    return isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats


def _persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a checkpoint saves (``state_dict``), by qualified name."""
    out = {}
    for mname, module in model.named_modules():
        for bname, buf in module._buffers.items():
            if buf is not None and bname not in module._non_persistent_buffers_set:
                out[f"{mname}.{bname}" if mname else bname] = buf
    return out


#: methods that compute a bias once per batch and return it with a leading broadcast axis of 1 (T5 family)
_BROADCAST_METHODS = ("compute_bias",)
#: methods that return a tensor computed once per batch without any batch axis, which every example then uses
#: (DeBERTa-v2's ``get_rel_embedding``: the relative embeddings read directly, then a LayerNorm); see _shared_point
_SHARED_METHODS = ("get_rel_embedding",)
#: methods that combine such a shared tensor (projected inside them, batch-less) with the examples and return a result
#: whose first axis holds the examples (``B·k`` rows, example-major; DeBERTa-v2's position-to-content and
#: content-to-position scores; MPNet's relative position bias, looked up with ``(T, T)`` ids and expanded to the batch
#: inside the method); see _mixing_point
_MIXING_METHODS = ("disentangled_attention_bias", "disentangled_att_bias", "compute_position_bias")
_ALL_POINTS = _BROADCAST_METHODS + _SHARED_METHODS + _MIXING_METHODS


def _is_descendant(module: nn.Module, ancestor: nn.Module) -> bool:
    return any(m is module for m in ancestor.modules())


def _leaf_layout(big: torch.Tensor | None, one: torch.Tensor | None, b: int) -> str | None:
    """A fallback input's layout, from its values for ``b`` examples and for the first alone: ``"batch"``,
    ``"flat"`` (``k > 1`` rows per example, example-major), ``"size"`` (a number: ``b`` for ``b`` examples and 1 for
    one, the micro-batch size) or ``None`` (shared by the batch)."""
    if isinstance(big, int) or isinstance(one, int):
        return "size" if isinstance(big, int) and isinstance(one, int) and b > 1 and big == b and one == 1 else None
    if big is None or one is None or big.shape[0] != b * one.shape[0] or big.shape[1:] != one.shape[1:]:
        return None
    if one.shape[0] == 1:
        return "batch"
    head = big[:one.shape[0]]
    same = torch.allclose(head.double(), one.double(), rtol=1e-3, atol=1e-5) if one.is_floating_point() \
        else torch.equal(head, one)
    return "flat" if same else None


def _later_batch_axis(big: torch.Tensor, one: torch.Tensor, b: int) -> int | None:
    """The axis ``j > 0`` that holds the examples (size ``b`` for ``b`` examples, 1 for the first alone, the first
    example's slice unchanged), when the first axis does not scale (sequence-first layouts); else ``None``."""
    if big.dim() != one.dim() or big.dim() < 2 or big.shape[0] != one.shape[0] or b == 1:
        return None
    last = big.dim() - 1 if big.is_floating_point() else big.dim()  # a float input's last axis is its features
    axes = [j for j in range(1, last) if big.shape[j] == b and one.shape[j] == 1
            and all(big.shape[k] == one.shape[k] for k in range(big.dim()) if k != j)]
    if len(axes) != 1:
        return None
    head, first = big.select(axes[0], 0), one.select(axes[0], 0)
    same = torch.allclose(head.double(), first.double(), rtol=1e-3, atol=1e-5) if one.is_floating_point() \
        else torch.equal(head, first)
    return axes[0] if same else None


def _no_uses(*_args) -> list[Use]:  # the fallback's uses come from its own hook (fallback.py)
    return []


def _detached(inp):
    """A hooked call's input (a tensor, or every input with ``Rule.all_inputs``), detached."""
    if isinstance(inp, tuple):
        return tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in inp)
    return inp.detach()


class _VjpGate(torch.autograd.Function):
    """Identity; its backward passes the gradient on, except inside a mixing point's batched product (which must
    not follow this input: see ``ClippingEngine._mixing_point``)."""

    @staticmethod
    def forward(ctx, x, engine):
        ctx.engine = engine
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (None if ctx.engine._in_vjp else grad), None


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


def _hook_target(output: torch.Tensor) -> torch.Tensor | None:
    """The tensor on which a hook receives the gradient of ``output`` as the layer returned it, even if the model
    then modifies ``output`` in place; ``None`` when there is no such tensor (the caller then hooks a copy).

    A hook registered on a tensor that is not a view survives a later in-place operation on it (it stays on the
    tensor's old autograd node and receives the gradient of the value before the operation). A hook registered on a
    *view* does not: an in-place operation on a view rebases the view onto ``CopySlices`` of its base, and its old
    node (with the hook) leaves the graph, so the hook never fires. ``F.linear`` on a 3-D input returns such a view
    (a 2-D ``addmm`` reshaped), and Longformer's global attention divides the query projection's output in place
    (``global_query_vectors_only_global /= ...``): its hook was lost. A view that is the whole of a base computed by
    the layer itself (its autograd node feeds the view's) is hooked on that base, whose gradient is the output's.
    """
    base = output._base
    if base is None:
        return output
    node = output.grad_fn
    if (node is not None and base.grad_fn is not None and base.numel() == output.numel() and output.is_contiguous()
            and base.is_contiguous() and any(n is base.grad_fn for n, _ in node.next_functions)):
        return base
    return None


def _parent(name: str) -> str | None:
    """The qualified name of a module's parent (``""`` for the model), ``None`` for the model itself."""
    return None if not name else name.rpartition(".")[0]


def _common_ancestor(names: list[str]) -> str:
    """The qualified name of the smallest module containing all of ``names`` (one of them, or an ancestor)."""
    parts = [n.split(".") if n else [] for n in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def _with_enclosable(err: UnsupportedLayerError, names: list[str]) -> UnsupportedLayerError:
    """Mark a first-step refusal that re-running an enclosing module per example might resolve
    (``ClippingEngine._replan``): the qualified names of the parameters concerned."""
    err.enclosable = list(names)
    return err


def _rows(x: torch.Tensor) -> int | None:
    """The size of the axis a rule treats as the batch axis, or ``None`` when the input has no such axis."""
    return x.shape[0] if x.dim() >= 2 else None


class _Judged(dict):
    """The first-step probe's store for the B-example run: each call's input is judged when it arrives
    (``ClippingEngine._probe_layout``) and not kept."""

    def __init__(self, judge: Callable):
        super().__init__()
        self._judge = judge

    def __setitem__(self, key, value) -> None:
        self._judge(key, value)


class ClippingEngine:
    """Per-example gradient norms and clipped sums for every trainable parameter of a model.

    Args:
        model: the (unwrapped) model. Every module that owns a parameter with ``requires_grad=True`` must have a rule
            in ``layers.py`` that covers it, or get the generic exact fallback (``fallback.py``: modules with no rule,
            re-run per example with ``torch.func``). A parameter that a ruled layer owns but its rule does not cover
            (T5Gemma2's ``eoi_embedding`` beside the embedding weight, a router's scale) gets a side fallback: the
            layer itself re-run per example for that parameter alone, its rule still recording the others (or, when
            the layer cannot be re-run per example, an enclosing module's fallback; refused, naming the cause, when
            none verifies; a parameter of the model itself is refused statically). Nothing is skipped silently, and a
            parameter is never "covered" because
            another module that shares it has a rule (each owner's forward is its own use). A parameter whose uses its
            owner's rule cannot see whole (read directly by an ancestor's forward, looked up with no batch axis, a
            parametrization) is computed by the fallback of its smallest enclosing module that treats examples
            independently (the enclosing-module fallback: :meth:`_replan`, found by :meth:`first_step_check`, or
            statically: :meth:`_static_enclosures`). Layers that compute batch
            statistics (BatchNorm, InstanceNorm with running statistics) are refused: they mix examples in train mode
            and write statistics of private data into the checkpoint.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.params: dict[str, nn.Parameter] = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                self.params[name] = p
        self._names = {id(p): n for n, p in self.params.items()}
        #: param id -> qualified name of the module whose forward re-run per example gives its per-example gradient
        #: (the enclosing-module fallback: :meth:`_enclose`); its owner's rule then no longer records it
        self._enclosure: dict[int, str] = {}
        self._static_enclosures()
        problems, batch_stats = self._plan()
        if batch_stats:
            raise UnsupportedLayerError(
                "These layers compute statistics over the batch: " + ", ".join(batch_stats) + ". In train mode (which "
                "DPTrainer uses) a BatchNorm normalises each example with the statistics of the whole micro-batch, "
                "which mixes examples so per-example clipping no longer bounds one example's contribution, and it "
                "writes running statistics of the private data, without noise, into the checkpoint; freezing its "
                "parameters changes neither. Replace them by layers with fixed statistics (e.g. "
                "torchvision.ops.FrozenBatchNorm2d, built from the trained BatchNorm's running statistics) or by "
                "per-example normalisations (GroupNorm, LayerNorm)."
            )
        if problems:
            listing = "\n  ".join(problems)
            raise UnsupportedLayerError(
                "These trainable parameters belong to layers whose per-example rule does not cover them, so their "
                f"gradients could not be clipped per example:\n  {listing}\n"
                "Freeze them before training, e.g. `model.get_parameter(name).requires_grad_(False)`, or train the "
                "model through a PEFT adapter (LoRA)."
            )
        self._logged: set[str] = set()
        self._log_fallbacks(list(self._fallbacks.values()))
        self._uses: dict[str, list[Use]] = {}
        self._pending: dict[str, int] = {}
        self._units: torch.Tensor | None = None
        self._segments: tuple | None = None
        self._unit_weights: torch.Tensor | None = None
        self._groups: list[list[str]] | None = None
        self._handler: GroupHandler | None = None
        self._group_of: dict[str, int] = {}
        self._verified: set[int] = set()
        self._captures: list[tuple[int, contextlib.AbstractContextManager]] = []  # open Rule.capture contexts
        self._batch_size: int | None = None
        self._calls: dict = {}
        self._replaying = False
        #: per (module, call index in the forward): "flat" when the input is (B·T, ...) example-major, or the index
        #: of a later batch axis (sequence-first inputs), as proven by
        #: first_step_check); per fallback call: which input leaves carry the batch axis
        self._layout: dict[tuple[int, int], str] = {}
        self._mapped: dict[tuple[int, int], list[bool]] = {}
        self._probe: dict[tuple[int, int], object] | None = None
        self._bcast: list | None = None  # the ruled calls inside a broadcast point (see _broadcast_point)
        self._in_vjp = False  # inside a mixing point's batched vector-Jacobian product
        self._watch = BackwardWatch()
        self._shared_live: list[dict] = []  # the shared tensors of the current forward (see _shared_point)
        self.summed_grads: dict[str, torch.Tensor] = {}
        #: {parameter name: "ghost" | "instantiate"}, how its last per-example norms were computed
        #: (use_ghost_norm; read by benchmarks/run.py)
        self.norm_paths: dict[str, str] = {}

    def _plan(self) -> tuple[list[str], list[str]]:
        """Which hook computes which parameter's per-example gradients: every module that owns a trainable parameter
        gets its rule (``layers.py``) or, with none, the generic fallback (``fallback.py``); a parameter in
        :attr:`_enclosure` is left out of its owner's rule and given to the fallback of its enclosing module instead.
        Returns the coverage problems and the batch-statistics layers (the caller refuses them)."""
        model = self.model
        self._modules: list[tuple[str, nn.Module, Rule]] = []
        self._fallbacks: dict[int, Fallback] = {}
        self._dormant: set[int] = set()  # ruled modules whose rule records no trainable parameter: rule not hooked
        #: ruled module id -> the fallback for its trainable parameters its rule does not cover (a side fallback,
        #: kept in _fallbacks under its own id: the module's rule hook numbers the module's calls)
        self._side_of: dict[int, Fallback] = {}
        self._enclosed = set(self._enclosure)
        problems: list[str] = []
        batch_stats: list[str] = []
        self._owners: dict[int, list[str]] = {}
        extra: dict[str, list[str]] = {}  # enclosing module -> paths (relative to it) of the parameters it computes
        for pid, mname in self._enclosure.items():
            module = model.get_submodule(mname)
            path = next(n for n, q in module.named_parameters(remove_duplicate=False) if id(q) == pid)
            if path not in extra.setdefault(mname, []):
                extra[mname].append(path)
        for name, module in model.named_modules():
            if _uses_batch_statistics(module):
                batch_stats.append(f"{name} ({type(module).__name__})")
            own = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]
            for _n, p in own:
                self._owners.setdefault(id(p), []).append(f"{name} ({type(module).__name__})")
            kept = [(n, p) for n, p in own if id(p) not in self._enclosed]
            inner = tuple(extra.get(name, ()))
            if not own and not inner:
                continue
            rule = find_rule(module)
            if inner:  # an enclosing module (never ruled, never the model: see _enclose)
                fb = Fallback(module, name, tuple(n for n, _ in kept) + inner)
                self._fallbacks[id(module)] = fb
                # its Rule lists its own parameters only: groups (modes.py) keep an enclosed parameter in its owner's
                self._modules.append((name, module, Rule("fallback", _no_uses, tuple(n for n, _ in own))))
                continue
            if rule is None and module is model:
                problems.append(
                    f"{', '.join(n for n, _ in own)} ({type(module).__name__}: parameters of the model itself; hf_dp's "
                    "generic fallback would re-run the whole model per example. Move them into a submodule or freeze "
                    "them)")
                continue
            if rule is None:
                rule = Rule("fallback", _no_uses, tuple(n for n, _ in own))
                if kept:  # recurrent.py for RNNs
                    self._fallbacks[id(module)] = fallback_for(module, name, tuple(n for n, _ in kept), self)
                else:
                    self._dormant.add(id(module))
                self._modules.append((name, module, rule))
                continue
            if rule.check is not None:
                rule.check(module, name)
            ruled = rule_parameters(rule, module)
            uncovered = tuple(n for n, _ in kept if n not in ruled)
            if ruled:
                if not any(n in ruled for n, _ in kept):
                    self._dormant.add(id(module))  # its rule's hook is not needed (a side fallback may still be)
                self._modules.append((name, module, rule))
            if uncovered and module is model:
                problems += [f"{name}.{n} ({type(module).__name__}: its {rule.name!r} rule covers "
                             f"{', '.join(rule.params)} only)" for n in uncovered]
            elif uncovered:
                # A side fallback: the module itself re-run per example for the parameters its rule does not cover
                # (an embedding's extra vector, a router's scale), next to its rule's hook for the others; verified
                # on the first step like any fallback, and moved to an enclosing module if it cannot be
                # (first_step_check). Its entry lists the rule's parameters too, so per-layer groups keep the layer.
                fb = Fallback(module, name, uncovered, ruled=rule.name)
                self._fallbacks[id(fb)] = fb
                self._side_of[id(module)] = fb
                self._modules.append((name, module, Rule("fallback", _no_uses, tuple(rule.params) + uncovered)))
        self._bcast_owners = [m for m in model.modules() if any(callable(getattr(m, k, None)) for k in _ALL_POINTS)
                              and any(r is not m and id(r) not in self._dormant and _is_descendant(r, m)
                                      for _, r, _ in self._modules)]
        return problems, batch_stats

    def _log_fallbacks(self, fallbacks: list[Fallback]) -> None:
        """Say once in the log which modules the generic fallback re-runs, and what it costs."""
        fallbacks = [fb for fb in fallbacks if type(fb) is Fallback]  # recurrent.py logs its own
        if not fallbacks:
            return
        self._logged.update(fb.describe() for fb in fallbacks)
        # Repeated blocks said once: "layers.*.self_attn (...) × 24" rather than 24 copies of the same description.
        counts: dict[str, int] = {}
        for fb in fallbacks:
            key = re.sub(r"\.\d+(?=[.\s(:;,]|$)", ".*", fb.describe())
            counts[key] = counts.get(key, 0) + 1
        logger.warning(
            "hf_dp: no per-layer rule covers the parameters of %s; their per-example gradients are computed exactly "
            "by the generic fallback (clipping/fallback.py): each is re-run on every example under torch.func.vmap "
            "(one extra forward and backward of the module per micro-batch) and its per-example gradients are "
            "instantiated (micro-batch size × values above). Freeze them or use LoRA if that is too slow.",
            "; ".join(k if n == 1 else f"{k} × {n}" for k, n in counts.items()),
        )

    def _static_enclosures(self) -> None:
        """Parameters whose uses no layer hook can see, known without running the model: a parametrization's
        ``original*`` tensors (weight norm: read through the parametrized module's attribute, computed by a
        ``ParametrizationList`` that is called with no input) and the children of ``nn.MultiheadAttention`` (its
        forward applies ``out_proj.weight`` with a functional call). They go to the fallback of the smallest
        enclosing module that can be re-run per example (verified on the first step like any fallback)."""
        from torch.nn.utils.parametrize import ParametrizationList

        for name, module in self.model.named_modules():
            if isinstance(module, ParametrizationList) or isinstance(module, nn.MultiheadAttention):
                inner = [(n, p) for n, p in module.named_parameters() if id(p) in self._names]
                if isinstance(module, nn.MultiheadAttention):
                    inner = [(n, p) for n, p in inner if "." in n]  # its children's (out_proj), not its own
                for _n, p in inner:
                    if id(p) not in self._enclosure:
                        target = self._enclosing_candidate(name if isinstance(module, nn.MultiheadAttention)
                                                           else _parent(name), start_inclusive=True)
                        if target is not None:
                            self._enclosure[id(p)] = target

    def _enclosing_candidate(self, name: str | None, start_inclusive: bool = False) -> str | None:
        """The nearest module at or above ``name`` (above it unless ``start_inclusive``) that can host an enclosing
        fallback: called with the examples (not a container: ``ModuleList``, ``ModuleDict``, ``ParametrizationList``),
        without a layer rule (a rule factors its own parameters only), not recurrent, and not the model itself
        (re-running the whole model per example is refused: :class:`ClippingEngine`)."""
        from torch.nn.utils.parametrize import ParametrizationList

        if name is None:
            return None
        if not start_inclusive:
            name = _parent(name)
        while name:
            module = self.model.get_submodule(name)
            if not isinstance(module, (nn.ModuleList, nn.ModuleDict, ParametrizationList, nn.RNNBase)) \
                    and find_rule(module) is None:
                return name
            name = _parent(name)
        return None

    def _same_role(self, names: list[str]) -> list[str]:
        """``names`` and the parameters in the same role elsewhere (the same qualified name up to the indices of
        repeated blocks, at the same stage of enclosure): a refusal raised during the forward names the first offending
        module only (Swin's relative position table of block 0), and its twins in the other blocks would otherwise each
        cost one more round of first-step checks. The re-run check verifies every one of them."""
        def role(n: str) -> tuple[str, bool]:
            return re.sub(r"(?<=\.)\d+(?=\.)", "*", "." + n), self._enclosure.get(id(self.params[n])) is None

        roles = {role(n) for n in names if n in self.params}
        return list(names) + [n for n in self.params if n not in names and role(n) in roles]

    def _enclose(self, names: list[str]) -> bool:
        """Move each named parameter's per-example gradient one enclosing module up (:meth:`_enclosing_candidate`):
        from its owners' rule to their smallest common ancestor's fallback, or from its current enclosing module to
        the next. Returns ``False`` (nothing changed) when some parameter has no enclosing module left."""
        moves = {}
        for full in names:
            p = self.params.get(full)
            if p is None:
                return False
            current = self._enclosure.get(id(p))
            if current is None:
                owners = [n for n, m in self.model.named_modules()
                          if any(q is p for q in m.parameters(recurse=False))]
                common = _common_ancestor(owners)
                target = self._enclosing_candidate(common, start_inclusive=common not in owners)
            else:
                target = self._enclosing_candidate(current)
            if target is None:
                return False
            moves[id(p)] = target
        self._enclosure.update(moves)
        return True

    # ------------------------------------------------------------------ capture
    @contextlib.contextmanager
    def record(self, batch_size: int, freeze: bool = True, units: torch.Tensor | None = None,
               unit_weights: torch.Tensor | None = None, segments: torch.Tensor | None = None) -> Iterator[None]:
        """Capture the per-example factors of one micro-batch of ``batch_size`` examples.

        Run the forward *and* the backward of ``Σ_i L_i`` inside this context. Parameters are frozen inside it
        (unless ``freeze=False``, used by the checks), so no ``.grad`` is produced; the factors stay available
        (:meth:`per_example_norms_sq`) until :meth:`clear`. The model's persistent buffers (what a checkpoint saves)
        must not change inside it: a buffer updated in training (running statistics, counters) would carry private
        data into the checkpoint without noise (:class:`UnsupportedLayerError`).

        Args:
            units: ``(B,)`` privacy unit of each example (user-level DP), ids ``0..U-1``. Norms are then those of each
                unit's gradient ``G_u = Σ_{i∈u} w_i G_i`` (ghost norms over the unit's concatenated tokens, cross terms
                between its examples included), and factors given to :meth:`accumulate_clipped` are per unit.
            unit_weights: ``(B,)`` weights ``w_i`` (1 for a user's sum, ``1/n_u`` for their mean).
            segments: ``(B, T)`` for padding-free packed rows: the example ``0..S-1`` each token belongs to (``-1``
                for padding). The ``B`` rows then hold ``S`` examples, and every captured use is split into
                per-example blocks (:meth:`_segment_use`), so norms and factors are per example, ``(S,)``;
                ``units`` and ``unit_weights`` are then ``(S,)`` too. ``batch_size`` stays the number of rows.
        """
        self.clear()
        self._batch_size = batch_size
        self._calls = {}
        self._watch = BackwardWatch()  # a forward after the backward began is a recompute (checkpointing.py)
        self._set_segments(segments)
        self._set_units(units, unit_weights)
        handles = []
        for n, m, r in self._modules:
            if r.name == "fallback":  # a module without a rule, an enclosing module, or a ruled module's side fallback
                fb = self._side_of.get(id(m)) or self._fallbacks.get(id(m))
                if fb is not None:  # (none: every parameter it owns is computed by an enclosing module's fallback)
                    handles.append(m.register_forward_hook(self._fallback_hook(n, m, fb), with_kwargs=True))
                continue
            if id(m) in self._dormant:  # every parameter its rule covers is computed by an enclosing module's fallback
                continue
            if r.capture is not None:  # rules that factor functional calls inside the forward (layers.Rule.capture)
                handles += [m.register_forward_pre_hook(self._capture_pre_hook(n, m, r)),
                            m.register_forward_hook(self._capture_post_hook)]
            else:
                handles.append(m.register_forward_hook(self._forward_hook(n, m, r), with_kwargs=True))
        handles += [m.register_forward_pre_hook(self._expand_broadcast_ids, with_kwargs=True)
                    for _, m, r in self._modules if r.name == "embedding"]
        handles.append(self._watch.attach(self.model))
        self._shared_live = []
        points = [(self._broadcast_point, _BROADCAST_METHODS), (self._shared_point, _SHARED_METHODS),
                  (self._mixing_point, _MIXING_METHODS)]
        handles += [point(m, k) for point, methods in points for m in self._bcast_owners for k in methods
                    if callable(getattr(m, k, None))]
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
            self.clear()
            raise UnsupportedLayerError(
                "These buffers changed during a DP step: " + ", ".join(changed) + ". A buffer updated in training "
                "(running statistics, counters) is computed from the private data without noise and is saved in "
                "the checkpoint next to a DP guarantee. Make the module stop updating it in train mode (a "
                "non-persistent buffer written in a step is refused too: it is used by the next step)."
            )

    @contextlib.contextmanager
    def _replay(self) -> Iterator[None]:
        """The fallback's per-example re-run: every hook of this engine stays silent inside it."""
        before, self._replaying = self._replaying, True
        try:
            yield
        finally:
            self._replaying = before

    def _next_call(self, module: nn.Module) -> tuple[int, int]:
        k = self._calls.get(id(module), 0)
        self._calls[id(module)] = k + 1
        return id(module), k

    @torch.no_grad()
    def _total_norms(self, batch_size: int) -> torch.Tensor:
        norms = self.per_example_norms_sq()
        self._instantiated = {}
        if not norms:
            return torch.zeros(batch_size, dtype=torch.float64)
        return torch.stack([v.double() for v in norms.values()]).sum(0).sqrt()

    def _saved_state(self):
        saved = (self.summed_grads, self._groups, self._handler)
        self.set_fused_groups(None, None)  # the checks compare plain per-parameter norms
        self.summed_grads = {}
        return saved

    def _restore_state(self, saved) -> None:
        self.clear()
        self._instantiated = {}
        self.summed_grads = saved[0]
        self.set_fused_groups(saved[1], saved[2])
        for p in self.params.values():
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
                        self._probe_layout(run_losses, batch_size)
                    self._check_against_autograd(run_losses, min(batch_size, 2), rtol)
                    break
                except UnsupportedLayerError as err:
                    first = first or err
                    if not self._replan(getattr(err, "enclosable", None)):
                        if err is first:
                            raise
                        raise UnsupportedLayerError(
                            f"{first}\nhf_dp then tried to compute them by re-running an enclosing module per example "
                            f"(the generic fallback), which was refused too:\n{err}") from err
        finally:
            self._probe = None
            self._restore_state(saved)
        self._log_fallbacks([fb for fb in self._fallbacks.values() if fb.describe() not in self._logged])

    def _replan(self, names: list[str] | None) -> bool:
        """After a first-step refusal naming ``names``: compute their per-example gradients one enclosing module up
        (:meth:`_enclose`) and plan again; ``False`` when there is nothing left to try (the refusal stands).

        The enclosing-module fallback: a parameter that its owner's rule cannot see whole (read directly or applied
        functionally by an ancestor's forward, e.g. Mamba's ``conv1d.weight``; used with no batch axis, e.g. Swin's
        relative position table or DeBERTa's position projections applied once per batch) gets its per-example
        gradient from the smallest enclosing module whose forward contains all its uses and treats examples
        independently: the generic fallback (``fallback.py``) re-runs that module per example with the parameter
        replaced by its path, and the owner's rule no longer records it. The enclosing module is verified like any
        fallback (the per-example re-run must reproduce its batched output, no dropout), and the whole first-step
        check runs again on the new plan: it must pass for every parameter, or the first refusal is raised.
        """
        if not names:
            return False
        before = dict(self._enclosure)
        if not self._enclose(self._same_role(names)) or self._plan()[0]:
            self._enclosure = before
            self._plan()
            return False
        self._verified = set()
        self._layout, self._mapped = {}, {}
        return True

    def _probe_layout(self, run_losses: Callable[[slice], torch.Tensor], batch_size: int) -> None:
        seen = {}
        big = batch_size
        names = {id(m): (n, type(m).__name__) for n, m, _ in self._modules}
        rules: dict[int, tuple] = {}
        for _, m, r in self._modules:
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
                    owner = next((n for n, m in self.model.named_modules() if id(m) == key[0]), "?")
                    problems.append(
                        f"{owner}.{key[2]} (call {key[1] + 1}): its result ({tuple(two.shape)} for {big} examples, "
                        f"{tuple(one.shape)} for the first alone) does not hold the examples' rows first and one "
                        "example at a time, so hf_dp cannot split the gradient of the batch-less tensors it uses per "
                        "example. Freeze the parameters it uses (e.g. the relative embeddings and position "
                        "projections) or train with LoRA.")
                return
            if key[0] in self._fallbacks:
                fb = self._fallbacks[key[0]]  # recurrent.py proves its own batch axis (sequence-first inputs)
                self._mapped[key] = fb.probe_layout(two, one, big) if hasattr(fb, "probe_layout") else [
                    _leaf_layout(x2, x1, big) for x2, x1 in zip(two, one)]
                return
            name, cls = names[key[0]]
            call = f"{name} ({cls}, call {key[1] + 1} in the forward)"
            n_before = len(problems)
            axis = _later_batch_axis(two, one, big)
            if axis:
                self._layout[key] = axis  # e.g. Longformer's sequence-first (T, B, d) projections
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
                    concerned.extend(self._owned(*rules[key[0]]))
                    return
                if r1 == 1:
                    self._layout.pop(key, None)
                    return
                same = torch.equal(two[:r1], one) if not one.is_floating_point() else torch.allclose(
                    two[:r1].double(), one.double(), rtol=1e-3, atol=1e-5)
                if same:
                    self._layout[key] = "flat"
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
                concerned.extend(self._owned(*rules[key[0]]))
        # The first example alone, then the B examples, each call judged as it comes: a copy of every call's input
        # for B examples would be the memory of the whole model's activations (what activation checkpointing saves).
        self._probe = seen[1] = {}
        try:
            with torch.no_grad(), self.record(1, freeze=False):
                run_losses(slice(0, 1))
            self._probe = _Judged(judge)
            with torch.no_grad(), self.record(big, freeze=False):
                run_losses(slice(0, big))
        finally:
            self._probe = None
        if problems:
            raise _with_enclosable(UnsupportedLayerError("Per-example gradients cannot be formed for these layers:\n  "
                                                         + "\n  ".join(problems)), concerned)

    @contextlib.contextmanager
    def _stand_ins(self) -> Iterator[dict[str, nn.Parameter]]:
        """Every trainable parameter replaced, where it is registered, by a fresh ``nn.Parameter`` on the same storage
        (tied parameters by one stand-in): autograd's reference gradient lands on the stand-ins, so the real
        parameters' ``.grad`` and any hooks the user registered on them are never touched."""
        stand_in = {id(p): nn.Parameter(p.detach(), requires_grad=True) for p in self.params.values()}
        swapped = []
        for module in self.model.modules():
            for k, p in list(module._parameters.items()):
                if p is not None and id(p) in stand_in:
                    swapped.append((module, k, p))
                    module._parameters[k] = stand_in[id(p)]
        try:
            yield {n: stand_in[id(p)] for n, p in self.params.items()}
        finally:
            for module, k, p in swapped:
                module._parameters[k] = p

    def _check_against_autograd(self, run_losses: Callable[[slice], torch.Tensor], n: int, rtol: float) -> None:
        cuda = sorted({p.device.index or 0 for p in self.params.values() if p.device.type == "cuda"})
        with self.record(n), torch.random.fork_rng(devices=cuda):  # sweepfix: both runs see the same random draws
            torch.manual_seed(0)
            losses = run_losses(slice(0, n))
            if losses.requires_grad:
                losses.sum().backward()
        self.per_example_norms_sq()
        self.accumulate_clipped(torch.ones(n, dtype=torch.float64, device=losses.device))
        hooked = self.summed_grads
        self.summed_grads = {}
        with self._stand_ins() as stand_ins, torch.random.fork_rng(devices=cuda):
            torch.manual_seed(0)
            losses = run_losses(slice(0, n))
            if losses.requires_grad:
                losses.sum().backward()
        escaped = []
        # A gradient that is zero in exact arithmetic (e.g. an attention key bias: softmax is invariant to it) is
        # rounding noise in both computations: below a floor set by the dtype's precision and the scale of the whole
        # gradient, it is not compared with its own (noise) magnitude. A parameter the hooks never saw while autograd
        # gives it any nonzero gradient is an escaped use whatever its size.
        scale = max((float(g.grad.abs().max()) for g in stand_ins.values()  # sweepfix: empty parameters skipped
                     if g.grad is not None and g.grad.numel() and torch.isfinite(g.grad).all()), default=0.0)
        for name, p in self.params.items():
            ref, mine = stand_ins[name].grad, hooked.get(name)
            if (ref is None and mine is None) or p.numel() == 0:  # sweepfix: an empty parameter has nothing to compare
                continue
            unseen = mine is None
            ref = torch.zeros_like(p) if ref is None else ref
            mine = torch.zeros_like(ref) if mine is None else mine.to(ref.dtype)
            if not torch.isfinite(ref).all():
                continue  # a non-finite example: it gets clipping factor 0 in training
            if unseen and bool(ref.any()):
                escaped.append(f"{name} (owned by {', '.join(self._owners.get(id(p), ['?']))})")
                continue
            floor = 100 * torch.finfo(ref.dtype).eps * scale if ref.is_floating_point() else 0.0
            tol = rtol * max(float(ref.abs().max()), floor / rtol, 1e-12)
            if not torch.allclose(mine, ref, rtol=rtol, atol=tol):
                escaped.append(f"{name} (owned by {', '.join(self._owners.get(id(p), ['?']))})")
        if escaped:
            raise _with_enclosable(UnsupportedLayerError(
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
            with self.record(batch_size):
                losses = run_losses(slice(0, batch_size))
                if losses.requires_grad:
                    losses.sum().backward()
            batched = self._total_norms(batch_size)
            for p in self.params.values():
                p.grad = None
            for i in range(min(num_single, batch_size)):
                with self.record(1):  # per example: unit regrouping is exact tensor algebra, tested separately
                    single = run_losses(slice(i, i + 1))
                    if single.requires_grad:
                        single.sum().backward()
                alone = float(self._total_norms(1)[0])
                if not (math.isfinite(alone) and math.isfinite(float(batched[i]))):
                    continue
                if abs(alone - float(batched[i])) > rtol * max(alone, 1e-12) + 1e-12:
                    raise UnsupportedLayerError(
                        f"Example {i}'s gradient norm is {float(batched[i]):.6g} in its micro-batch of "
                        f"{batch_size} but {alone:.6g} alone{mode}: the model mixes examples (batch statistics, "
                        "attention or pooling across the batch, or an input shared by the batch), so per-example "
                        "clipping would not bound an example's contribution. Find the layer that computes across "
                        "the batch and freeze it or replace it by a per-example one."
                    )
        finally:
            self._restore_state(saved)

    def check_counterfactual(self, run_batch: Callable[[], torch.Tensor], rows: int, num_examples: int,
                             alone: dict[int, Callable[[], torch.Tensor]], rtol: float = 1e-3,
                             segments: torch.Tensor | None = None, what: str = "") -> None:
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
            with self.record(rows, segments=segments), clipped_in_backward(self, factors) as sq:
                losses = run_batch()
                if losses.shape != (num_examples,):
                    raise ValueError(f"per_example_loss must return shape ({num_examples},), got "
                                     f"{tuple(losses.shape)}.")
                if losses.requires_grad:
                    losses.sum().backward()
            losses = losses.detach().double().cpu()
            hook_norms = (torch.stack([v.double() for v in sq.values()]).sum(0).sqrt().cpu() if sq
                          else torch.zeros(num_examples, dtype=torch.float64))
            hooked, self.summed_grads = self.summed_grads, {}
            self.clear()
            names = list(self.params)
            ref: dict[str, torch.Tensor] = {}
            problems = []
            for i in checked:
                with self._stand_ins() as stand_ins:
                    single = alone[i]()
                    grads = [None] * len(names)
                    if single.requires_grad:
                        # .backward(), not autograd.grad: reentrant activation checkpointing (transformers'
                        # default under peft.prepare_model_for_kbit_training) supports only .backward()
                        single.sum().backward()
                        grads = [stand_ins[n].grad for n in names]
                single = float(single.detach().double().reshape(-1)[0])
                norm_sq = 0.0
                for n, g in zip(names, grads):
                    if g is None or not torch.isfinite(g).all():
                        continue
                    norm_sq += float(g.double().pow(2).sum())
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
                    r = torch.zeros_like(self.params[n], dtype=torch.float64) if r is None else r
                    m = torch.zeros_like(r) if m is None else m.to(r.device, torch.float64)
                    floor = 100 * torch.finfo(self.params[n].dtype).eps * scale \
                        if self.params[n].is_floating_point() else 0.0
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

    def self_check(self, run_losses: Callable[[slice], torch.Tensor], batch_size: int, num_single: int = 2,
                   rtol: float = 1e-3) -> None:
        """:meth:`first_step_check` then :meth:`check_single_examples` (both checks, on the model as it is)."""
        self.first_step_check(run_losses, batch_size, rtol)
        self.check_single_examples(run_losses, batch_size, num_single, rtol)

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

    def _owned(self, module: nn.Module, rule: Rule) -> list[str]:
        return [self._names[id(getattr(module, n))] for n in rule.params
                if getattr(module, n, None) is not None and self._keeps(getattr(module, n))]

    def _keeps(self, param) -> bool:
        """Whether a rule records this parameter: trainable, and not computed by an enclosing module's fallback."""
        return id(param) in self._names and id(param) not in self._enclosed

    def _add_uses(self, name: str, uses: list[Use]) -> None:
        """Store one hooked call's uses (called from the gradient hooks); clip completed groups (fused mode)."""
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
                raise _with_enclosable(UnsupportedLayerError(
                    f"{name} saw a batch of {u.batch_size} in a micro-batch of {b} examples: {cause}."),
                    [self._names[id(v.param)] for v in uses if id(v.param) in self._names])
        if self._segments is not None:  # padding-free packed rows: one block per example
            uses = [self._segment_use(u) for u in uses]
        touched = set()
        for u in uses:
            name_u = self._names[id(u.param)]
            existing = self._uses.setdefault(name_u, [])
            existing.append(u)
            if len({(v.left_dim, v.right.shape[-1]) for v in existing}) > 1:
                self._uses[name_u] = [_as_ones(v) for v in existing]  # e.g. a fallback use and a rule's use
            self._pending[name_u] = self._pending.get(name_u, 0) - 1
            touched.add(name_u)
        if self._groups is not None:
            for k in sorted({self._group_of[n] for n in touched}):
                if self._group_ready(k):
                    self._process_group(k)

    def _forward_hook(self, name: str, module: nn.Module, rule: Rule):
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
        owned = self._owned(module, rule)

        def hook(inp, output):
            if self._replaying:
                return output
            # A forward during the backward re-runs a checkpointed segment (checkpointing.py): its call was numbered
            # (and counted, below) in the first forward.
            recompute = self._watch.started and self._probe is None
            key = None if recompute else self._next_call(module)
            if self._probe is None and torch.is_grad_enabled() and not isinstance(output, torch.Tensor):
                # never skip a ruled call silently (also inside a broadcast point)
                raise _with_enclosable(UnsupportedLayerError(
                    f"{name} ({type(module).__name__}) returned a {type(output).__name__}, not a tensor, while its "
                    f"{rule.name!r} rule factors a layer whose call returns one tensor (e.g. nn.Linear's "
                    "F.linear(x, weight, bias)); its per-example gradient cannot be formed from this call. Freeze its "
                    "parameters (requires_grad_(False)) or train the model through a PEFT adapter (LoRA)."), owned)
            if self._bcast is not None:  # inside a broadcast point: its per-example gradient comes from there
                if self._probe is not None or not torch.is_grad_enabled():
                    return output
                if not output.requires_grad:
                    output = output.detach().requires_grad_(True)
                self._bcast.append((name, module, rule, _detached(inp), output))
                if self._groups is not None:
                    for n in owned:
                        self._pending[n] = self._pending.get(n, 0) + 1
                # A copy (batch-less, small) goes on: the model may modify it in place (DeBERTa's
                # `pos_query_layer /= scale` on a view), which would rebase the captured output in the graph.
                return output.clone()
            if self._probe is not None:
                self._probe[key] = inp.detach().clone() if isinstance(inp, torch.Tensor) else None
                return output
            if not torch.is_grad_enabled():
                if self._groups is not None:  # reentrant checkpointing records this call when it re-runs it
                    for n in owned:
                        self._pending[n] = self._pending.get(n, 0) + 1
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
                    raise _with_enclosable(err, owned) from None
                self._verified.add(id(module))
            if not output.requires_grad:
                # Nothing upstream is trainable: start the graph here so the output gradient reaches the hook.
                output = output.detach().requires_grad_(True)

            # The input is a saved tensor of the graph (checkpointing.keep_input), not held here: activation
            # checkpointing drops it in the first forward and recomputes it for the backward. The callback must not
            # refer to `output` (a tensor -> node -> callback -> tensor cycle the garbage collector cannot free).
            box = [True]
            shape = output.shape

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
                        if self._keeps(u.param)]
                self._add_uses(name, uses)

            if self._groups is not None and not recompute:
                for n in owned:
                    self._pending[n] = self._pending.get(n, 0) + 1
            return keep_input(output, inp, self._watch, grad_hook)

        return hook

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
                raise _with_enclosable(UnsupportedLayerError(
                    f"{type(owner).__name__}.{method} returned shape "
                    f"{tuple(getattr(result, 'shape', ()))}, not a bias with a leading broadcast axis of 1: hf_dp "
                    "cannot give its layers per-example gradients. Freeze " + ", ".join(c[0] for c in captured) + "."),
                    [n for c in captured for n in self._owned(c[1], c[2])])
            expanded = result.expand(b, *result.shape[1:])
            if not result.requires_grad:
                return expanded
            box = [captured]

            def grad_hook(grad: torch.Tensor) -> None:
                if self._in_vjp:
                    return
                for name, module, rule, inp, out in box.pop():
                    per_example = torch.autograd.grad(result, out, grad.unsqueeze(1), retain_graph=True,
                                                      is_grads_batched=True, allow_unused=True)[0]
                    if per_example is None:
                        per_example = out.new_zeros(b, *out.shape)
                    uses = rule.uses(module, name, inp.unsqueeze(0).expand(b, *inp.shape), None, per_example)
                    self._add_uses(name, [u for u in uses if self._keeps(u.param)])

            expanded.register_hook(grad_hook)
            return expanded

        return _patch(owner, method, wrapped)

    def _shared_point(self, owner: nn.Module, method: str):
        """Per-example gradients for a tensor computed once per batch with no batch axis (``_SHARED_METHODS``).

        DeBERTa-v2's ``get_rel_embedding`` returns ``LayerNorm(rel_embeddings.weight)``, ``(2P, d)``, which every
        layer's :meth:`_mixing_point` projects and combines with each example's queries and keys. Inside
        :meth:`record`, the trainable parameters under ``owner`` are replaced for the call by stand-ins (fresh leaves on
        the same storage, as in :meth:`_stand_ins`), so that the result depends on them in the graph: a parameter read
        directly (``rel_embeddings.weight``, never passed through its module's forward) is reached that way, and the
        ruled calls inside (the LayerNorm) are captured with their inputs and outputs. The mixing points then add, per
        example, the gradient of their scores with respect to those tensors (one batched vector-Jacobian product
        each); when the gradient of the result is complete (its tensor hook: every consumer has run), the captured
        calls' rules apply to their per-example output gradients, and a directly read parameter gets its per-example
        gradient instantiated (``(B, numel)``, a ``ones`` use). Returns a handle whose ``remove()`` restores the method.
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
            if not live or not isinstance(result, torch.Tensor) or not result.requires_grad:
                return result
            called = {id(c[1]) for c in captured}
            reached = _graph_leaves(result)  # a stand-in the result does not depend on is not used here
            direct = [(self._names[id(p)], p, s) for m, _k, s, p in stand_ins
                      if id(m) not in called and id(s) in reached and self._keeps(p)]
            if self._groups is not None:
                for n, _p, _s in direct:
                    self._pending[n] = self._pending.get(n, 0) + 1
            targets = [c[4] for c in captured] + [s for _n, _p, s in direct]
            result = result.view_as(result)  # its own node, which the mixing points find their inputs from
            targets.append(result)  # its per-example gradients must add up to its gradient (checked in the hook)
            record = {"targets": targets, "acc": [None] * len(targets), "result": result}
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
                    g = out.new_zeros(b, *out.shape) if g is None else g
                    uses = rule.uses(module, name, inp.unsqueeze(0).expand(b, *inp.shape), None, g)
                    self._add_uses(name, [u for u in uses if self._keeps(u.param)])
                for (name, p, _s), g in zip(direct, acc[len(captured):]):
                    g = p.new_zeros(b, p.numel()) if g is None else g.reshape(b, -1)
                    self._add_uses(name, [Use(p, None, g.unsqueeze(1), 1, name)])
                seen = acc[-1]
                total = _grad.new_zeros(_grad.shape) if seen is None else seen.sum(0)
                if not torch.allclose(total, _grad, rtol=1e-3, atol=1e-3 * float(_grad.abs().max()) + 1e-12) \
                        and bool(torch.isfinite(_grad).all()):
                    raise UnsupportedLayerError(
                        f"{type(owner).__name__}.{method}: its result reaches the loss other than through the methods "
                        f"hf_dp splits per example ({', '.join(_MIXING_METHODS)}), so the per-example gradients of "
                        + ", ".join([c[0] for c in captured] + [n for n, _p, _s in direct]) + " would miss part of "
                        "their gradient. Freeze them (requires_grad_(False)) or train with LoRA.")

            result.register_hook(grad_hook)
            return result

        return _patch(owner, method, wrapped)

    def _mixing_point(self, owner: nn.Module, method: str):
        """Per-example gradients of batch-less computations inside a method whose result has the examples first
        (``_MIXING_METHODS``, DeBERTa-v2's ``disentangled_attention_bias``).

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
            if shared and torch.is_grad_enabled() and self._probe is None:
                # Inputs that carry the examples (not derived from a shared tensor) are gated: the batched product
                # below must reach the shared tensors only through this method's own ops, not through the examples'
                # hidden states (which depend on the shared tensors through earlier layers: their mixing points count
                # that path).
                roots = [r["result"].grad_fn for r in shared]

                def gate(x):
                    if not isinstance(x, torch.Tensor) or not x.requires_grad or _derived_from(x, roots):
                        return x
                    return _VjpGate.apply(x, self)

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

            def grad_hook(grad: torch.Tensor) -> None:
                if self._in_vjp:  # this hook is on the tensor the batched product below starts from
                    return
                calls = box.pop()
                rows = grad.reshape(b, -1)
                eye = torch.eye(b, dtype=grad.dtype, device=grad.device)
                masked = (eye.unsqueeze(-1) * rows.unsqueeze(0)).reshape(b, *grad.shape)  # example i's rows only
                self._in_vjp = True
                try:
                    per = torch.autograd.grad(result, targets, masked, retain_graph=True, is_grads_batched=True,
                                              allow_unused=True)
                finally:
                    self._in_vjp = False
                for (name, module, rule, inp, out), g in zip(calls, per):
                    g = out.new_zeros(b, *out.shape) if g is None else g
                    uses = rule.uses(module, name, inp.unsqueeze(0).expand(b, *inp.shape), None, g)
                    self._add_uses(name, [u for u in uses if self._keeps(u.param)])
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

    def _fallback_hook(self, name: str, module: nn.Module, fb: Fallback):
        """Forward hook of a module without a rule (or of the parameters its rule does not cover): per-example
        gradients by re-running it (``fallback.py``)."""
        owned = [self._names[id(fb.param(n))] for n in fb.param_names]
        counter = fb if fb.ruled else module  # a side fallback's calls are numbered apart from its module's rule's

        def hook(mod, args, kwargs, output):
            if self._replaying:
                return None
            key = self._next_call(counter)
            if self._probe is not None:
                leaves, _ = tree_flatten((args, kwargs))
                self._probe[key] = [x.detach().clone() if isinstance(x, torch.Tensor) and x.dim() > 0 else
                                    (x if isinstance(x, int) and not isinstance(x, bool) else None) for x in leaves]
                return None
            if not torch.is_grad_enabled():
                return None
            leaves, spec = tree_flatten(output)
            if not any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in leaves):
                return None
            b = self._batch_size
            if type(fb) is Fallback:  # every call: the first-step checks run with dropout off, training does not
                fb.check_dropout()  # (recurrent.py refuses recurrent dropout itself)
            saved_args = tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, (args, kwargs))
            mapped = fb.mapped_leaves(*saved_args, b, self._mapped.get(key))
            if id(module) not in self._verified:
                with self._replay():
                    fb.verify(*saved_args, output, b, mapped)
                self._verified.add(id(module))
            # Each float output is returned as a fresh copy (a leaf if nothing upstream is trainable), so that its
            # gradient holds only the uses *after* the module: an output that is also an intermediate of another
            # output (eager attention returns its weights, from which it computes its output) would otherwise pass
            # the other output's gradient twice through the vector-Jacobian product. A copy, not a view: an in-place
            # op on a view (the caller's `out /= scale`) would rebase it and drop the gradient hook (_hook_target).
            for i, t in enumerate(leaves):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    leaves[i] = t.clone() if t.requires_grad else t.detach().requires_grad_(True)
            outs = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
            likes = [t.detach() for t in outs]
            box = [saved_args]
            del saved_args

            def grads_hook(grads) -> None:
                if self._in_vjp:
                    return
                if not box:
                    raise RuntimeError(f"{name}: the gradient hook fired twice for one recorded forward pass.")
                a, k = box.pop()
                with self._replay():
                    per = fb.per_example_grads(a, k, list(grads), likes, mapped, b)
                uses = per if isinstance(per, list) else [  # recurrent.py returns Use factors itself
                    Use(fb.param(n), None, g.unsqueeze(1), 1, name) for n, g in per.items()]
                self._add_uses(name, [u for u in uses if id(u.param) in self._names])

            if self._groups is not None:
                for n in owned:
                    self._pending[n] = self._pending.get(n, 0) + 1
            torch.autograd.graph.register_multi_grad_hook(outs, grads_hook, mode="all")
            return tree_unflatten(leaves, spec)

        return hook

    def clear(self) -> None:
        """Drop the stored factors of the last micro-batch."""
        self._uses = {}
        self._pending = {}
        self._early_norms: dict[str, torch.Tensor] = {}
        self._kept: dict[str, list[Use]] = {}
        self._instantiated: dict[str, torch.Tensor] = {}
        self._gram_cache: dict = {}
        self._scratch: dict = {}

    def _uses_by_param(self) -> dict[str, list[Use]]:
        return self._uses

    # ------------------------------------------------------------------ packed rows
    def _set_segments(self, segments: torch.Tensor | None) -> None:
        """Index maps from the tokens of packed rows to per-example blocks (the layout of :meth:`_set_units`)."""
        self._segments = None
        if segments is None:
            return
        flat = segments.reshape(-1)
        tokens = (flat >= 0).nonzero().flatten()
        example = flat[tokens]
        counts = torch.bincount(example)
        if bool((counts == 0).any()):
            raise ValueError("segments must number the examples of a micro-batch 0..S-1 without gaps.")
        order = torch.argsort(example, stable=True)  # tokens of an example keep their order
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.empty_like(example)
        slot[order] = torch.arange(len(example), device=example.device) - starts[example[order]]
        self._segments = (tuple(segments.shape), tokens, example, slot, len(counts), int(counts.max()))

    def _to_segments(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, k·T, ...)`` packed rows → ``(S, k·T_max, ...)``: each example's positions, in order, zero-padded.

        ``k > 1`` when a layer sees several positions per token, token-major (e.g. a norm over the heads of
        ``(B, T, H, d)``, viewed as ``(B, T·H, d)``).
        """
        (rows, length), tokens, example, slot, num, longest = self._segments
        k = x.shape[1] // length
        per_token = x.reshape(rows * length, k, *x.shape[2:])
        out = x.new_zeros(num, longest, k, *x.shape[2:])
        out[example, slot] = per_token[tokens]
        return out.reshape(num, longest * k, *x.shape[2:])

    def _segment_use(self, u: Use) -> Use:
        """One use of packed rows as per-example uses: ``G_i = Σ_{t∈i} L_tᵀ R_t = L_iᵀ R_i`` over example ``i``'s
        tokens only (the padded positions have ``R = 0``, so they add nothing to norms or sums)."""
        rows, length = self._segments[0]
        positions = {tuple(u.right.shape[:2])} | ({tuple(u.left.shape[:2])} if u.left is not None else set())
        if len(positions) != 1 or u.right.shape[0] != rows or u.right.shape[1] % length:
            raise UnsupportedLayerError(
                f"{u.module_name} sees {tuple(u.right.shape[:2])} (rows, positions) in packed rows of "
                f"{(rows, length)} tokens: its positions are not the packed tokens (e.g. virtual tokens of prompt or "
                "prefix tuning, shared by all examples of the row), so its gradient cannot be split per packed "
                "example. Train without packing (packing=False, padding_free=False)."
            )
        left = None if u.left is None else self._to_segments(u.left)
        return Use(u.param, left, self._to_segments(u.right), u.left_dim, u.module_name)

    # ------------------------------------------------------------------ norms and sums
    def _set_units(self, units: torch.Tensor | None, weights: torch.Tensor | None) -> None:
        self._units = units
        self._unit_weights = weights
        if units is None:
            return
        counts = torch.bincount(units)
        order = torch.argsort(units, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.empty_like(units)
        slot[order] = torch.arange(len(units), device=units.device) - starts[units[order]]
        self._unit_slot = slot
        self._num_units = len(counts)
        self._unit_capacity = int(counts.max())

    def _to_units(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, ...)`` per example → ``(U, n_max·T, ...)`` per unit: its examples concatenated, zero-padded."""
        out = x.new_zeros(self._num_units, self._unit_capacity, *x.shape[1:])
        out[self._units, self._unit_slot] = x
        return out.reshape(self._num_units, self._unit_capacity * x.shape[1], *x.shape[2:])

    def _unit_uses(self, uses: list[Use]) -> list[Use]:
        """The uses of a parameter regrouped by privacy unit: ``G_u = Σ_{i∈u} w_i L_iᵀ R_i = L_uᵀ R_u``."""
        out = []
        for u in uses:
            right = u.right if self._unit_weights is None else u.right * self._unit_weights.to(u.right.dtype).view(
                -1, 1, 1)
            left = None if u.left is None else self._to_units(u.left)
            out.append(Use(u.param, left, self._to_units(right), u.left_dim, u.module_name))
        return out

    def unit_factors(self, unit_factors: torch.Tensor) -> torch.Tensor:
        """Per-unit clipping factors → per-example factors ``c_{u(i)} w_i`` for the clipped sum."""
        if self._units is None:
            return unit_factors
        c = unit_factors[self._units]
        return c if self._unit_weights is None else c * self._unit_weights.to(c.dtype)

    def _norm_sq_of(self, name: str, uses: list[Use], grams: dict | None = None, fused: bool = False,
                    memory_ratio: float = _INSTANTIATE_MEMORY_RATIO,
                    scratch: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(B,)`` squared per-example (or ``(U,)`` per-unit) norms of one parameter's gradient, and its
        instantiation if that was cheaper (per example only). ``grams``: a cache shared by the parameters of one
        norm pass (:func:`_self_gram`); ``fused``: clipped right away (:func:`use_ghost_norm`)."""
        if self._units is not None:
            uses = self._unit_uses(uses)
            self.norm_paths[name] = "ghost" if use_ghost_norm(uses) else "instantiate"
            return self._plain_norm_sq(uses)[0], None
        ghost = use_ghost_norm(uses, fused, memory_ratio)
        self.norm_paths[name] = "ghost" if ghost else "instantiate"
        return self._plain_norm_sq(uses, grams, ghost, scratch)

    @staticmethod
    def _plain_norm_sq(uses: list[Use], grams: dict | None = None, ghost: bool | None = None,
                       scratch: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``scratch``: the instantiation of a parameter with one dense use is written into a reused buffer
        (:func:`_scratch_for`); the caller must be done with it before the next parameter's."""
        dtype = _acc_dtype(*[u.right for u in uses])
        if use_ghost_norm(uses) if ghost is None else ghost:
            total = None
            for i, u in enumerate(uses):
                for v in uses[i:]:
                    if v is u:
                        left = _self_gram(u.left, dtype, grams) if u.kind == "dense" else _left_gram(u, u, dtype)
                        term = (left * _self_gram(u.right, dtype, grams)).sum((1, 2))
                    else:
                        right = torch.bmm(u.right.to(dtype), v.right.to(dtype).transpose(1, 2))
                        term = 2 * (_left_gram(u, v, dtype) * right).sum((1, 2))
                    total = term if total is None else total + term
            return total, None
        # Not sum(...): its 0 + g copies the first (B, d_L, d_R) instantiation into a fresh allocation, which on CPU
        # costs as much as a third of the batched matmul (page faults; 15 of 38 ms for BERT's FFN at T = 128).
        g = _instantiate(uses[0], dtype, _scratch_for(uses[0], dtype, scratch) if len(uses) == 1 else None)
        for u in uses[1:]:
            g = g + _instantiate(u, dtype)
        # Norms of the rows, then their squares summed: one fast pass, each partial sum short (a flat pow().sum() over
        # d_L·d_R values per example is ~20× slower on CPU; benchmarks/RESULTS.md).
        return torch.linalg.vector_norm(g, dim=2).square().sum(1), g

    def _add_clipped(self, name: str, uses: list[Use], c: torch.Tensor, inst: torch.Tensor | None,
                     zeroed: bool = True) -> None:
        """Add ``Σ_i c_i G_{i,name}`` into :attr:`summed_grads`. ``zeroed=False``: no factor is 0 (checked by the
        caller once per micro-batch or group), so no row needs zeroing (:func:`_clipped_sum`)."""
        p = self.params[name]
        if inst is not None:  # rows of examples with factor 0 (non-finite) zeroed, not scaled: 0 · NaN = NaN
            g = torch.where(c.view(-1, 1, 1) != 0, inst, 0.0) if zeroed else inst
            s = (c.to(inst.dtype).view(1, -1) @ g.reshape(g.shape[0], -1)).view(inst.shape[1:])
        else:
            dtype = _acc_dtype(*[u.right for u in uses])
            s = _clipped_sum(uses[0], c, dtype, zeroed)  # a fresh tensor (matmul / index_add_ / sum): safe to add into
            for u in uses[1:]:  # e.g. a tied embedding and LM head: the shared parameter's gradient is their sum
                s.add_(_clipped_sum(u, c, dtype, zeroed))
        s = s.reshape(p.shape)
        if name in self.summed_grads:
            self.summed_grads[name] += s
        else:
            self.summed_grads[name] = s

    @torch.no_grad()
    def per_example_norms_sq(self) -> dict[str, torch.Tensor]:
        """``{param name: (B,) squared per-example gradient norms}`` for every parameter that got a gradient.

        Parameters that no captured use touched (not reached by the loss) have zero gradient and are absent.
        """
        if self._groups is not None and self._handler is None:  # norms computed at arrival (set_fused_groups)
            for k in sorted({self._group_of[n] for n in self._uses}):  # groups some use of which got no gradient
                self._process_group(k)
            self._pending = {}
            self._gram_cache = {}
            out, self._early_norms = self._early_norms, {}
            self._uses, self._kept = self._kept, {}
            return out
        out: dict[str, torch.Tensor] = {}
        self._instantiated: dict[str, torch.Tensor] = {}
        grams: dict = {}  # every factor stays alive during this loop (self._uses), so the cache's keys stay valid
        for name, uses in self._uses_by_param().items():
            out[name], inst = self._norm_sq_of(name, uses, grams)
            if inst is not None:
                self._instantiated[name] = inst
        return out

    @torch.no_grad()
    def accumulate_clipped(self, factors: dict[str, torch.Tensor] | torch.Tensor) -> None:
        """Add ``Σ_i c_i G_{i,p}`` into :attr:`summed_grads` for every parameter ``p``.

        Args:
            factors: one ``(B,)`` vector for all parameters (flat clipping), or ``{param name: (B,)}``; per unit
                ``(U,)`` when the micro-batch was recorded with ``units``.
        """
        inst = getattr(self, "_instantiated", {})
        shared = None if isinstance(factors, dict) else self.unit_factors(factors)
        zeroed = None if shared is None else bool((shared == 0).any())  # one check for all parameters
        for name, uses in self._uses_by_param().items():
            c = shared if shared is not None else self.unit_factors(factors[name])
            z = zeroed if zeroed is not None else bool((c == 0).any())
            self._add_clipped(name, uses, c, inst.get(name), z)
        self._instantiated = {}

    # ------------------------------------------------------------------ clipping fused into back-propagation
    def set_fused_groups(self, groups: list[list[str]] | None, handler: GroupHandler | None) -> None:
        """Clip group by group *during* the backward pass (He et al. 2023, §3.1).

        With groups set, as soon as every captured use of every parameter of a group has received its output
        gradient, the engine computes the group's per-example squared norms, asks ``handler(k, norms_sq)`` for the
        ``(B,)`` clipping factors of group ``k``, adds the clipped sums, and frees that group's activations and
        output gradients. Nothing waits for the end of the backward pass except groups whose parameters are shared
        with a layer whose gradient arrives later (tied embeddings: the cross term needs both). ``None`` turns it off.

        ``handler=None`` (flat clipping, whose factors need every norm): norms at arrival only. Each group's norms are
        computed as soon as it is complete and kept, with what its clipped sum needs — the factors ``L, R``, or the
        per-example gradients instead when that is faster and they take no more memory than the factors they
        replace (:func:`use_ghost_norm` with ``memory_ratio=1``); :meth:`per_example_norms_sq` then returns them and
        :meth:`accumulate_clipped` works as without groups.
        """
        self._groups = groups
        self._handler = handler
        self._group_of = {n: k for k, names in enumerate(groups or []) for n in names}

    def _group_ready(self, k: int) -> bool:
        return all(self._pending.get(n, 0) == 0 for n in self._groups[k])

    @torch.no_grad()
    def _process_group(self, k: int) -> None:
        stored = {n: self._uses.pop(n) for n in self._groups[k] if n in self._uses}
        if not stored:
            return
        norms, insts = {}, {}
        # A group with one dense parameter (a layer: weight and bias) may instantiate it (use_ghost_norm, fused): it
        # lives only until the group is clipped. Larger groups (group_wise, per_device) keep the memory rule, since
        # all their instantiations would be alive together.
        fused = sum(len(u) == 1 and u[0].kind == "dense" for u in stored.values()) <= 1
        deferred = self._handler is None
        grams = self._gram_cache if deferred else None  # flat: factors stay alive anyway (q/k/v share an input)
        # Clipped right away (not deferred) with one dense parameter: its instantiation, if any, is dropped below before
        # the next group's, so all groups share one buffer (_scratch_for). Kept instantiations (flat) get their own.
        scratch = self._scratch if fused and not deferred else None
        for n, uses in stored.items():
            norms[n], insts[n] = self._norm_sq_of(n, uses, grams, fused=fused, memory_ratio=1 if deferred else 2,
                                                  scratch=scratch)
        if deferred:  # flat clipping: keep the norms and what the clipped sum needs (set_fused_groups)
            for n, uses in stored.items():
                self._early_norms[n] = norms[n]
                if insts[n] is not None:
                    self._instantiated[n] = insts[n]
                self._kept[n] = [] if insts[n] is not None else uses  # the factors are freed when instantiated
            return
        factors = self.unit_factors(self._handler(k, norms))
        # On CPU one check skips the zeroing passes; on an accelerator it would synchronise once per layer inside the
        # backward pass, so the (cheap there) zeroing runs instead.
        zeroed = bool((factors == 0).any()) if factors.device.type == "cpu" else True
        for n, uses in stored.items():
            self._add_clipped(n, uses, factors, insts[n], zeroed)

    def finish_fused(self) -> None:
        """After the backward pass: process the groups not completed during it (some use got no gradient)."""
        if self._groups is None:
            return
        for k in sorted({self._group_of[n] for n in self._uses}):
            self._process_group(k)
        self._pending = {}
        self._scratch = {}

    def pop_summed_grads(self) -> dict[str, torch.Tensor]:
        """The clipped sums accumulated since the last call (zeros for untouched parameters); resets them."""
        out = {}
        for name, p in self.params.items():
            s = self.summed_grads.get(name)
            out[name] = torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32)) if s is None else s
        self.summed_grads = {}
        return out
