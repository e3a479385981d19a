"""Regrouping of per-row uses: padding-free packed rows split into per-example blocks, examples grouped by privacy
unit (user-level DP). Both are exact tensor algebra on the factors of ``G_i = L_iᵀ R_i`` (``rules/``): the blocks and
units are index maps built once per micro-batch, applied to every recorded use."""

from __future__ import annotations

import torch

from .rules import UnsupportedLayerError, Use

__all__ = ["Segments", "Units"]


def _slots(ids: torch.Tensor, minlength: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per entry of ``ids`` (group ids ``0..K-1``): its position inside its group, in order; and each group's size."""
    counts = torch.bincount(ids, minlength=minlength)
    order = torch.argsort(ids, stable=True)  # members of a group keep their order
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(ids)
    slot[order] = torch.arange(len(ids), device=ids.device) - starts[ids[order]]
    return slot, counts


class Segments:
    """Padding-free packed rows: ``segments`` ``(B, T)`` gives the example ``0..S-1`` each token belongs to (``-1``
    for padding). :meth:`split_use` turns one use of the ``B`` rows into per-example uses over ``S`` examples.

    ``num``: the number of examples ``S`` of the whole micro-batch when ``segments`` is a window of its positions
    (:meth:`window`), where an example may have no token."""

    def __init__(self, segments: torch.Tensor, num: int | None = None):
        flat = segments.reshape(-1)
        tokens = (flat >= 0).nonzero().flatten()
        example = flat[tokens]
        slot, counts = _slots(example, num or 0)
        if num is None and bool((counts == 0).any()):
            raise ValueError("segments must number the examples of a micro-batch 0..S-1 without gaps.")
        self.segments = segments
        #: ``((rows, length), tokens, example, slot, number of examples, longest example)``
        self.layout = (tuple(segments.shape), tokens, example, slot, len(counts),
                       int(counts.max()) if counts.numel() else 0)
        self._windows: dict[tuple[int, int], Segments] = {}

    def window(self, start: int, stop: int) -> Segments:
        """The same examples over positions ``start:stop`` of the rows only (a call that sees those positions: the
        LM head on one chunk of the sequence); an example without a token there gets an empty block."""
        key = (start, stop)
        if key not in self._windows:
            self._windows[key] = Segments(self.segments[:, start:stop], num=self.layout[4])
        return self._windows[key]

    def to_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, k·T, ...)`` packed rows → ``(S, k·T_max, ...)``: each example's positions, in order, zero-padded.

        ``k > 1`` when a layer sees several positions per token, token-major (e.g. a norm over the heads of
        ``(B, T, H, d)``, viewed as ``(B, T·H, d)``).
        """
        (rows, length), tokens, example, slot, num, longest = self.layout
        k = x.shape[1] // length
        per_token = x.reshape(rows * length, k, *x.shape[2:])
        out = x.new_zeros(num, longest, k, *x.shape[2:])
        out[example, slot] = per_token[tokens]
        return out.reshape(num, longest * k, *x.shape[2:])

    def split_use(self, u: Use) -> Use:
        """One use of packed rows as per-example uses: ``G_i = Σ_{t∈i} L_tᵀ R_t = L_iᵀ R_i`` over example ``i``'s
        tokens only (the padded positions have ``R = 0``, so they add nothing to norms or sums)."""
        rows, length = self.layout[0]
        positions = {tuple(u.right.shape[:2])} | ({tuple(u.left.shape[:2])} if u.left is not None else set())
        if len(positions) != 1 or u.right.shape[0] != rows or u.right.shape[1] % length:
            raise UnsupportedLayerError(
                f"{u.module_name} sees {tuple(u.right.shape[:2])} (rows, positions) in packed rows of "
                f"{(rows, length)} tokens: its positions are not the packed tokens (e.g. virtual tokens of prompt or "
                "prefix tuning, shared by all examples of the row), so its gradient cannot be split per packed "
                "example. Train without packing (packing=False, padding_free=False)."
            )
        left = None if u.left is None else self.to_blocks(u.left)
        return Use(u.param, left, self.to_blocks(u.right), u.left_dim, u.module_name)


class Units:
    """Privacy units (user-level DP): ``units`` ``(B,)`` the unit ``0..U-1`` of each example, ``weights`` ``(B,)``
    its weight ``w_i`` (1 for a user's sum, ``1/n_u`` for their mean). A unit's gradient is ``G_u = Σ_{i∈u} w_i G_i``;
    its uses are its examples' tokens concatenated (ghost norms then include the cross terms between its examples)."""

    def __init__(self, units: torch.Tensor, weights: torch.Tensor | None = None):
        self.units = units
        self.weights = weights
        self.slot, counts = _slots(units)
        self.count = len(counts)
        self.capacity = int(counts.max())

    def to_units(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, ...)`` per example → ``(U, n_max·T, ...)`` per unit: its examples concatenated, zero-padded."""
        out = x.new_zeros(self.count, self.capacity, *x.shape[1:])
        out[self.units, self.slot] = x
        return out.reshape(self.count, self.capacity * x.shape[1], *x.shape[2:])

    def regroup(self, uses: list[Use]) -> list[Use]:
        """The uses of a parameter regrouped by privacy unit: ``G_u = Σ_{i∈u} w_i L_iᵀ R_i = L_uᵀ R_u``."""
        out = []
        for u in uses:
            right = u.right if self.weights is None else u.right * self.weights.to(u.right.dtype).view(-1, 1, 1)
            left = None if u.left is None else self.to_units(u.left)
            out.append(Use(u.param, left, self.to_units(right), u.left_dim, u.module_name))
        return out

    def example_factors(self, unit_factors: torch.Tensor) -> torch.Tensor:
        """Per-unit clipping factors → per-example factors ``c_{u(i)} w_i`` for the clipped sum."""
        c = unit_factors[self.units]
        return c if self.weights is None else c * self.weights.to(c.dtype)
