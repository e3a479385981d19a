"""The one place where Gaussian noise is added (DESIGN invariant 5).

``privatize`` turns the clipped per-example gradient sums of one logical step into the gradient handed to the
optimizer: ``(Σ_i clip(g_i) + N(0, σ² S² I)) / (q N)`` with ``S`` the L2 sensitivity of the summed release (``C`` for
flat clipping) and ``q N`` the *expected* batch size (the realised size is itself private). Under several processes
the sums are all-reduced and the noise is drawn on rank 0 only, before the reduction, so the total noise is added
exactly once whatever the world size, and every rank ends with the same gradient.

Under FSDP (``clipping/fsdp.py``) the gradient is sharded: :func:`add_noise_to_shards` adds each rank's noise to the
coordinates it owns only, from a per-rank stream (:meth:`NoiseGenerator.for_shard`), so again every coordinate is
noised exactly once.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable

import torch
import torch.distributed as dist

from .sampling import derive_seed

__all__ = ["privatize", "add_noise_to_shards", "NoiseGenerator", "group_noise_stds", "NOISE_ALLOCATIONS"]

NOISE_ALLOCATIONS = ("global", "equal_budget", "weighted")

_NOISE_STREAM = 0x6E6F697365  # separates the noise stream from the sampler's stream under one dp_seed


class NoiseGenerator:
    """Per-step Gaussian generators derived from one seed (a secret one unless ``seed`` is given).

    Deriving the step's generator from ``(seed, step)`` keeps a run with a fixed seed reproducible across
    checkpoint/resume; with the default secret seed every run draws fresh noise.
    """

    def __init__(self, seed: int | None = None):
        self.is_secret = seed is None
        self.seed = secrets.randbits(63) if seed is None else int(seed)

    def for_step(self, step: int, device: torch.device) -> torch.Generator:
        gen = torch.Generator(device=device)
        gen.manual_seed(derive_seed(self.seed, _NOISE_STREAM, step))
        return gen

    def for_shard(self, step: int, rank: int, device: torch.device, stream: int = 0) -> torch.Generator:
        """The step's generator for the coordinates ``rank`` owns under FSDP (``clipping/fsdp.py``).

        Each rank noises only its own shard, so every rank needs an independent stream: derived from
        ``(seed, step, rank, stream)``, never equal to :meth:`for_step`'s.
        """
        gen = torch.Generator(device=device)
        gen.manual_seed(derive_seed(self.seed, _NOISE_STREAM, step, rank, stream))
        return gen


def group_noise_stds(thresholds: list[float], dims: list[int], allocation: str, noise_multiplier: float
                     ) -> tuple[list[float], float]:
    """Noise std per group for group-wise clipping (He et al. 2023, §3.3, App. E; Alg. 1 line 13).

    The release ``(g̃_k / γ_k)_k`` has L2 sensitivity ``S = (Σ_k C_k² / γ_k²)^½``; the Gaussian mechanism adds
    ``N(0, σ² S²)`` to it, i.e. ``z_k ~ N(0, σ² S² γ_k²)`` to ``g̃_k``. Strategies:
    ``global`` (γ_k = 1, ``S = ‖C‖``), ``equal_budget`` (γ_k = C_k, ``S = √K``; a group's noise needs only its own
    threshold — per-device clipping), ``weighted`` (γ_k = C_k / √d_k, ``S = (Σ d_k)^½``).

    Returns:
        ``([σ S γ_k]_k, S)``.
    """
    if allocation == "global":
        gammas = [1.0] * len(thresholds)
    elif allocation == "equal_budget":
        gammas = list(thresholds)
    elif allocation == "weighted":
        gammas = [c / math.sqrt(d) for c, d in zip(thresholds, dims)]
    else:
        raise ValueError(f"noise_allocation must be one of {NOISE_ALLOCATIONS}, got {allocation!r}.")
    sensitivity = math.sqrt(sum((c / g) ** 2 for c, g in zip(thresholds, gammas)))
    return [noise_multiplier * sensitivity * g for g in gammas], sensitivity


def _is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@torch.no_grad()
def privatize(
    summed: dict[str, torch.Tensor],
    noise_std: float | dict[str, float],
    expected_batch_size: float,
    generator: torch.Generator | None,
) -> dict[str, torch.Tensor]:
    """Add Gaussian noise once to the summed clipped gradients and divide by the expected batch size.

    Args:
        summed: this rank's ``{name: Σ_i clip(g_i)}``.
        noise_std: standard deviation ``σ S`` of the noise on the global sum (one value, or one per parameter for
            group-wise allocations).
        expected_batch_size: ``q N`` over all ranks.
        generator: the step's generator (used on rank 0 only).

    Returns:
        ``{name: gradient}``, identical on every rank. Without several processes these are the tensors of
        ``summed``, modified in place (the caller hands them over).
    """
    names = list(summed)
    grads = {n: summed[n] if summed[n].is_contiguous() else summed[n].contiguous() for n in names}
    rank0 = not _is_distributed() or dist.get_rank() == 0
    with torch.no_grad():
        if rank0:
            stds = [noise_std] * len(names) if not isinstance(noise_std, dict) else [noise_std[n] for n in names]
            for n, std in zip(names, stds):
                if std > 0:  # in place, one parameter at a time: no model-sized temporaries (benchmarks/RESULTS.md)
                    g = grads[n]
                    g.add_(torch.randn(g.shape, generator=generator, device=g.device, dtype=g.dtype), alpha=float(std))
        if not _is_distributed():
            for g in grads.values():
                g.div_(expected_batch_size)
            return grads
        flat = torch.cat([grads[n].reshape(-1) for n in names])  # one collective for the whole step
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat.div_(expected_batch_size)
    out, offset = {}, 0
    for n in names:
        k = grads[n].numel()
        out[n] = flat[offset:offset + k].view_as(grads[n])
        offset += k
    return out


@torch.no_grad()
def add_noise_to_shards(shards: list[torch.Tensor], std: float,
                        generator_for: Callable[[torch.device, int], torch.Generator]) -> None:
    """Add ``N(0, std²)`` in place to each of this rank's gradient shards (FSDP: disjoint across ranks).

    ``std`` is the std on the *divided* gradient, ``σ S / (q N)``. ``generator_for(device, k)`` gives this rank's
    generator for the ``k``-th device met (one stream per device, :meth:`NoiseGenerator.for_shard`). Noise is drawn in
    at least float32 and added in that precision; shards are visited in the given order (name order).
    """
    gens: dict[torch.device, torch.Generator] = {}
    for local in shards:
        if local.numel() == 0:
            continue
        if local.device not in gens:
            gens[local.device] = generator_for(local.device, len(gens))
        dtype = torch.promote_types(local.dtype, torch.float32)
        z = torch.randn(local.shape, generator=gens[local.device], device=local.device, dtype=dtype)
        if dtype == local.dtype:
            local.add_(z, alpha=std)
        else:
            local.copy_((local.to(dtype) + z * std).to(local.dtype))
