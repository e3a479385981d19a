"""DESIGN invariants 4 and 5, statistically: Poisson batches are Binomial(N, q); noise has std σC/(qN)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from helpers import lm_dataset, tiny_gpt2

from hf_dp import DPTrainer, DPTrainingArguments, NotPrivateWarning, PoissonBatchSampler, ShuffledBatchSampler


def step_batches(sampler) -> list[list[int]]:
    """Group a sampler's chunks back into logical steps."""
    chunks = list(sampler)
    k = sampler.num_chunks
    return [sum(chunks[i:i + k], []) for i in range(0, len(chunks), k)]


def test_poisson_batch_sizes_are_binomial():
    n, q, steps = 200, 0.1, 3000
    sampler = PoissonBatchSampler(n, q, steps_per_epoch=steps, num_chunks=3, seed=123)
    assert len(sampler) == steps * 3
    batches = step_batches(sampler)
    sizes = np.array([len(b) for b in batches])
    mean, var = n * q, n * q * (1 - q)
    # 6 standard errors: the mean's SE is sqrt(var/steps), the variance's about var*sqrt(2/steps).
    assert abs(sizes.mean() - mean) < 6 * np.sqrt(var / steps)
    assert abs(sizes.var(ddof=1) - var) < 6 * var * np.sqrt(2 / steps)
    # Each example's inclusion count is Binomial(steps, q): nobody is favoured.
    counts = np.bincount(np.concatenate([np.array(b, dtype=int) for b in batches]), minlength=n)
    sd = np.sqrt(steps * q * (1 - q))
    assert np.abs(counts - steps * q).max() < 6 * sd
    # No example twice in one batch.
    assert all(len(set(b)) == len(b) for b in batches)


def test_poisson_epochs_and_seeds_give_fresh_batches():
    s = PoissonBatchSampler(100, 0.2, steps_per_epoch=5, seed=1)
    first = list(s)
    assert list(s) == first  # same epoch, same stream (resume can skip into it)
    s.set_epoch(1)
    assert list(s) != first
    assert list(PoissonBatchSampler(100, 0.2, steps_per_epoch=5, seed=2)) != first


def test_poisson_shards_across_ranks():
    n, q, world = 101, 0.3, 2
    ranks = [PoissonBatchSampler(n, q, steps_per_epoch=400, seed=7, rank=r, world_size=world) for r in range(world)]
    assert set(ranks[0].shard).isdisjoint(ranks[1].shard)
    assert sorted(np.concatenate([r.shard for r in ranks])) == list(range(n))
    per_rank = [step_batches(r) for r in ranks]
    for r, batches in enumerate(per_rank):
        assert all(i % world == r for b in batches for i in b)
    # Each example still included with probability q overall.
    total = np.array([len(a) + len(b) for a, b in zip(*per_rank)])
    assert abs(total.mean() - n * q) < 6 * np.sqrt(n * q * (1 - q) / 400)


def test_shuffled_sampler_is_a_partition_per_epoch():
    s = ShuffledBatchSampler(50, batch_size=8, num_chunks=2, seed=0)
    batches = step_batches(s)
    assert len(batches) == 7
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(50))


def test_invalid_sample_rate():
    with pytest.raises(ValueError):
        PoissonBatchSampler(10, 1.5, steps_per_epoch=1)
    with pytest.raises(ValueError):
        PoissonBatchSampler(10, 0.0, steps_per_epoch=1)


def _one_step_update(tmp_path, sigma: float, seed: int, max_norm: float = 0.5):
    torch.manual_seed(0)
    model = tiny_gpt2().double()
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        args = DPTrainingArguments(
            output_dir=str(tmp_path), noise_multiplier=sigma, per_sample_max_grad_norm=max_norm,
            per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=1, learning_rate=1.0,
            optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, use_cpu=True, report_to="none",
            save_strategy="no", dp_seed=seed, disable_tqdm=True,
        )
    trainer = DPTrainer(model=model, args=args, train_dataset=lm_dataset(32))
    trainer.train()
    update = torch.cat([(before[k] - p.detach()).reshape(-1) for k, p in model.named_parameters()])
    return update, trainer


