"""DP-AdamBC (Tang, Shpilevskiy, Lécuyer, AAAI 2024, Alg. 1; issue 25 item 2): ``dp_adam_bias_correction=True``.

The reference is Alg. 1 written here in numpy (float64) from the paper: m, v the moving averages of the released
gradient, m̂, v̂ their bias-corrected values, θ ← θ − η m̂ / √max(v̂ − Φ, γ′), Φ = (σ·C/(q·N))² per coordinate (the
group's std with group-wise noise), decoupled weight decay first. With Φ = 0 the optimizer is torch's AdamW, exactly.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import adam_args, cls_dataset, tiny_bert
from transformers import TrainerCallback

from hf_dp import DPAdamBC, DPTrainer
from hf_dp.optim import bias_corrected_adam

BETAS = (0.9, 0.999)


def reference_alg1(theta0: np.ndarray, grads: list[np.ndarray], lr: float, phi: float, gamma: float, wd: float = 0.0,
                   decoupled: bool = True, betas=BETAS) -> np.ndarray:
    """Tang et al. 2024, Alg. 1 (DP-AdamBC), one parameter tensor, numpy float64."""
    b1, b2 = betas
    theta = theta0.astype(np.float64).copy()
    m = np.zeros_like(theta)
    v = np.zeros_like(theta)
    for t, g in enumerate(grads, start=1):
        if wd and decoupled:
            theta = theta * (1 - lr * wd)
        elif wd:
            g = g + wd * theta
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat = m / (1 - b1**t)
        v_hat = v / (1 - b2**t)
        theta = theta - lr * m_hat / np.sqrt(np.maximum(v_hat - phi, gamma))
    return theta


def known_grads(shape, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """Gradients with coordinates of very different sizes, so that v̂ − Φ is below the floor for some and not others."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-3, 0, math.prod(shape), dtype=torch.float64).reshape(shape)
    return [torch.randn(shape, generator=g, dtype=torch.float64) * scale for _ in range(steps)]


