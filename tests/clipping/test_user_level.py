"""User-level DP: Poisson sampling of users, each user's whole contribution clipped as one unit (oracle-tested)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import AUTHORS, per_example_grads, tiny_gpt2, user_args, user_data

from hf_dp import DPTrainer, DPTrainingArguments, group_privacy
from hf_dp.sampling import PoissonUserSampler


def user_oracle(grads, owners, contribution: str, max_norm: float):
    total = {n: torch.zeros_like(t) for n, t in grads[0].items()}
    for user in sorted(set(owners)):
        mine = [g for g, o in zip(grads, owners) if o == user]
        w = 1.0 / len(mine) if contribution == "mean" else 1.0
        g_u = {n: w * sum(g[n] for g in mine) for n in total}
        norm = math.sqrt(sum(float(t.pow(2).sum()) for t in g_u.values()))
        c = min(1.0, max_norm / (norm + 1e-6))
        for n in total:
            total[n] += c * g_u[n]
    return total


@pytest.mark.parametrize("contribution, cap", [("mean", None), ("sum", None), ("mean", 2)])
def test_user_level_update_matches_oracle(tmp_path, contribution, cap):
    torch.manual_seed(0)
    data = user_data()
    model = tiny_gpt2().double()
    users = np.unique(AUTHORS, return_inverse=True)[1]
    # 5 users, 3 expected per step: q = 0.6. Recreate the trainer's draw to know who was sampled.
    sampler = PoissonUserSampler(users, 0.6, steps_per_epoch=2, num_chunks=1, seed=5, max_examples_per_user=cap)
    indices = next(iter(sampler))
    owners = [AUTHORS[i] for i in indices]
    assert cap is None or max(owners.count(u) for u in set(owners)) <= cap
    grads = per_example_grads(model, data, indices)
    norms = sorted(math.sqrt(sum(float(t.pow(2).sum()) for t in g.values())) for g in grads)
    max_norm = norms[len(norms) // 2] / 2  # some users clipped
    expected = user_oracle(grads, owners, contribution, max_norm)

    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    trainer = DPTrainer(model=model, args=user_args(tmp_path, user_contribution=contribution,
                                                    max_examples_per_user=cap, per_sample_max_grad_norm=max_norm),
                        train_dataset=data)
    assert trainer.num_examples_private == 5 and trainer.sample_rate == pytest.approx(0.6)
    trainer.train()
    for k, p in model.named_parameters():
        torch.testing.assert_close(before[k] - p.detach(), expected[k] / 3, rtol=1e-7, atol=1e-10, msg=k)


def test_user_sampler_keeps_users_whole_and_is_poisson():
    rng = np.random.default_rng(0)
    users = rng.integers(0, 50, size=400)
    users = np.unique(users, return_inverse=True)[1]
    u = users.max() + 1
    q, steps = 0.2, 1500
    sampler = PoissonUserSampler(users, q, steps_per_epoch=steps, num_chunks=3, seed=1, max_examples_per_user=4)
    chunks = list(sampler)
    counts = []
    for s in range(steps):
        step = chunks[3 * s:3 * s + 3]
        owners = [set(users[c]) for c in step]
        assert all(a.isdisjoint(b) for i, a in enumerate(owners) for b in owners[i + 1:])  # never split
        flat = np.concatenate([np.array(c, dtype=int) for c in step])
        sampled = set(users[flat])
        counts.append(len(sampled))
        for user in sampled:
            mine = flat[users[flat] == user]
            assert len(mine) == min(4, int((users == user).sum()))
    counts = np.array(counts)
    assert abs(counts.mean() - u * q) < 6 * math.sqrt(u * q * (1 - q) / steps)
    assert abs(counts.var(ddof=1) - u * q * (1 - q)) < 6 * u * q * (1 - q) * math.sqrt(2 / steps)


def test_user_level_accounting_uses_user_sampling_rate(tmp_path):
    torch.manual_seed(1)
    args = user_args(tmp_path, noise_multiplier=1.0, max_steps=2, per_device_train_batch_size=2)
    trainer = DPTrainer(model=tiny_gpt2(), args=args, train_dataset=user_data())
    trainer.train()
    assert trainer.sample_rate == pytest.approx(2 / 5)
    assert trainer.target_delta == pytest.approx(1 / 5**1.1)
    assert trainer.accountant.history[0].sample_rate == pytest.approx(2 / 5)


def test_user_level_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="user_id_column"):
        DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=1.0, privacy_unit="user", use_cpu=True)
    with pytest.raises(ValueError, match="no column"):
        DPTrainer(model=tiny_gpt2(), args=user_args(tmp_path, user_id_column="writer"), train_dataset=user_data())


def test_group_privacy_report_is_the_standard_bound():
    eps, delta = group_privacy(0.5, 1e-6, 3)
    assert eps == pytest.approx(1.5) and delta == pytest.approx(3 * math.exp(1.0) * 1e-6)