def test_noise_std_matches_sigma_c_over_expected_batch(tmp_path):
    sigma, c = 1.7, 0.5
    clean, _ = _one_step_update(tmp_path / "a", 0.0, seed=5, max_norm=c)
    noisy, trainer = _one_step_update(tmp_path / "b", sigma, seed=5, max_norm=c)
    noise = (noisy - clean).numpy()
    expected_std = sigma * c / trainer.expected_batch_size  # q N = expected batch = 8
    d = noise.size
    assert d > 5000
    # The sample std of d i.i.d. Gaussians has relative SE ~ 1/sqrt(2d) (< 1% here): 5% tolerance is > 5 SE.
    assert abs(noise.std() / expected_std - 1) < 0.05
    assert abs(noise.mean()) < 6 * expected_std / np.sqrt(d)
    # Gaussian shape: excess kurtosis ~ 0 (SE sqrt(24/d) ~ 0.06).
    z = (noise - noise.mean()) / noise.std()
    assert abs((z**4).mean() - 3) < 0.4
    assert trainer.accountant.steps == 1


def test_noise_is_fresh_without_a_seed(tmp_path):
    a, _ = _one_step_update(tmp_path / "a", 1.0, seed=None)
    b, _ = _one_step_update(tmp_path / "b", 1.0, seed=None)
    assert not torch.allclose(a, b)


def test_empty_batches_are_noise_only_steps(tmp_path):
    """q = 1/40 over 40 examples: about a third of steps are empty, and each is still a (noise-only) step."""
    torch.manual_seed(0)
    model = tiny_gpt2()
    data = lm_dataset(40)
    args = DPTrainingArguments(
        output_dir=str(tmp_path), noise_multiplier=1.0, per_sample_max_grad_norm=1.0, per_device_train_batch_size=1,
        gradient_accumulation_steps=1, max_steps=12, learning_rate=0.1, optim="sgd", use_cpu=True, report_to="none",
        save_strategy="no", dp_seed=0, disable_tqdm=True,
    )
    trainer = DPTrainer(model=model, args=args, train_dataset=data)
    sizes = [len(b) for b in step_batches(trainer.get_train_dataloader().batch_sampler)][:12]
    assert 0 in sizes
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    trainer.train()
    assert trainer.accountant.steps == 12
    assert all(not torch.equal(before[k], p) for k, p in model.named_parameters())


# ------------------------------------------------------------------------------------------ secure mode (hole 13)
def _opacus_secure_reference(shape, std, seed):
    """Opacus 1.6 ``_generate_noise(secure_mode=True)`` written out: one draw discarded, then (z1+z2+z3+z4)/2."""
    g = torch.Generator().manual_seed(seed)
    torch.normal(mean=0, std=std, size=(1, 1), generator=g)
    total = torch.zeros(shape)
    for _ in range(4):
        total += torch.normal(mean=0, std=std, size=shape, generator=g)
    return total / 2


def test_secure_noise_is_opacus_combination_with_the_right_std():
    from hf_dp.noise import SecureGenerator, gaussian_noise

    gen = SecureGenerator()
    gen.manual_seed(1234)
    z = gaussian_noise((200_000,), 1.5, gen, torch.device("cpu"), torch.float32)
    assert torch.equal(z, _opacus_secure_reference((200_000,), 1.5, 1234))
    # sample std of 2e5 Gaussians: relative SE 1/sqrt(4e5) ~ 0.16 %; 1 % is > 6 SE. Kurtosis SE sqrt(24/2e5) ~ 0.011.
    assert abs(float(z.std()) / 1.5 - 1) < 0.01 and abs(float(z.mean())) < 6 * 1.5 / np.sqrt(2e5)
    u = (z / z.std()).double()
    assert abs(float((u**4).mean()) - 3) < 0.08