def run(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        optimizer.step()


def test_zero_noise_is_torch_adamw_exactly():
    """Φ = 0: bit for bit torch.optim.AdamW over 5 steps, two parameter groups (weight decay on one)."""
    torch.manual_seed(0)
    a = [torch.randn(4, 3, dtype=torch.float64), torch.randn(5, dtype=torch.float64)]
    b = [t.clone() for t in a]
    grads = [[g[0], g[1]] for g in zip(known_grads((4, 3), 5, 1), known_grads((5,), 5, 2))]
    groups = lambda ps: [{"params": [ps[0]], "weight_decay": 0.1}, {"params": [ps[1]], "weight_decay": 0.0}]  # noqa: E731
    ours = DPAdamBC(groups(a), lr=0.01, noise_std=0.0, gamma=1e-3)
    plain = torch.optim.AdamW(groups(b), lr=0.01)
    run(ours, a, grads)
    run(plain, b, grads)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    for p, q in zip(a, b):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ours.state[p][key], plain.state[q][key])


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_matches_the_papers_algorithm(wd):
    """σ > 0: four steps of Alg. 1 against the numpy reference; the floor γ′ is active for some coordinates."""
    theta0 = torch.randn(6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grads = known_grads((6, 5), 4)
    std, gamma, lr = 0.05, 1e-6, 0.01
    p = theta0.clone()
    opt = DPAdamBC([p], lr=lr, weight_decay=wd, noise_std=std, gamma=gamma)
    run(opt, [p], [[g] for g in grads])
    expected = reference_alg1(theta0.numpy(), [g.numpy() for g in grads], lr, std**2, gamma, wd)
    np.testing.assert_allclose(p.numpy(), expected, rtol=1e-12, atol=1e-14)
    v_hat = opt.state[p]["exp_avg_sq"] / (1 - BETAS[1] ** 4)
    assert bool((v_hat - std**2 < gamma).any()) and bool((v_hat - std**2 > gamma).any())  # both branches ran
    # not the uncorrected update
    adam = reference_alg1(theta0.numpy(), [g.numpy() for g in grads], lr, 0.0, gamma, wd)
    assert not np.allclose(p.numpy(), adam)


def test_noise_std_per_parameter_and_torch_adam_with_coupled_decay():
    """A mapping {id(param): std} (group-wise noise); a torch.optim.Adam(weight_decay) keeps Adam's coupled decay,
    and is Adam exactly at Φ = 0."""
    theta0 = [torch.randn(3, 4, dtype=torch.float64), torch.randn(7, dtype=torch.float64)]
    grads = list(zip(known_grads((3, 4), 3, 4), known_grads((7,), 3, 5)))
    params = [t.clone() for t in theta0]
    stds = {id(params[0]): 0.02, id(params[1]): 0.3}
    opt = bias_corrected_adam(torch.optim.Adam(params, lr=0.05, weight_decay=0.2), stds, 1e-5)
    assert isinstance(opt, DPAdamBC)
    run(opt, params, [list(g) for g in grads])
    for k, (t0, std) in enumerate(zip(theta0, (0.02, 0.3))):
        expected = reference_alg1(t0.numpy(), [g[k].numpy() for g in grads], 0.05, std**2, 1e-5, 0.2, decoupled=False)
        np.testing.assert_allclose(params[k].numpy(), expected, rtol=1e-12, atol=1e-14)
    a, b = [t.clone() for t in theta0], [t.clone() for t in theta0]
    run(bias_corrected_adam(torch.optim.Adam(a, lr=0.05, weight_decay=0.2), 0.0, 1e-5), a, [list(g) for g in grads])
    run(torch.optim.Adam(b, lr=0.05, weight_decay=0.2), b, [list(g) for g in grads])
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(ValueError, match="no DP noise std is known"):
        run(DPAdamBC([params[0]], noise_std={id(params[1]): 0.1}), [params[0]], [[grads[0][0]]])


# ---------------------------------------------------------------------- in the trainer
class _Released(TrainerCallback):
    """Keeps the released gradient of every step (what the optimizer receives)."""

    def __init__(self):
        self.grads: list[dict[str, torch.Tensor]] = []
        self.model = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def train_with_released(tmp_path, **kw):
    torch.manual_seed(0)
    model = tiny_bert(num_labels=2).double()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    released = _Released()
    trainer = DPTrainer(model=model, args=adam_args(tmp_path, **kw), train_dataset=cls_dataset(16, num_labels=2),
                        callbacks=[released])
    trainer.train()
    return trainer, before, released.grads


def decays(trainer) -> dict[str, float]:
    """The Trainer's weight-decay groups (biases and LayerNorm weights undecayed)."""
    names = set(trainer.get_decay_parameter_names(trainer.model))
    return {n: trainer.args.weight_decay if n in names else 0.0 for n, _ in trainer.model.named_parameters()}


def test_trainer_flat_noise_matches_alg1_on_the_released_gradients(tmp_path):
    """σ = 1, flat clipping: the trained parameters are Alg. 1 applied to the released gradients with
    Φ = (σ·C / (q·N))² = (1 · 0.5 / 4)², written out here."""
    trainer, before, grads = train_with_released(tmp_path)
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert isinstance(opt, DPAdamBC) and len(grads) == 3
    phi = (1.0 * 0.5 / 4) ** 2
    wd = decays(trainer)
    for n, p in trainer.model.named_parameters():
        expected = reference_alg1(before[n].numpy(), [g[n].numpy() for g in grads], 0.01, phi, 1e-7, wd[n])
        np.testing.assert_allclose(p.detach().numpy(), expected, rtol=1e-10, atol=1e-12, err_msg=n)


def test_trainer_group_noise_uses_each_groups_std(tmp_path):
    """Per-layer clipping with equal_budget noise: group k's noise std on the sum is σ·√K·C_k (He et al. 2023
    App. E), so Φ_k = (σ·√K·C_k / (q·N))² per coordinate of that group's parameters."""
    trainer, before, grads = train_with_released(tmp_path, clipping="per_layer", noise_allocation="equal_budget",
                                                 max_steps=2)
    groups = trainer.group_clipper.groups
    k = len(groups)
    thresholds = trainer.group_clipper.thresholds.tolist()
    wd = decays(trainer)
    for group, c_k in zip(groups, thresholds):
        phi = (1.0 * math.sqrt(k) * c_k / 4) ** 2
        for n in group.params:
            p = dict(trainer.model.named_parameters())[n]
            expected = reference_alg1(before[n].numpy(), [g[n].numpy() for g in grads], 0.01, phi, 1e-7, wd[n])
            np.testing.assert_allclose(p.detach().numpy(), expected, rtol=1e-10, atol=1e-12, err_msg=n)


def test_trainer_without_noise_is_plain_adamw(tmp_path):
    """σ = 0: the same run with and without the correction ends with identical parameters."""
    out = []
    for bc in (True, False):
        trainer, _, _ = train_with_released(tmp_path / str(bc), noise_multiplier=0.0, dp_adam_bias_correction=bc)
        out.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    assert all(torch.equal(out[0][n], out[1][n]) for n in out[0])


def test_users_adamw_is_converted_and_other_optimizers_refused(tmp_path):
    torch.manual_seed(0)
    data = cls_dataset(16, num_labels=2)
    model = tiny_bert(num_labels=2)
    user = torch.optim.AdamW(model.parameters(), lr=0.01)
    trainer = DPTrainer(model=model, args=adam_args(tmp_path, max_steps=1), train_dataset=data,
                        optimizers=(user, None))
    trainer.train()
    assert isinstance(trainer.optimizer.optimizer, DPAdamBC)
    ours = trainer.optimizer.optimizer.param_groups
    assert [(g["lr"], g["weight_decay"], g["params"]) for g in ours] == [
        (0.01, 0.01, g["params"]) for g in user.param_groups]  # the user's groups, lr and weight decay

    # A DPAdamBC the user built, with the user's own scheduler: kept, and its noise std wired to the run's.
    own = DPAdamBC(model.parameters(), lr=0.01, noise_std=123.0)
    sched = torch.optim.lr_scheduler.LambdaLR(own, lambda s: 0.5)
    trainer = DPTrainer(model=model, args=adam_args(tmp_path, max_steps=1), train_dataset=data,
                        optimizers=(own, sched))
    trainer.train()
    assert trainer.optimizer.optimizer is own and own.param_groups[0]["lr"] == 0.005
    assert own.noise_std() == pytest.approx(1.0 * 0.5 / 4)  # σ·C/(q·N), no longer the 123 it was built with

    with pytest.raises(ValueError, match="optim=.sgd. is not one of"):
        DPTrainer(model=tiny_bert(num_labels=2), args=adam_args(tmp_path, optim="sgd"), train_dataset=data)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="needs an Adam-family optimizer.*got SGD"):
        DPTrainer(model=model, args=adam_args(tmp_path), train_dataset=data, optimizers=(sgd, None))
    user = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(user, lambda s: 1.0)
    with pytest.raises(ValueError, match="scheduler you passed with it is bound to your optimizer"):
        DPTrainer(model=model, args=adam_args(tmp_path), train_dataset=data, optimizers=(user, sched))
    with pytest.raises(ValueError, match="max_grad_norm"):
        adam_args(tmp_path, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="no amsgrad=True variant"):
        DPAdamBC(model.parameters(), amsgrad=True)
