"""The norm paths chosen for speed (``engine.use_ghost_norm``, ``fused=True``) stay exact against the oracle."""

from __future__ import annotations

import pytest
import torch
from helpers import check_update, lm_dataset, run_group_step, tiny_gpt2

import hf_dp.clipping.norms as engine_mod  # the norm maths (clipping/norms.py)
from hf_dp.clipping.sums import ClippedSums


@pytest.mark.parametrize("ratio", [10**9, 0], ids=["ghost", "instantiate"])
def test_per_layer_both_norm_paths_match_oracle(tmp_path, monkeypatch, ratio):
    """Per-layer clipping with every dense layer ghost-normed (ratio huge) or instantiated inside the backward pass
    (ratio 0: the tiny layers pass the memory cap) equals the float64 per-example oracle."""
    monkeypatch.setattr(engine_mod, "_GHOST_TIME_RATIO", ratio)
    torch.manual_seed(0)
    trainer, _ = run_group_step(tiny_gpt2(), lm_dataset(6), tmp_path, "per_layer", thresholds="median")
    paths = trainer.clipping_engine.norm_paths
    dense = "transformer.h.0.mlp.c_fc.weight"
    assert paths[dense] == ("instantiate" if ratio == 0 else "ghost")
    assert paths["transformer.wte.weight"] == "ghost"  # tied (two uses): the memory rule, never fused-instantiated


def test_fused_rule_caps_memory():
    """A dense layer whose per-example gradient is much larger than its stored factors is never instantiated, even
    where instantiation would be faster."""
    from hf_dp.clipping.layers import Use

    w = torch.nn.Parameter(torch.zeros(1))
    wide = Use(w, torch.zeros(1, 512, 4096), torch.zeros(1, 512, 4096), 4096, "wide")
    # time: T²(d_L + d_R) = 512² · 8192 ≥ 100 · 4096² (instantiation faster); memory: 4096² > 2 · 512 · 8192
    assert engine_mod.use_ghost_norm([wide], fused=True)
    w2 = torch.nn.Parameter(torch.zeros(1))
    fits = Use(w2, torch.zeros(1, 256, 512), torch.zeros(1, 256, 512), 512, "fits")  # 512² ≤ 2 · 256 · 1024
    assert not engine_mod.use_ghost_norm([fits], fused=True)  # T²(2·512) ≥ 100·512²: instantiated
    assert engine_mod.use_ghost_norm([fits])  # flat without fusion: the memory rule (2T² < d_L d_R)


@pytest.mark.parametrize("ratio", [10**9, 0], ids=["ghost", "instantiate"])
def test_flat_norms_at_arrival_match_oracle(tmp_path, monkeypatch, ratio):
    """Flat clipping computes each layer's norms as its gradient arrives (engine.set_fused_groups with no handler),
    keeping the factors (ghost) or the per-example gradients in their place (ratio 0: every dense layer whose
    instantiation is no larger than its factors); both equal the float64 oracle, over three accumulated chunks."""

    monkeypatch.setattr(engine_mod, "_GHOST_TIME_RATIO", ratio)
    torch.manual_seed(0)
    model = tiny_gpt2()
    seen = []
    orig = ClippedSums.process_group

    def spy(self, k):
        seen.append(self)
        return orig(self, k)

    monkeypatch.setattr(ClippedSums, "process_group", spy)
    check_update(model, lm_dataset(6), tmp_path, per_device=2, ga=3)
    assert seen and all(e._handler is None for e in seen)  # the flat step went through the norms-at-arrival path
    path = seen[-1].norm_paths["transformer.h.0.attn.c_proj.weight"]  # 16 × 16: 256 ≤ T (16 + 16)
    assert path == ("instantiate" if ratio == 0 else "ghost")


def test_flat_shared_input_gram_reused_and_exact(tmp_path, monkeypatch):
    """BERT's query, key and value read one input: flat clipping computes its Gram once (engine._self_gram cache)
    and the update still equals the float64 oracle."""
    from helpers import cls_dataset, tiny_bert

    calls = {"hit": 0, "miss": 0}
    orig = engine_mod._self_gram

    def spy(x, dtype, cache):
        if cache is not None:
            key = (x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, x._version, dtype)
            calls["hit" if key in cache else "miss"] += 1
        return orig(x, dtype, cache)

    monkeypatch.setattr(engine_mod, "_self_gram", spy)
    torch.manual_seed(1)
    check_update(tiny_bert(num_labels=3), cls_dataset(6, num_labels=3), tmp_path, per_device=3, ga=2)
    assert calls["hit"] > 0
