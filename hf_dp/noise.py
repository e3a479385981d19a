"""The one place where Gaussian noise is added (DESIGN invariant 5).

``privatize`` turns the clipped per-example gradient sums of one logical step into the gradient handed to the
optimizer: ``(Σ_i clip(g_i) + N(0, σ² S² I)) / (q N)`` with ``S`` the L2 sensitivity of the summed release (``C`` for
flat clipping) and ``q N`` the *expected* batch size (the realised size is itself private). Under several processes
the sums are all-reduced and the noise is drawn on rank 0 only, before the reduction, so the total noise is added
exactly once whatever the world size, and every rank ends with the same gradient.

Under FSDP (``clipping/fsdp.py``) the gradient is sharded: :func:`add_noise_to_shards` adds each rank's noise to the
coordinates it owns only, from a per-rank stream (:meth:`NoiseGenerator.for_shard`), so again every coordinate is
noised exactly once.

Secure mode (``DPTrainingArguments(secure_mode=True)``, the counterpart of Opacus' ``secure_mode``) changes where the
noise comes from, on both paths (:class:`SecureGenerator`, :func:`gaussian_noise`).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable

import torch
import torch.distributed as dist

from .sampling import derive_seed

__all__ = ["privatize", "add_noise_to_shards", "gaussian_noise", "NoiseGenerator", "SecureGenerator",
           "group_noise_stds", "NOISE_ALLOCATIONS"]

NOISE_ALLOCATIONS = ("global", "equal_budget", "weighted")

_NOISE_STREAM = 0x6E6F697365  # separates the noise stream from the sampler's stream under one dp_seed


class SecureGenerator(torch.Generator):
    """A step's generator in secure mode: seeded from fresh OS entropy, and read by :func:`gaussian_noise` with the
    floating-point-attack mitigation (the type is the marker; no attribute is set on a plain ``torch.Generator``)."""

    secure_mode = True


class NoiseGenerator:
    """Per-step Gaussian generators derived from one seed (a secret one unless ``seed`` is given).

    Default: deriving the step's generator from ``(seed, step)`` keeps a run with a fixed seed reproducible across
    checkpoint/resume; with the default secret seed (63 bits from :mod:`secrets`) every run draws fresh noise.

    ``secure_mode=True`` (Opacus' ``secure_mode``, without ``torchcsprng``):

    * **Fresh OS entropy per step**: every step's (and, under FSDP, every shard's) generator is seeded with 64 fresh
      bits from :func:`secrets.randbits` (the OS CSPRNG, ``os.urandom``) and the seed is never stored. The default
      mode's risk is the run seed: whoever learns it (a memory dump, a debugger, a log or pickle of the trainer)
      can regenerate every step's noise and subtract it from the released updates. In secure mode a leaked step
      seed exposes that step only, and nothing on disk or in the trainer can regenerate the noise.
    * **Floating-point attack mitigation**: a float sample of ``N(0, σ²)`` is not a real Gaussian; the set of
      floats a sampler can output around each value leaks which value was noised (Mironov 2012 for the Laplace
      mechanism; Jin et al. 2022, arXiv:2112.05307, for Gaussian samplers such as PyTorch's). :func:`gaussian_noise`
      returns ``(z_1 + z_2 + z_3 + z_4) / 2`` with ``z_j ~ N(0, σ²)`` after discarding one draw, exactly as Opacus'
      ``_generate_noise`` (``opacus/optimizers/optimizer.py``): the 2n-sample combination of Holohan & Braghin 2021
      (arXiv:2107.10138, §5.1) with n = 2, raising the attack's cost from about 2^53 to 2^159 guesses.

    Threat model: an adversary who sees the released parameters (and possibly each update, e.g. from checkpoints)
    and may know the code, but cannot read the training process's memory while it runs. Not covered: the
    generator itself is torch's (Mersenne Twister on CPU, Philox on CUDA), not a cryptographic stream; timing side
    channels; the Poisson sampler, which keeps its per-run secret seed (``seed``, shared by the ranks). Cost: four
    Gaussian draws instead of one per coordinate (plus the sums), on the noise step only (``benchmarks/RESULTS.md``).
    """

    def __init__(self, seed: int | None = None, secure_mode: bool = False):
        # In secure mode ``seed`` (the run's shared secret) only seeds the Poisson sampler (``self.seed``), never noise.
        self.secure_mode = bool(secure_mode)
        self.is_secret = seed is None
        self.seed = secrets.randbits(63) if seed is None else int(seed)

    def _generator(self, device: torch.device, *key: int) -> torch.Generator:
        if self.secure_mode:
            gen = SecureGenerator(device=device)
            gen.manual_seed(secrets.randbits(64))  # fresh OS entropy, never stored
            return gen
        gen = torch.Generator(device=device)
        gen.manual_seed(derive_seed(self.seed, _NOISE_STREAM, *key))
        return gen

    def for_step(self, step: int, device: torch.device) -> torch.Generator:
        return self._generator(device, step)

    def for_shard(self, step: int, rank: int, device: torch.device, stream: int = 0) -> torch.Generator:
        """The step's generator for the coordinates ``rank`` owns under FSDP (``clipping/fsdp.py``).

        Each rank noises only its own shard, so every rank needs an independent stream: derived from
        ``(seed, step, rank, stream)``, never equal to :meth:`for_step`'s (in secure mode: fresh OS entropy).
        """
        return self._generator(device, step, rank, stream)


@torch.no_grad()
def gaussian_noise(shape: torch.Size | tuple[int, ...], std: float, generator: torch.Generator | None,
                   device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``N(0, std²)`` samples of ``shape`` in ``dtype``, from ``generator``.

    With a :class:`SecureGenerator` (secure mode) the sample is Opacus' floating-point-attack-resistant one: one draw
    discarded, then ``(z_1 + z_2 + z_3 + z_4) / 2`` with ``z_j ~ N(0, std²)`` drawn in at least float32 (Holohan &
    Braghin 2021, §5.1, n = 2); its variance is ``4 std² / 4 = std²``.
    """
    if not isinstance(generator, SecureGenerator):
        return torch.randn(shape, generator=generator, device=device, dtype=dtype).mul_(std)
    draw_dtype = torch.promote_types(dtype, torch.float32)
    torch.normal(0.0, std, size=(1, 1), generator=generator, device=device, dtype=draw_dtype)  # discarded (Opacus)
    total = torch.zeros(shape, device=device, dtype=draw_dtype)
    for _ in range(4):
        total.add_(torch.normal(0.0, std, size=tuple(shape), generator=generator, device=device, dtype=draw_dtype))
    return total.div_(2).to(dtype)


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
        generator: the step's generator (used on rank 0 only; a :class:`SecureGenerator` in secure mode).

    Returns:
        ``{name: gradient}``, identical on every rank. Without several processes: new tensors (the noise, with the
        divided sum added into it), or for a noise-free coordinate set the tensor of ``summed`` divided in place.
    """
    names = list(summed)
    grads = {n: summed[n] if summed[n].is_contiguous() else summed[n].contiguous() for n in names}
    rank0 = not _is_distributed() or dist.get_rank() == 0
    if not _is_distributed() and not isinstance(generator, SecureGenerator):
        # One process: draw N(0, (std/B)²) straight from the generator (``normal_`` scales inside the sampling kernel:
        # the same draw as ``randn`` times std/B) and add the sum divided by B in the same pass — one pass over each
        # gradient instead of three (add the noise, divide; benchmarks/RESULTS.md).
        stds = [noise_std] * len(names) if not isinstance(noise_std, dict) else [noise_std[n] for n in names]
        out = {}
        for n, std in zip(names, stds):
            g = grads[n]
            if std > 0:
                z = torch.empty_like(g).normal_(0.0, float(std) / expected_batch_size, generator=generator)
                out[n] = z.add_(g, alpha=1.0 / expected_batch_size)
            else:
                out[n] = g.div_(expected_batch_size)
        return out
    with torch.no_grad():
        if rank0:
            stds = [noise_std] * len(names) if not isinstance(noise_std, dict) else [noise_std[n] for n in names]
            for n, std in zip(names, stds):
                if std > 0:  # in place, one parameter at a time: no model-sized temporaries (benchmarks/RESULTS.md)
                    g = grads[n]
                    if isinstance(generator, SecureGenerator):  # secure mode: the 4-draw combination
                        g.add_(gaussian_noise(g.shape, float(std), generator, g.device, g.dtype))
                    else:
                        g.add_(torch.randn(g.shape, generator=generator, device=g.device, dtype=g.dtype),
                               alpha=float(std))
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
    at least float32 and added in that precision; shards are visited in the given order (name order). In secure mode
    (:class:`SecureGenerator`, fresh entropy per rank and step) each shard's noise is :func:`gaussian_noise`'s.
    """
    gens: dict[torch.device, torch.Generator] = {}
    for local in shards:
        if local.numel() == 0:
            continue
        if local.device not in gens:
            gens[local.device] = generator_for(local.device, len(gens))
        dtype = torch.promote_types(local.dtype, torch.float32)
        gen = gens[local.device]
        if isinstance(gen, SecureGenerator):  # secure mode: the 4-draw combination, unit std (scaled below)
            z = gaussian_noise(local.shape, 1.0, gen, local.device, dtype)
        else:
            z = torch.randn(local.shape, generator=gen, device=local.device, dtype=dtype)
        if dtype == local.dtype:
            local.add_(z, alpha=std)
        else:
            local.copy_((local.to(dtype) + z * std).to(local.dtype))
