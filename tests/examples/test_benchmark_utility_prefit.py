"""benchmarks/utility_prefit.py (issue 25, session 14: public pre-fine-tuning on the proxy, then DP LoRA on Austen):
the parts that can be wrong without a real run, on a tiny random-init BERT — stage 0 keeps the trained top layers
under the cache's keys and drops the classifier; the weights round-trip through the file and its sha256 (a changed
file refused); the Austen runs' model loads exactly those layers with a fresh classifier (a state of another shape
refused); the assembled model's bottom layers are the pretrained ones (a change there refused); the run keys are the
proxy's choices."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import load_example
from transformers import BertConfig, BertModel


@pytest.fixture(scope="module")
def bench():
    return load_example("utility_prefit.py", "hf_dp_benchmark_utility_prefit", folder="benchmarks")


@pytest.fixture(scope="module")
def tiny():
    """A tiny BERT (4 layers, hidden 16) and a cache in utility.py's format built from it: random states entering
    layer 2, 6 classes, 24 training / 12 evaluation rows."""
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16)
    bert = BertModel(config, add_pooling_layer=False).eval()
    cache = {"config": config.to_dict(), "num_labels": 6,
             "top_state": {k: v.clone() for k, v in bert.encoder.layer[2:].state_dict().items()}}
    for part, n in (("train", 24), ("test", 12)):
        cache[part] = {"states": [torch.randn(3 + i % 4, 16) for i in range(n)],
                       "features": [torch.randn(16) for _ in range(n)], "labels": [i % 6 for i in range(n)]}
    return bert, cache


def test_keys_are_the_proxy_choices_and_round_trip(bench):
    u = bench.utility
    for k in [bench.STAGE0_KEY, *bench.AUSTEN_KEYS, *bench.HEAD_KEYS]:
        assert u.key(u.parse_key(k)) == k
    assert bench.AUSTEN_KEYS == ["lora|8.0|clip|adam|head_lr=0.05|lr=0.01|batch=256|max_steps=64",  # L7
                                 "lora|inf|-|adam|head_lr=0.05|lr=0.01|batch=512|max_steps=32",  # L2
                                 "lora|3.0|clip|adam|head_lr=0.05|lr=0.01|batch=256|max_steps=64"]
    assert bench.AUSTEN_KEYS[0].endswith(bench.proxy.LORA_CANDIDATES[6])
    assert bench.STAGE0_KEY == "top2|inf|-|adam|" + bench.unseen.TOP2_NP  # the fine-food non-private top-2 choice


def test_stage0_keeps_the_trained_top_layers_and_they_load_into_a_fresh_model(bench, tiny, tmp_path):
    _, cache = tiny
    with pytest.raises(ValueError, match="non-privately"):
        bench.run_stage0(cache, tmp_path, key="top2|8.0|clip|adam|lr=0.001|batch=64|max_steps=1")
    record, state = bench.run_stage0(cache, tmp_path / "s0", key="top2|inf|-|adam|head_lr=0.05|lr=0.01|batch=64"
                                                                     "|max_steps=2")
    assert record["steps"] == 2 and 0.0 <= record["accuracy"] <= 1.0
    assert set(state) == set(cache["top_state"])  # the cache's keys; the classifier dropped
    assert not bench.same_top_state(state, cache["top_state"])  # it trained
    assert bench.relative_change(cache["top_state"], state) > 0

    sha = bench.save_top_state(state, tmp_path / "top2.pt")
    assert bench.same_top_state(bench.load_top_state(tmp_path / "top2.pt", sha), state)
    with pytest.raises(ValueError, match="changed since stage 0 ran"):
        bench.load_top_state(tmp_path / "top2.pt", "0" * 64)

    prefit = bench.with_top_state(cache, state)
    assert prefit["top_state"] is state and cache["top_state"] is not state  # the original cache untouched
    model = bench.utility.make_model(prefit, "lora", 7)
    base = bench.utility.make_model(cache, "lora", 7)
    weights = {k.replace("base_model.model.layer.", "").replace(".base_layer", ""): v
               for k, v in model.state_dict().items() if ".layer." in k and "lora_" not in k}
    assert bench.same_top_state(weights, state)
    heads = [{k: v for k, v in m.state_dict().items() if "classifier" in k} for m in (model, base)]
    assert all(torch.equal(heads[0][k], heads[1][k]) for k in heads[0])  # a fresh classifier, as from the original

    bad = {**state, "0.attention.self.query.weight": torch.zeros(8, 16)}
    with pytest.raises(ValueError, match="shapes differ"):
        bench.with_top_state(cache, bad)
    with pytest.raises(ValueError, match="keys differ"):
        bench.with_top_state(cache, {k: v for k, v in state.items() if "query" not in k})

    feats = bench.top_features(cache, state)
    assert len(feats["test"]["features"]) == 12 and feats["test"]["features"][0].shape == (16,)
    assert not torch.equal(feats["test"]["features"][0], cache["test"]["features"][0])


def test_assembled_model_keeps_the_pretrained_bottom_layers(bench, tiny):
    bert, cache = tiny
    state = {k: v + 0.01 for k, v in cache["top_state"].items()}
    assembled = bench.assemble(copy.deepcopy(bert), state, 2)
    counts = bench.check_bottom(bert, assembled, state, 2)
    assert counts["top_tensors_loaded"] == len(state) and counts["bottom_tensors_identical"] > 0
    with torch.no_grad():
        assembled.encoder.layer[1].output.dense.weight[0, 0] += 1e-3
    with pytest.raises(AssertionError, match="changed weights below layer 2"):
        bench.check_bottom(bert, assembled, state, 2)
    with pytest.raises(AssertionError, match="not the stage-0 state"):
        bench.check_bottom(bert, bench.assemble(copy.deepcopy(bert), state, 2), cache["top_state"], 2)


def test_austen_table_gaps_against_the_original(bench):
    def rec(k, seed, acc):
        return {**bench.utility.parse_key(k), "seed": seed, "accuracy": acc}

    dp8, np_, dp3 = bench.AUSTEN_KEYS
    new = [rec(dp8, 42, 0.78), rec(np_, 42, 0.80), rec(dp3, 42, 0.74)]
    old = [rec(dp8, s, 0.75) for s in (42, 43)] + [rec(np_, s, 0.80) for s in (42, 43)]
    rows = bench.austen_table(new, old)
    assert "**2.0** (met; 2.0)" in rows[2] and "**6.0** (**not met**; 6.0)" in rows[4]
    assert "**5.0** (**not met**; 5.0)" in rows[3]  # the original on the same seed (42) only
    assert rows[5].endswith("| not run | within 5 |") and math.isfinite(bench.unseen.TARGET[3.0])

    h8, h3, hnp = bench.HEAD_KEYS
    heads = bench.head_table([rec(h8, 42, 0.70), rec(hnp, 42, 0.71)],
                             [rec(h8, s, 0.69) for s in (42, 43)] + [rec(hnp, 42, 0.70)])
    assert "| 70.0 (70.00) | 69.0 (69.00) |" in heads[2]  # the original on the seeds run here only
    assert heads[5] == "| gap ε = 8 | | 1.0 | 1.0 |" and heads[6] == "| gap ε = 3 | | – | – |"
