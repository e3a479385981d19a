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
from collections.abc import Callable, Iterator

import torch
from torch import nn

from .layers import Rule, UnsupportedLayerError, Use, find_rule, rule_parameters

__all__ = ["ClippingEngine", "GroupHandler", "use_ghost_norm", "UnsupportedLayerError"]

GroupHandler = Callable[[int, dict[str, torch.Tensor]], torch.Tensor]


def use_ghost_norm(uses: list[Use]) -> bool:
    """Whether a parameter's per-example norms are cheaper by Gram matrices (ghost) than by instantiation.

    Ghost costs ``O(T²)`` per example and use pair (two ``T × T`` Grams), instantiation ``O(d_L · d_R)`` memory and
    ``O(T · d_L · d_R)`` time (Li et al. 2022, App. F: ghost wins when ``2T² < p · d``). Index (embedding) uses are
    always ghost-normed: instantiating them would need a dense ``(B, V, d)`` tensor.
    """
    if any(u.kind == "index" for u in uses):
        return True
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


def _instantiate(u: Use, dtype: torch.dtype) -> torch.Tensor:
    """Per-example gradients ``(B, d_L, d_R)`` of one dense/ones use."""
    r = u.right.to(dtype)
    if u.left is None:
        return r.sum(1, keepdim=True)
    return torch.bmm(u.left.to(dtype).transpose(1, 2), r)


