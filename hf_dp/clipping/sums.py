"""The clipped sums of a model's parameters from the uses a :class:`~hf_dp.clipping.recorder.Recorder` recorded:
per-example (or per-unit) norms, ``Σ_i c_i G_i`` into :attr:`ClippedSums.summed_grads`, either after the backward pass
(flat clipping: every norm is needed before any factor) or group by group during it (the fused per-layer schedule,
He et al. 2023, §3.1: a group is clipped as soon as every use of its parameters has its output gradient).

The end-of-backward path and the fused schedule share every piece of state (the stored uses, kept instantiations,
norms computed at arrival, the sums), so they are one class; the maths is in :mod:`~hf_dp.clipping.norms`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .norms import as_ones, clipped_sum_of, norm_sq, use_ghost_norm
from .regroup import Units
from .rules import Use

__all__ = ["ClippedSums", "GroupHandler"]

GroupHandler = Callable[[int, dict[str, torch.Tensor]], torch.Tensor]


class ClippedSums:
    """Stored uses → norms and clipped sums, for the trainable parameters ``params`` (by name; ``names``: parameter
    id → name, the recorder's key)."""

    def __init__(self, params: dict[str, nn.Parameter], names: dict[int, str]):
        self.params = params
        self.names = names
        self.summed_grads: dict[str, torch.Tensor] = {}
        #: {parameter name: "ghost" | "instantiate"}, how its last per-example norms were computed
        #: (use_ghost_norm; read by benchmarks/run.py)
        self.norm_paths: dict[str, str] = {}
        self.units: Units | None = None
        self._groups: list[list[str]] | None = None
        self._handler: GroupHandler | None = None
        self._group_of: dict[str, int] = {}
        #: flat two-pass clipping's pass 1 (``clipping/two_pass.py``): norms at arrival, every factor dropped once its
        #: group's norms are computed (the clipped sum comes from a second backward, not from the factors)
        self.norms_only = False
        self.clear()

    def clear(self) -> None:
        """Drop the stored factors of the last micro-batch."""
        self._uses: dict[str, list[Use]] = {}
        self._pending: dict[str, int] = {}
        self._early_norms: dict[str, torch.Tensor] = {}
        self._kept: dict[str, list[Use]] = {}
        self._instantiated: dict[str, torch.Tensor] = {}
        self._gram_cache: dict = {}
        self._scratch: dict = {}

    @property
    def scratch(self) -> dict:
        """Per-layer clipping's reused instantiation buffer (``norms._scratch_for``), by dtype; empty between
        backward passes."""
        return self._scratch

    @property
    def instantiated(self) -> dict[str, torch.Tensor]:
        """The per-example gradients kept for :meth:`accumulate_clipped` (instead of their factors), by name."""
        return self._instantiated

    def recorded_uses(self) -> dict[str, list[Use]]:
        """``{parameter name: its uses}`` recorded in this micro-batch and not yet clipped (benchmarks/floor.py)."""
        return self._uses

    # ------------------------------------------------------------------ from the recorder
    def expect(self, names: list[str]) -> None:
        """A hooked call of these parameters is on the graph: their groups wait for its gradient (fused mode)."""
        if self._groups is not None:
            for n in names:
                self._pending[n] = self._pending.get(n, 0) + 1

    def store(self, name: str, use: Use) -> None:
        """Store one use of parameter ``name`` as it is (``fsdp.py``: no groups, names by attribute)."""
        self._uses.setdefault(name, []).append(use)

    def add_uses(self, uses: list[Use]) -> None:
        """Store one hooked call's uses (from the gradient hooks); clip the groups they complete (fused mode)."""
        touched = set()
        for u in uses:
            name_u = self.names[id(u.param)]
            existing = self._uses.setdefault(name_u, [])
            existing.append(u)
            if len({(v.left_dim, v.right.shape[-1]) for v in existing}) > 1:
                self._uses[name_u] = [as_ones(v) for v in existing]  # e.g. a fallback use and a rule's use
            self._pending[name_u] = self._pending.get(name_u, 0) - 1
            touched.add(name_u)
        if self._groups is not None:
            for k in sorted({self._group_of[n] for n in touched}):
                if self.group_ready(k):
                    self.process_group(k)

    # ------------------------------------------------------------------ norms and sums
    def unit_factors(self, unit_factors: torch.Tensor) -> torch.Tensor:
        """Per-unit clipping factors → per-example factors ``c_{u(i)} w_i`` for the clipped sum."""
        return unit_factors if self.units is None else self.units.example_factors(unit_factors)

    def norm_sq_of(self, name: str, uses: list[Use], grams: dict | None = None, fused: bool = False,
                   memory_ratio: float = 2, scratch: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(B,)`` squared per-example (or ``(U,)`` per-unit) norms of one parameter's gradient, and its
        instantiation if that was cheaper (per example only). ``grams``: a cache shared by the parameters of one
        norm pass (``norms._self_gram``); ``fused``: clipped right away (:func:`~.norms.use_ghost_norm`)."""
        if self.units is not None:
            uses = self.units.regroup(uses)
            self.norm_paths[name] = "ghost" if use_ghost_norm(uses) else "instantiate"
            return norm_sq(uses)[0], None
        ghost = use_ghost_norm(uses, fused, memory_ratio)
        self.norm_paths[name] = "ghost" if ghost else "instantiate"
        return norm_sq(uses, grams, ghost, scratch)

    def add_clipped(self, name: str, uses: list[Use], c: torch.Tensor, inst: torch.Tensor | None,
                    zeroed: bool = True) -> None:
        """Add ``Σ_i c_i G_{i,name}`` into :attr:`summed_grads` (:func:`~hf_dp.clipping.norms.clipped_sum_of`)."""
        s = clipped_sum_of(uses, c, inst, zeroed).reshape(self.params[name].shape)
        if name in self.summed_grads:
            self.summed_grads[name] += s
        else:
            self.summed_grads[name] = s

    @torch.no_grad()
    def per_example_norms_sq(self) -> dict[str, torch.Tensor]:
        """``{param name: (B,) squared per-example gradient norms}`` for every parameter that got a gradient."""
        if self._groups is not None and self._handler is None:  # norms computed at arrival (set_fused_groups)
            for k in sorted({self._group_of[n] for n in self._uses}):  # groups some use of which got no gradient
                self.process_group(k)
            self._pending = {}
            self._gram_cache = {}
            out, self._early_norms = self._early_norms, {}
            self._uses, self._kept = self._kept, {}
            return out
        out: dict[str, torch.Tensor] = {}
        self._instantiated = {}
        grams: dict = {}  # every factor stays alive during this loop (self._uses), so the cache's keys stay valid
        for name, uses in self._uses.items():
            out[name], inst = self.norm_sq_of(name, uses, grams)
            if inst is not None:
                self._instantiated[name] = inst
        return out

    @torch.no_grad()
    def accumulate_clipped(self, factors: dict[str, torch.Tensor] | torch.Tensor) -> None:
        """Add ``Σ_i c_i G_{i,p}`` into :attr:`summed_grads` for every parameter ``p`` (one ``(B,)`` vector for all,
        or ``{param name: (B,)}``; per unit ``(U,)`` with units)."""
        inst = self._instantiated
        shared = None if isinstance(factors, dict) else self.unit_factors(factors)
        zeroed = None if shared is None else bool((shared == 0).any())  # one check for all parameters
        for name, uses in self._uses.items():
            c = shared if shared is not None else self.unit_factors(factors[name])
            z = zeroed if zeroed is not None else bool((c == 0).any())
            self.add_clipped(name, uses, c, inst.get(name), z)
        self._instantiated = {}

    # ------------------------------------------------------------------ clipping fused into back-propagation
    def set_fused_groups(self, groups: list[list[str]] | None, handler: GroupHandler | None) -> None:
        """Clip group by group *during* the backward pass (:meth:`ClippingEngine.set_fused_groups`)."""
        self._groups = groups
        self._handler = handler
        self._group_of = {n: k for k, names in enumerate(groups or []) for n in names}

    @property
    def fused_groups(self) -> tuple[list[list[str]] | None, GroupHandler | None]:
        """``(groups, handler)`` as last given to :meth:`set_fused_groups`."""
        return self._groups, self._handler

    def group_ready(self, k: int) -> bool:
        return all(self._pending.get(n, 0) == 0 for n in self._groups[k])

    @torch.no_grad()
    def process_group(self, k: int) -> None:
        stored = {n: self._uses.pop(n) for n in self._groups[k] if n in self._uses}
        if not stored:
            return
        norms, insts = {}, {}
        # A group with one dense parameter (a layer: weight and bias) may instantiate it (use_ghost_norm, fused): it
        # lives only until the group is clipped. Larger groups (group_wise, per_device) keep the memory rule, since
        # all their instantiations would be alive together.
        fused = sum(len(u) == 1 and u[0].kind == "dense" for u in stored.values()) <= 1
        deferred = self._handler is None
        keep = deferred and not self.norms_only  # flat book-keeping keeps what the clipped sum needs
        grams = self._gram_cache if deferred else None  # flat: factors stay alive anyway (q/k/v share an input)
        # Clipped right away (not deferred) with one dense parameter, or norms only: its instantiation, if any, is
        # dropped below before the next group's, so all groups share one buffer (norms._scratch_for). Kept
        # instantiations (flat book-keeping) get their own.
        scratch = self._scratch if fused and not keep else None
        for n, uses in stored.items():
            norms[n], insts[n] = self.norm_sq_of(n, uses, grams, fused=fused, memory_ratio=1 if keep else 2,
                                                 scratch=scratch)
        if deferred and not keep:  # flat two-pass clipping, pass 1: the norms only; the factors go now
            self._early_norms.update(norms)
            return
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
            self.add_clipped(n, uses, factors, insts[n], zeroed)

    def finish_fused(self) -> None:
        """After the backward pass: process the groups not completed during it (some use got no gradient)."""
        if self._groups is None:
            return
        for k in sorted({self._group_of[n] for n in self._uses}):
            self.process_group(k)
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
