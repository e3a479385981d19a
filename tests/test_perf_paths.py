"""The norm paths chosen for speed (``engine.use_ghost_norm``, ``fused=True``) stay exact against the oracle."""

from __future__ import annotations

import pytest
import torch
from helpers import lm_dataset, tiny_gpt2
from test_groupwise import run_group_step

import hf_dp.clipping.engine as engine_mod


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
    """A dense layer whose per-example gradient is much larger than its stored factors is never instantiated."""
    from hf_dp.clipping.layers import Use

    w = torch.nn.Parameter(torch.zeros(512, 512))
    small_t = Use(w, torch.zeros(2, 4, 512), torch.zeros(2, 4, 512), 512, "big")  # 512² > 2·4·1024
    assert engine_mod.use_ghost_norm([small_t], fused=True)
    long_t = Use(w, torch.zeros(2, 256, 512), torch.zeros(2, 256, 512), 512, "big")  # T²(2·512) ≥ 64·512²
    assert not engine_mod.use_ghost_norm([long_t], fused=True)
    assert engine_mod.use_ghost_norm([long_t])  # flat: the memory rule (2T² < d_L d_R)