def _clipped_sum(u: Use, factors: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``Σ_i c_i L_iᵀ R_i`` as a ``(d_L, d_R)`` matrix: one matmul (or one ``index_add``) over all tokens."""
    d_r = u.right.shape[-1]
    r = u.right.to(dtype)
    c = factors.to(dtype).view(-1, 1, 1)
    if u.left is None:
        return (r * c).sum((0, 1)).unsqueeze(0)
    if u.kind == "index":
        out = r.new_zeros(u.left_dim, d_r)
        return out.index_add_(0, u.left.reshape(-1), (r * c).reshape(-1, d_r))
    left = u.left.to(dtype)
    if left.shape[-1] <= d_r:
        left = left * c
    else:
        r = r * c
    return left.reshape(-1, u.left_dim).t() @ r.reshape(-1, d_r)


class ClippingEngine:
    """Per-example gradient norms and clipped sums for every trainable parameter of a model.

    Args:
        model: the (unwrapped) model. Every parameter with ``requires_grad=True`` must be owned by a layer that has a
            rule in ``layers.py``; otherwise :class:`UnsupportedLayerError` names the parameters and says how to
            freeze them. Nothing is skipped silently.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self._modules: list[tuple[str, nn.Module, Rule]] = []
        self.params: dict[str, nn.Parameter] = {}
        covered: set[int] = set()
        uncovered: dict[int, str] = {}
        for name, module in model.named_modules():
            own = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            rule = find_rule(module)
            if rule is not None and rule.check is not None:
                rule.check(module, name)
            ruled = rule_parameters(rule, module) if rule is not None else []
            for n, p in own:
                if n in ruled:
                    covered.add(id(p))
                else:
                    uncovered.setdefault(id(p), f"{name}.{n} ({type(module).__name__})")
            if ruled:
                self._modules.append((name, module, rule))
        # A parameter owned by a ruled layer and also by another module (e.g. BERT's MLM bias, tied to its decoder)
        # is covered; whether the other module also uses it directly is checked at run time (self_check).
        problems = [desc for pid, desc in uncovered.items() if pid not in covered]
        for name, p in model.named_parameters():
            if p.requires_grad:
                self.params[name] = p
        if problems:
            listing = "\n  ".join(problems)
            raise UnsupportedLayerError(
                "These trainable parameters have no exact per-example gradient rule, so their gradients could not "
                f"be clipped per example:\n  {listing}\n"
                "Supported layers: nn.Linear, transformers Conv1D, nn.Embedding, nn.LayerNorm, RMSNorm. Freeze the "
                "others before training, e.g. `model.get_parameter(name).requires_grad_(False)`, or train them "
                "through a PEFT adapter."
            )
        self._names = {id(p): n for n, p in self.params.items()}
        self._uses: dict[str, list[Use]] = {}
        self._pending: dict[str, int] = {}
        self._units: torch.Tensor | None = None
        self._segments: tuple | None = None
        self._unit_weights: torch.Tensor | None = None
        self._groups: list[list[str]] | None = None
        self._handler: GroupHandler | None = None
        self._group_of: dict[str, int] = {}
        self._verified: set[int] = set()
        self._batch_size: int | None = None
        self.summed_grads: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ capture
    @contextlib.contextmanager
    def record(self, batch_size: int, freeze: bool = True, units: torch.Tensor | None = None,
               unit_weights: torch.Tensor | None = None, segments: torch.Tensor | None = None) -> Iterator[None]:
        """Capture the per-example factors of one micro-batch of ``batch_size`` examples.

        Run the forward *and* the backward of ``Σ_i L_i`` inside this context. Parameters are frozen inside it
        (unless ``freeze=False``, used by :meth:`self_check`), so no ``.grad`` is produced; the factors stay
        available (:meth:`per_example_norms_sq`) until :meth:`clear`.

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
        self._set_segments(segments)
        self._set_units(units, unit_weights)
        handles = [m.register_forward_hook(self._forward_hook(n, m, r), with_kwargs=True) for n, m, r in self._modules]
        handles += [m.register_forward_pre_hook(self._expand_broadcast_ids, with_kwargs=True)
                    for _, m, r in self._modules if r.name == "embedding"]
        if freeze:
            for p in self.params.values():
                p.requires_grad_(False)
        try:
            yield
        finally:
            for p in self.params.values():
                p.requires_grad_(True)
            for h in handles:
                h.remove()

    @torch.no_grad()
    def _total_norms(self, batch_size: int) -> torch.Tensor:
        norms = self.per_example_norms_sq()
        self._instantiated = {}
        if not norms:
            return torch.zeros(batch_size, dtype=torch.float64)
        return torch.stack([v.double() for v in norms.values()]).sum(0).sqrt()

    def self_check(self, run_losses: Callable[[slice], torch.Tensor], batch_size: int, num_single: int = 2,
                   rtol: float = 1e-3) -> None:
        """Check the engine against autograd and against single-example runs on the user's real model and data.

        ``run_losses(sl)`` must run the model (dropout off) on examples ``sl`` of a micro-batch and return their
        per-example losses. Two independent checks, once per training run:

        1. the unclipped sum ``Σ_i G_i`` from the hooks equals autograd's gradient for every parameter — a parameter
           used outside its layer's forward (e.g. ``layer.weight`` read directly) would escape clipping;
        2. the per-example norms of the first examples equal their norms when each runs alone — anything that mixes
           examples (inputs broadcast over the batch, batch statistics) would break per-example clipping.

        Raises :class:`UnsupportedLayerError` naming what failed.
        """
        saved = self.summed_grads
        saved_groups, saved_handler = self._groups, self._handler
        self.set_fused_groups(None, None)  # the check compares plain per-parameter norms
        self.summed_grads = {}
        try:
            with self.record(batch_size, freeze=False):
                losses = run_losses(slice(0, batch_size))
                if losses.requires_grad:
                    losses.sum().backward()
            batched = self._total_norms(batch_size)
            self.accumulate_clipped(torch.ones(batch_size, dtype=batched.dtype, device=losses.device))
            hooked = self.summed_grads
            self.summed_grads = {}
            escaped = []
            for name, p in self.params.items():
                ref = p.grad
                mine = hooked.get(name)
                if ref is None and mine is None:
                    continue
                ref = torch.zeros_like(p) if ref is None else ref
                mine = torch.zeros_like(ref) if mine is None else mine.to(ref.dtype)
                tol = rtol * float(ref.abs().max().clamp(min=1e-12))
                if not torch.allclose(mine, ref, rtol=rtol, atol=tol):
                    escaped.append(name)
            if escaped:
                raise UnsupportedLayerError(
                    "These trainable parameters get gradient that hf_dp's layer hooks do not see (the parameter is "
                    "used outside its layer's forward, e.g. `module.weight` read directly), so it could not be "
                    "clipped per example: " + ", ".join(escaped) + ". Freeze them (requires_grad_(False))."
                )
            for i in range(min(num_single, batch_size)):
                with self.record(1):  # per example: unit regrouping is exact tensor algebra, tested separately
                    single = run_losses(slice(i, i + 1))
                    if single.requires_grad:
                        single.sum().backward()
                alone = float(self._total_norms(1)[0])
                if abs(alone - float(batched[i])) > rtol * max(alone, 1e-12) + 1e-12:
                    raise UnsupportedLayerError(
                        f"Example {i}'s gradient norm is {float(batched[i]):.6g} in its micro-batch but {alone:.6g} "
                        "alone: the model mixes examples (an input broadcast over the batch, batch statistics, or a "
                        "layer whose input has no batch axis), so per-example clipping would not bound an example's "
                        "contribution. Freeze the offending layer or materialise its input per example."
                    )
        finally:
            self.clear()
            self._instantiated = {}
            self.summed_grads = saved
            self.set_fused_groups(saved_groups, saved_handler)
            for p in self.params.values():
                p.grad = None

    def _expand_broadcast_ids(self, module: nn.Module, args: tuple, kwargs: dict):
        """Materialise per-example ids for an embedding fed ids broadcast over the batch.

        HF models look up position (and sometimes token-type) embeddings with ids of shape ``(1, T)`` and rely on
        broadcasting; the gradient of that lookup would then be summed over examples. Expanding the ids to
        ``(B, T)`` gives the same outputs, repeated per example, and per-example gradients (DESIGN invariant 2).
        """
        b = self._batch_size
        ids = args[0] if args else None
        if b is None or b == 1 or not isinstance(ids, torch.Tensor) or ids.dim() < 2 or ids.shape[0] != 1:
            return None
        return (ids.expand(b, *ids.shape[1:]), *args[1:]), kwargs

    def _forward_hook(self, name: str, module: nn.Module, rule: Rule):
        owned = [self._names[id(getattr(module, n))] for n in rule.params
                 if getattr(module, n, None) is not None and id(getattr(module, n)) in self._names]

        def hook(mod, args, kwargs, output):
            if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor):
                return None
            inp = args[0] if args else next(iter(kwargs.values()))
            inp = inp.detach()
            if rule.verify is not None and id(module) not in self._verified:
                rule.verify(module, name, inp, output)
                self._verified.add(id(module))
            if not output.requires_grad:
                # Nothing upstream is trainable: start the graph here so the output gradient reaches the hook.
                output = output.detach().requires_grad_(True)

            # The hook must not refer to `output` itself: output -> grad_fn -> hook -> closure -> output would be a
            # reference cycle through autograd's C++ hook storage that the garbage collector cannot free, leaking
            # every micro-batch's graph. The input goes to the hook through a one-shot box: autograd keeps the hook
            # (and its closure) until the whole graph dies, and a captured `inp` would pin every layer's activation
            # to the end of the step; popped, it lives only as long as the Uses that need it (no rule reads the
            # output, so none is passed).
            box = [inp]
            del inp

            def grad_hook(grad: torch.Tensor) -> None:
                if not box:
                    raise RuntimeError(f"{name}: the gradient hook fired twice for one recorded forward pass "
                                       "(a second backward through the same graph is not supported while recording).")
                uses = [u for u in rule.uses(module, name, box.pop(), None, grad.detach())
                        if id(u.param) in self._names]
                for u in uses:
                    if u.batch_size != self._batch_size:
                        raise UnsupportedLayerError(
                            f"{name} saw a batch of {u.batch_size} in a micro-batch of {self._batch_size} examples: "
                            "an input is broadcast across the batch (e.g. position_ids of shape (1, T), or a prompt "
                            "computed once and repeated), so per-example gradients would merge examples. Materialise "
                            "the input per example."
                        )
                if self._segments is not None:  # padding-free packed rows: one block per example
                    uses = [self._segment_use(u) for u in uses]
                touched = set()
                for u in uses:
                    name_u = self._names[id(u.param)]
                    self._uses.setdefault(name_u, []).append(u)
                    self._pending[name_u] = self._pending.get(name_u, 0) - 1
                    touched.add(name_u)
                if self._groups is not None:
                    for k in sorted({self._group_of[n] for n in touched}):
                        if self._group_ready(k):
                            self._process_group(k)

            if self._groups is not None:
                for n in owned:
                    self._pending[n] = self._pending.get(n, 0) + 1
            output.register_hook(grad_hook)
            return output

        return hook

    def clear(self) -> None:
        """Drop the stored factors of the last micro-batch."""
        self._uses = {}
        self._pending = {}

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

    def _norm_sq_of(self, uses: list[Use]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(B,)`` squared per-example (or ``(U,)`` per-unit) norms of one parameter's gradient, and its
        instantiation if that was cheaper (per example only)."""
        if self._units is not None:
            return self._plain_norm_sq(self._unit_uses(uses))[0], None
        return self._plain_norm_sq(uses)

    @staticmethod
    def _plain_norm_sq(uses: list[Use]) -> tuple[torch.Tensor, torch.Tensor | None]:
        dtype = _acc_dtype(*[u.right for u in uses])
        if use_ghost_norm(uses):
            total = None
            for i, u in enumerate(uses):
                ru = u.right.to(dtype)
                for v in uses[i:]:
                    rv = v.right.to(dtype)
                    term = (_left_gram(u, v, dtype) * torch.bmm(ru, rv.transpose(1, 2))).sum((1, 2))
                    term = term if v is u else 2 * term
                    total = term if total is None else total + term
            return total, None
        g = sum(_instantiate(u, dtype) for u in uses)
        return g.pow(2).sum((1, 2)), g

    def _add_clipped(self, name: str, uses: list[Use], c: torch.Tensor, inst: torch.Tensor | None) -> None:
        p = self.params[name]
        if inst is not None:
            s = torch.einsum("b,blr->lr", c.to(inst.dtype), inst)
        else:
            dtype = _acc_dtype(*[u.right for u in uses])
            s = _clipped_sum(uses[0], c, dtype)  # a fresh tensor (matmul / index_add_ / sum): safe to add into
            for u in uses[1:]:  # e.g. a tied embedding and LM head: the shared parameter's gradient is their sum
                s.add_(_clipped_sum(u, c, dtype))
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
        out: dict[str, torch.Tensor] = {}
        self._instantiated: dict[str, torch.Tensor] = {}
        for name, uses in self._uses_by_param().items():
            out[name], inst = self._norm_sq_of(uses)
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
        for name, uses in self._uses_by_param().items():
            c = self.unit_factors(factors[name] if isinstance(factors, dict) else factors)
            self._add_clipped(name, uses, c, inst.get(name))
        self._instantiated = {}

    # ------------------------------------------------------------------ clipping fused into back-propagation
    def set_fused_groups(self, groups: list[list[str]] | None, handler: GroupHandler | None) -> None:
        """Clip group by group *during* the backward pass (He et al. 2023, §3.1).

        With groups set, as soon as every captured use of every parameter of a group has received its output
        gradient, the engine computes the group's per-example squared norms, asks ``handler(k, norms_sq)`` for the
        ``(B,)`` clipping factors of group ``k``, adds the clipped sums, and frees that group's activations and
        output gradients. Nothing waits for the end of the backward pass except groups whose parameters are shared
        with a layer whose gradient arrives later (tied embeddings: the cross term needs both). ``None`` turns it off.
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
        for n, uses in stored.items():
            norms[n], insts[n] = self._norm_sq_of(uses)
        factors = self.unit_factors(self._handler(k, norms))
        for n, uses in stored.items():
            self._add_clipped(n, uses, factors, insts[n])

    def finish_fused(self) -> None:
        """After the backward pass: process the groups not completed during it (some use got no gradient)."""
        if self._groups is None:
            return
        for k in sorted({self._group_of[n] for n in self._uses}):
            self._process_group(k)
        self._pending = {}

    def pop_summed_grads(self) -> dict[str, torch.Tensor]:
        """The clipped sums accumulated since the last call (zeros for untouched parameters); resets them."""
        out = {}
        for name, p in self.params.items():
            s = self.summed_grads.get(name)
            out[name] = torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32)) if s is None else s
        self.summed_grads = {}
        return out
