"""Per-layer clipping's reused instantiation buffer (``engine._scratch_for``): shared by the layers of one backward
pass, freed after it, never used for instantiations that are kept (flat). Exactness against the float64 oracle is in
test_perf_paths.py (per-layer and flat, both paths)."""

from __future__ import annotations

import torch
from helpers import tiny_gpt2

import hf_dp.clipping.norms as engine_mod  # the norm maths (clipping/norms.py)
from hf_dp.clipping.engine import ClippingEngine
from hf_dp.clipping.modes import build_groups


def _record(engine: ClippingEngine, model, b: int = 3) -> None:
    ids = torch.randint(0, 61, (b, 8), generator=torch.Generator().manual_seed(0))
    with engine.record(b):
        model(input_ids=ids, labels=ids).loss.backward()


def test_per_layer_buffer_shared_and_freed(monkeypatch):
    monkeypatch.setattr(engine_mod, "_GHOST_TIME_RATIO", 0)  # every single-use dense layer instantiated
    torch.manual_seed(0)
    model = tiny_gpt2()
    engine = ClippingEngine(model)
    groups = [g.params for g in build_groups(engine, "per_layer")]
    seen = []
    orig = engine_mod._scratch_for

    def spy(u, dtype, scratch):
        out = orig(u, dtype, scratch)
        if out is not None:
            seen.append(out.untyped_storage().data_ptr())
        return out

    monkeypatch.setattr(engine_mod, "_scratch_for", spy)
    engine.set_fused_groups(groups, lambda k, norms: torch.ones(3))
    _record(engine, model)
    assert len(seen) >= 8 and len(set(seen)) < len(seen)  # one buffer for many layers (grown at most a few times)
    assert engine._scratch  # alive until the backward pass is over
    engine.finish_fused()
    assert engine._scratch == {}  # freed: no buffer carried into the optimizer step and the next forward


def test_flat_kept_instantiations_get_their_own_memory(monkeypatch):
    monkeypatch.setattr(engine_mod, "_GHOST_TIME_RATIO", 0)
    torch.manual_seed(0)
    model = tiny_gpt2()
    engine = ClippingEngine(model)
    groups = [g.params for g in build_groups(engine, "per_layer")]
    engine.set_fused_groups(groups, None)  # flat: norms at arrival, instantiations kept for the clipped sums
    _record(engine, model)
    engine.per_example_norms_sq()
    kept = engine._instantiated
    assert len(kept) >= 2
    ptrs = [g.untyped_storage().data_ptr() for g in kept.values()]
    assert len(set(ptrs)) == len(ptrs)
    assert engine._scratch == {}
