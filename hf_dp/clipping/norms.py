"""Per-example norms and clipped sums of one parameter from its uses (pure maths on ``Use`` factors, no state).

A use factors one layer call's per-example gradient as ``G_i = L_iᵀ R_i`` (``rules/``). From a parameter's uses:

* :func:`norm_sq` computes ``‖G_i‖²`` — by the ghost norm ``⟨L_i L_iᵀ, R_i R_iᵀ⟩`` (Li et al. 2022, §4, App. F) or by
  instantiating ``G_i``, whichever is cheaper (:func:`use_ghost_norm`, the one place that decides);
* :func:`clipped_sum_of` forms ``Σ_i c_i G_i`` — "book-keeping" (Bu et al. 2023): one matmul per use from the stored
  factors, no second backward.

A parameter used by several layers (tied GPT-2 ``wte``/``lm_head``) has one per-example gradient, the sum of its
uses; its norm includes the cross terms ``⟨L_u L_vᵀ, R_u R_vᵀ⟩``.
"""

from __future__ import annotations

import torch

from .rules import Use

__all__ = ["acc_dtype", "as_ones", "clipped_sum_of", "norm_sq", "use_ghost_norm"]

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



def acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
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
    of a backward pass (:meth:`ClippedSums.process_group`; freed in :meth:`ClippedSums.finish_fused`).
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


def as_ones(u: Use) -> Use:
    """The same use with its per-example gradients instantiated as ``(B, 1, numel)`` (kind ``"ones"``).

    Used when one parameter's uses factor differently (a fallback use next to a rule's use, e.g. a tied embedding
    whose input-side module has no rule): their per-example gradients are then summed as flat vectors.
    """
    if u.kind == "ones" and u.seq_len == 1 and u.right.shape[-1] == u.param.numel():
        return u
    g = _instantiate(u, acc_dtype(u.right))
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


def norm_sq(uses: list[Use], grams: dict | None = None, ghost: bool | None = None,
            scratch: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(B,)`` squared per-example norms of the gradient of one parameter with these uses, and its instantiation
    ``(B, d_L, d_R)`` when that path was taken (else ``None``).

    ``ghost``: the path (default: :func:`use_ghost_norm` with its memory rule); ``grams``: a cache of self-Grams
    shared by the parameters of one norm pass (:func:`_self_gram`); ``scratch``: the instantiation of a parameter with
    one dense use is written into a reused buffer (:func:`_scratch_for`); the caller must be done with it before the
    next parameter's."""
    dtype = acc_dtype(*[u.right for u in uses])
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


def clipped_sum_of(uses: list[Use], c: torch.Tensor, inst: torch.Tensor | None, zeroed: bool = True) -> torch.Tensor:
    """``Σ_i c_i G_i`` of one parameter, from its uses or from its instantiation ``inst`` (:func:`norm_sq`), shaped
    ``(d_L, d_R)`` (the caller reshapes it to the parameter). ``zeroed=False``: no factor is 0 (checked by the caller
    once per micro-batch or group), so no row needs zeroing (:func:`_clipped_sum`)."""
    if inst is not None:  # rows of examples with factor 0 (non-finite) zeroed, not scaled: 0 · NaN = NaN
        g = torch.where(c.view(-1, 1, 1) != 0, inst, 0.0) if zeroed else inst
        return (c.to(inst.dtype).view(1, -1) @ g.reshape(g.shape[0], -1)).view(inst.shape[1:])
    dtype = acc_dtype(*[u.right for u in uses])
    s = _clipped_sum(uses[0], c, dtype, zeroed)  # a fresh tensor (matmul / index_add_ / sum): safe to add into
    for u in uses[1:]:  # e.g. a tied embedding and LM head: the shared parameter's gradient is their sum
        s.add_(_clipped_sum(u, c, dtype, zeroed))
    return s
