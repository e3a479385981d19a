"""Each layer rule and each norm path (ghost / instantiated, shared parameters) against a per-example loop."""

from __future__ import annotations

import pytest
import torch
from helpers import Seq, check_engine
from torch import nn
from transformers.pytorch_utils import Conv1D

from hf_dp import ClippingEngine, UnsupportedLayerError


def test_linear_on_sequences_both_norm_paths():
    torch.manual_seed(0)
    # Short sequences, wide layer -> ghost; long sequences, narrow layer -> instantiation.
    check_engine(Seq(nn.Linear(6, 40), nn.Tanh(), nn.Linear(40, 3)), torch.randn(5, 2, 6))
    check_engine(Seq(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 2, bias=False)), torch.randn(5, 9, 3))


def test_linear_without_token_axis_and_with_two():
    torch.manual_seed(1)
    check_engine(Seq(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2)), torch.randn(6, 4))
    check_engine(Seq(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2)), torch.randn(3, 2, 3, 4))


def test_hf_conv1d():
    torch.manual_seed(2)
    check_engine(Seq(Conv1D(7, 4), nn.GELU(), Conv1D(2, 7)), torch.randn(4, 5, 4))


class EmbedModel(nn.Module):
    def __init__(self, padding_idx=None, tied=False):
        super().__init__()
        self.emb = nn.Embedding(11, 4, padding_idx=padding_idx)
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 11, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.norm(self.proj(self.emb(ids)))))


def test_embedding_with_padding_idx_gets_no_gradient_on_that_row():
    torch.manual_seed(3)
    ids = torch.randint(0, 11, (6, 7))
    ids[:, ::3] = 1  # padding tokens *inside* the sequence: they do receive output gradients
    check_engine(EmbedModel(padding_idx=1), ids)


def test_tied_embedding_and_head_cross_terms():
    torch.manual_seed(4)
    ids = torch.randint(0, 11, (5, 6))
    model = EmbedModel(tied=True)
    assert sum(1 for _ in model.parameters()) == 5
    check_engine(model, ids)


def test_module_called_twice_sums_its_uses():
    torch.manual_seed(5)
    shared = nn.Linear(4, 4)
    check_engine(Seq(shared, nn.Tanh(), shared), torch.randn(4, 3, 4))


def test_layer_norm_variants_and_rms_norm():
    torch.manual_seed(6)
    check_engine(Seq(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 2)), torch.randn(4, 3, 4))
    check_engine(Seq(nn.Linear(4, 6), nn.LayerNorm(6, bias=False), nn.Linear(6, 2)), torch.randn(4, 3, 4))
    multi = Seq(nn.Linear(4, 6), nn.Unflatten(-1, (2, 3)), nn.LayerNorm((2, 3)), nn.Flatten(-2), nn.Linear(6, 2))
    check_engine(multi, torch.randn(4, 3, 4))
    rms = nn.RMSNorm(6, eps=1e-6)
    with torch.no_grad():
        rms.weight.uniform_(0.5, 1.5)
    check_engine(Seq(nn.Linear(4, 6), rms, nn.Linear(6, 2)), torch.randn(4, 3, 4))


def test_partially_frozen_model_only_reports_trainable():
    torch.manual_seed(7)
    model = Seq(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    model.mods[0].requires_grad_(False)
    model.mods[2].bias.requires_grad_(False)
    engine = check_engine(model, torch.randn(4, 3, 4))
    assert list(engine.params) == ["mods.2.weight"]


def test_unsupported_layers_fail_loudly():
    with pytest.raises(UnsupportedLayerError, match=r"mods.0 \(BatchNorm2d\)"):  # (Conv2d: generic fallback)
        ClippingEngine(Seq(nn.BatchNorm2d(1)))
    with pytest.raises(UnsupportedLayerError, match="scale_grad_by_freq"):
        ClippingEngine(Seq(nn.Embedding(5, 2, scale_grad_by_freq=True)))


class NotAnRMSNorm(nn.Module):
    """Name says RMSNorm, computes something else: must be refused on first use."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return torch.tanh(self.weight * x)


NotAnRMSNorm.__name__ = "FancyRMSNorm"


def test_rms_norm_lookalike_is_refused_on_first_use():
    model = Seq(nn.Linear(3, 3), NotAnRMSNorm(3))
    engine = ClippingEngine(model)
    with pytest.raises(UnsupportedLayerError, match="does not compute"), engine.record(2):
        model(torch.randn(2, 4, 3)).sum().backward()


def test_broadcast_input_is_detected():
    class Broadcast(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.prompt = nn.Linear(1, 3, bias=False)

        def forward(self, x):
            prompt = self.prompt(torch.ones(1, 1, 1))  # computed once, broadcast over the batch
            return self.lin(x) + prompt

    model = Broadcast()
    engine = ClippingEngine(model)
    with pytest.raises(UnsupportedLayerError, match="broadcast"), engine.record(4):
        model(torch.randn(4, 2, 3)).sum().backward()


def _run_losses(model, x):
    return lambda sl: model(x[sl]).pow(2).sum((1, 2))


def test_self_check_catches_parameter_used_outside_its_layer():
    class DirectUse(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return self.lin(x) + torch.nn.functional.linear(x, self.lin.weight)  # second use, not via the module

    model = DirectUse().double()
    engine = ClippingEngine(model)
    x = torch.randn(4, 2, 3, dtype=torch.float64)
    with pytest.raises(UnsupportedLayerError, match="lin.weight"):
        engine.self_check(_run_losses(model, x), 4)
    assert all(p.grad is None for p in model.parameters())


def test_self_check_catches_unbatched_lookup_that_matches_the_batch_size():
    """T5-style relative bias: ids of shape (T, T) with no batch axis. With T == B the shapes look per-example."""

    class RelativeBias(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.bias = nn.Embedding(7, 3)

        def forward(self, x):
            t = x.shape[1]
            rel = (torch.arange(t)[None, :] - torch.arange(t)[:, None]).clamp(0, 6)  # (T, T), no batch axis
            return self.lin(x) + self.bias(rel)  # broadcast over the batch

    model = RelativeBias().double()
    engine = ClippingEngine(model)
    x = torch.randn(4, 4, 3, dtype=torch.float64)  # B == T == 4
    with pytest.raises(UnsupportedLayerError, match="mixes examples|broadcast"):
        engine.self_check(_run_losses(model, x), 4)


def test_self_check_passes_on_a_supported_model():
    torch.manual_seed(0)
    model = EmbedModel(tied=True).double()
    ids = torch.randint(0, 11, (4, 5))
    engine = ClippingEngine(model)
    engine.self_check(lambda sl: model(ids[sl]).pow(2).sum((1, 2)), 4)
    assert all(p.grad is None for p in model.parameters()) and all(p.requires_grad for p in model.parameters())


def test_recorded_graph_is_freed_after_the_step():
    """Regression: a hook closure that referred to its own output tensor kept every micro-batch's graph alive."""
    import gc
    import weakref

    model = Seq(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    engine = ClippingEngine(model)
    with engine.record(3):
        hidden = model.mods[0](torch.randn(3, 5, 4))
        out = model.mods[2](model.mods[1](hidden))
        out.pow(2).sum().backward()
    engine.per_example_norms_sq()
    engine.clear()
    refs = [weakref.ref(hidden), weakref.ref(out)]
    del hidden, out
    gc.collect()
    assert all(r() is None for r in refs)