def test_secure_mode_draws_fresh_entropy_every_step_and_shard():
    from hf_dp.noise import NoiseGenerator, SecureGenerator

    cpu = torch.device("cpu")
    plain = NoiseGenerator(seed=5)
    same = [torch.randn(8, generator=plain.for_step(0, cpu)) for _ in range(2)]
    assert torch.equal(*same)
    secure = NoiseGenerator(seed=5, secure_mode=True)
    gens = [secure.for_step(0, cpu), secure.for_step(0, cpu), secure.for_shard(0, 0, cpu), secure.for_shard(0, 0, cpu)]
    assert all(isinstance(g, SecureGenerator) for g in gens)
    draws = [torch.randn(8, generator=g) for g in gens]
    assert all(not torch.equal(a, b) for i, a in enumerate(draws) for b in draws[i + 1:])


def test_secure_mode_fsdp_shards_use_the_combination(monkeypatch):
    import hf_dp.noise as noise

    calls = []
    real = noise.gaussian_noise
    monkeypatch.setattr(noise, "gaussian_noise", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    secure = noise.NoiseGenerator(secure_mode=True)
    shards = [torch.zeros(60_000), torch.zeros(0), torch.zeros(40_000, dtype=torch.float64)]
    noise.add_noise_to_shards(shards, 0.3, lambda device, k: secure.for_shard(3, 1, device, k))
    assert len(calls) == 2 and all(isinstance(g, noise.SecureGenerator) for g in calls)
    z = torch.cat([shards[0].double(), shards[2]])
    assert abs(float(z.std()) / 0.3 - 1) < 0.02  # relative SE 1/sqrt(2e5) ~ 0.22 %


def test_secure_mode_refuses_a_dp_seed(tmp_path):
    with pytest.raises(ValueError, match="secure_mode=True .* cannot be combined with dp_seed=3"):
        DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, secure_mode=True, dp_seed=3, use_cpu=True)


def _q1_update(tmp_path, sigma, seed, secure, max_norm=0.5):
    """One SGD step (lr 1) with q = 1 (every example in the batch), so runs differ only by their noise."""
    torch.manual_seed(0)
    model = tiny_gpt2().double()
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        args = DPTrainingArguments(
            output_dir=str(tmp_path), noise_multiplier=sigma, per_sample_max_grad_norm=max_norm,
            per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=1, learning_rate=1.0,
            optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, use_cpu=True, report_to="none",
            save_strategy="no", dp_seed=seed, secure_mode=secure, disable_tqdm=True, dp_self_check=False,
        )
    trainer = DPTrainer(model=model, args=args, train_dataset=lm_dataset(8))
    trainer.train()
    return torch.cat([(before[k] - p.detach()).reshape(-1) for k, p in model.named_parameters()]), trainer


def test_secure_mode_in_training_has_the_right_std_and_is_fresh(tmp_path, monkeypatch):
    import hf_dp.noise as noise

    gens = []
    real = noise.gaussian_noise
    monkeypatch.setattr(noise, "gaussian_noise", lambda *a, **k: gens.append(a[2]) or real(*a, **k))
    sigma, c = 1.7, 0.5
    clean, _ = _q1_update(tmp_path / "clean", 0.0, seed=5, secure=False, max_norm=c)
    assert gens == []
    a, trainer = _q1_update(tmp_path / "a", sigma, seed=None, secure=True, max_norm=c)
    assert gens and all(isinstance(g, noise.SecureGenerator) for g in gens)  # every parameter's noise, secure
    assert trainer._noise.secure_mode and trainer.args.secure_mode
    from hf_dp.cards import privacy_metadata

    assert privacy_metadata(trainer.privacy_record())["noise_source"].startswith("secure mode")
    assert trainer._dp_state()["secure_mode"]
    b, _ = _q1_update(tmp_path / "b", sigma, seed=None, secure=True, max_norm=c)
    za, zb = (a - clean).numpy(), (b - clean).numpy()
    expected = sigma * c / trainer.expected_batch_size
    assert za.size > 5000 and trainer.sample_rate == 1.0
    for z in (za, zb):
        assert abs(z.std() / expected - 1) < 0.05
    assert not np.allclose(za, zb)  # fresh noise per run
