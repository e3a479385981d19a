"""benchmarks/utility_mpnet.py (issue 25, session 13: all-mpnet-base-v2 on Austen): the parts that can be wrong without
a run, on a tiny random-init MPNet (no download) — the top 2 layers on cached states (with MPNet's relative position
bias recomputed for the collated batch) are the full model's pooled output, and the cache's check refuses a top model
that is not; LoRA sits on MPNet's ``q`` / ``v`` through ``utility.make_model``'s hook; each DP run is paired with its
own non-private counterpart. hf_dp's DP step on MPNet is exact against a per-example loop in tests/clipping/test_zoo.py
(its ``mpnet`` entry, flat and per-layer), not repeated here."""

from __future__ import annotations

import pytest
import torch
from helpers import load_example
from transformers import MPNetConfig, MPNetModel


@pytest.fixture(scope="module")
def bench():
    return load_example("utility_mpnet.py", "hf_dp_benchmark_utility_mpnet", folder="benchmarks")


@pytest.fixture(scope="module")
def tiny():
    """A tiny MPNet (3 layers: 1 cached, the top 2 trained), a wide random position-bias table (so a wrong bias
    shows), and passages of 3-40 tokens (relative distances past 8 take MPNet's logarithmic buckets)."""
    torch.manual_seed(0)
    config = MPNetConfig(vocab_size=40, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                         intermediate_size=24, max_position_embeddings=70, pad_token_id=1, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0)
    model = MPNetModel(config, add_pooling_layer=False).eval()
    with torch.no_grad():
        model.encoder.relative_attention_bias.weight.normal_(0.0, 1.0)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, 40, (n,), generator=g).tolist() for n in (3, 40, 9, 17, 40, 5, 26, 12)]
    return model, ids


def cache_of(bench, model, ids, cut=1):
    states, feats = bench.encode_ids(model, ids, pad_id=1, cut=cut, batch=3)  # batches of 3: padded differently
    labels = [i % 6 for i in range(len(ids))]
    part = {"states": states, "features": feats, "labels": labels}
    return {**bench.cache_parts(model, cut), "num_labels": 6, "train": part, "test": part,
            "make_model": bench.make_model}


def test_top_layers_on_cached_states_are_the_full_models_pooled_output(bench, tiny):
    model, ids = tiny
    cache = cache_of(bench, model, ids)
    assert cache["top"] == 2
    with torch.no_grad():
        for i, x in enumerate(ids):  # the cached states are the model's own, unpadded, whatever the batch's padding
            out = model(input_ids=torch.tensor([x]), output_hidden_states=True)
            assert torch.allclose(cache["train"]["states"][i], out.hidden_states[1][0], atol=1e-6)
            assert torch.allclose(cache["train"]["features"][i], out.last_hidden_state[0].mean(0), atol=1e-6)
    # all 8 collated in one batch (padded to 40): the top model reproduces the full model's pooled output
    assert bench.check_top_layers(cache, rows=len(ids), tol=1e-5) <= 1e-5


def test_check_refuses_a_top_model_without_mpnets_position_bias(bench, tiny):
    model, ids = tiny
    cache = cache_of(bench, model, ids)
    cache["relative_attention_bias"] = torch.zeros_like(cache["relative_attention_bias"])
    with pytest.raises(RuntimeError, match="differ from the full model's pooled output"):
        bench.check_top_layers(cache, rows=len(ids), tol=1e-5)


def test_lora_on_q_and_v_through_utilitys_hook_and_other_methods_refused(bench, tiny):
    model, ids = tiny
    cache = cache_of(bench, model, ids)
    lora = bench.utility.make_model(cache, "lora", 0)  # utility.make_model defers to cache["make_model"]
    trainable = {n: p.numel() for n, p in lora.named_parameters() if p.requires_grad}
    assert sorted({n.split(".attn.")[1].split(".")[0] for n in trainable if "lora_" in n}) == ["q", "v"]
    assert sum(trainable.values()) == 2 * 2 * (16 * 8 + 8 * 16) + (16 * 6 + 6)  # 2 layers × {q, v} + classifier
    assert not any("relative_attention_bias" in n for n in trainable)
    batch = bench.utility.collate([{"hidden_states": s, "labels": y} for s, y in
                                   zip(cache["train"]["states"], cache["train"]["labels"])])
    assert lora(**batch).logits.shape == (len(ids), 6)
    head = bench.utility.make_model(cache, "head", 0)
    assert head.classifier.in_features == 16 and head.classifier.out_features == 6
    with pytest.raises(ValueError, match="head, lora only"):
        bench.utility.make_model(cache, "top2", 0)
    with pytest.raises(ValueError, match="head, lora only"):
        bench.parse_key("full|8.0|clip|adam")


def test_each_dp_run_is_paired_with_its_own_non_private_counterpart(bench):
    rec = [{**bench.parse_key(k), "seed": 42, "accuracy": a} for k, a in
           ((f"head|8.0|clip|adam|{bench.H2}", 0.70), (f"head|inf|-|adam|{bench.H4}", 0.72),
            ("head|inf|-|adam", 0.80))]
    row = next(r for r in bench.gap_rows(rec, []) if r.startswith(f"| `head|8.0|clip|adam|{bench.H2}`"))
    assert "| 2.0 (met) (2.0), within 3 |" in row  # against H4 (72 %), not the default head (80 %)
