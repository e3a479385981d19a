"""benchmarks/utility_lorad.py (issue 25, session 14: LoRA's rank and its clipping, chosen on the public proxy): the
parts that can be wrong without a run — utility.py's new settings ``rank`` and ``mode`` round-trip through its run
keys, are left out at their defaults (so every earlier key is unchanged) and are refused where they do not apply; the
rank reaches the model (α = 2r, d as counted) and the mode reaches DPTrainingArguments; the candidates are the
pre-registered keys at L7 / L2; the choice takes the best proxy validation accuracy (seed 42), ties to the existing
r = 8, C = 1 flat and then to the larger r, and refuses while a candidate is not run."""

from __future__ import annotations

import math

import pytest
from helpers import load_example

L7 = "head_lr=0.05|lr=0.01|batch=256|max_steps=64"
L2 = "head_lr=0.05|lr=0.01|batch=512|max_steps=32"


@pytest.fixture(scope="module")
def bench():
    return load_example("utility_lorad.py", "hf_dp_benchmark_utility_lorad", folder="benchmarks")


def test_rank_and_mode_round_trip_and_defaults_stay_out_of_the_key(bench):
    u = bench.utility
    for k in (f"lora|8.0|clip|adam|{L7}|rank=2", f"lora|3.0|clip|adam|{L7}|mode=adaptive_per_layer",
              f"lora|8.0|clip|adam|{L7}|C=3|rank=4|mode=adaptive_per_layer", f"lora|inf|-|adam|{L2}|rank=1",
              "probe_lora|8.0|clip|adam|rank=4"):
        assert u.key(u.parse_key(k)) == k
    assert u.parse_key(f"lora|8.0|clip|adam|{L7}|rank=2")["rank"] == 2
    assert u.key(u.parse_key(f"lora|8.0|clip|adam|{L7}")) == f"lora|8.0|clip|adam|{L7}"  # no rank, no mode


@pytest.mark.parametrize("text, match", [
    (f"head|8.0|clip|adam|{L7}|rank=2", "only for lora"),
    (f"top2|8.0|clip|adam|{L7}|rank=2", "only for lora"),
    (f"lora|8.0|clip|adam|{L7}|rank=8", "other than the default 8"),
    (f"lora|8.0|clip|adam|{L7}|rank=0", "positive integer"),
    (f"lora|8.0|clip|adam|{L7}|mode=flat", "flat is the default"),
    (f"lora|8.0|clip|adam|{L7}|mode=per_layer", "mode must be one of"),
    (f"lora|inf|-|adam|{L2}|mode=adaptive_per_layer", "not for a non-private"),
    ("probe_lora|8.0|clip|adam|mode=adaptive_per_layer", "probe-then-fine-tune"),
    (f"lora|8.0|automatic|adam|{L7}|mode=adaptive_per_layer", "takes clipping 'clip'"),
    (f"lora|8.0|clip|adam_bc|{L7}|mode=adaptive_per_layer", "no adam_bc"),
    (f"lora|8.0|clip|adam|{L7}|C_body=0.5|mode=adaptive_per_layer", "no C_body"),
])
def test_rank_and_mode_are_refused_where_they_do_not_apply(bench, text, match):
    with pytest.raises(ValueError, match=match):
        bench.utility.parse_key(text)


def test_rank_reaches_the_model_and_mode_the_arguments(bench, tmp_path):
    from transformers import BertConfig

    u = bench.utility
    config = BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                        vocab_size=50)
    top = u.TopLayersForSequenceClassification(config)
    cache = {"config": config.to_dict(), "top_state": top.layer.state_dict(), "num_labels": 6}
    assert (u.lora_config(2).r, u.lora_config(2).lora_alpha) == (2, 4)
    assert (u.lora_config().r, u.lora_config().lora_alpha) == (8, 16)  # r = 8 unchanged
    for rank in (1, 2, 8):
        model = u.make_model(cache, "lora", 0, rank)
        d = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert d == 2 * 2 * rank * (16 + 16) + (16 * 6 + 6)  # 2 layers × (query, value) × r(d_in + d_out) + classifier
    with pytest.raises(ValueError, match="another encoder"):
        u.make_model({**cache, "make_model": lambda *a: None}, "lora", 0, 2)
    run = u.parse_key(f"lora|8.0|clip|adam|{L7}|mode=adaptive_per_layer")
    assert u.dp_args(tmp_path, "lora", run, 0, 4000, 1.0, 0.01, 8.0).clipping == "adaptive_per_layer"
    assert u.dp_args(tmp_path, "lora", u.parse_key(f"lora|8.0|clip|adam|{L7}"), 0, 4000, 1.0, 0.01, 8.0).clipping \
        == "flat"


def test_candidates_are_the_preregistered_keys(bench):
    dp8 = [k for _, k in bench.dp_candidates(8.0)]
    assert dp8 == [f"lora|8.0|clip|adam|{L7}", f"lora|8.0|clip|adam|{L7}|C=3",
                   f"lora|8.0|clip|adam|{L7}|mode=adaptive_per_layer", f"lora|8.0|clip|adam|{L7}|rank=4",
                   f"lora|8.0|clip|adam|{L7}|rank=2", f"lora|8.0|clip|adam|{L7}|rank=1"]
    assert [k for _, k in bench.dp_candidates(3.0)][0] == f"lora|3.0|clip|adam|{L7}"  # session 12's record: reused
    assert [k for _, k in bench.np_candidates()] == [f"lora|inf|-|adam|{L2}"] + [
        f"lora|inf|-|adam|{L2}|rank={r}" for r in (4, 2, 1)]
    with pytest.raises(ValueError, match="finite"):
        bench.dp_candidates(math.inf)


def records(bench, accs: list[float], epsilon: float, seed: int = 42) -> list[dict]:
    return [{**bench.utility.parse_key(k), "seed": seed, "accuracy": a}
            for (_, k), a in zip(bench.candidates(epsilon), accs)]


def test_choice_best_accuracy_ties_to_existing_then_larger_rank(bench):
    keys = [k for _, k in bench.dp_candidates(8.0)]
    recs = records(bench, [0.70, 0.71, 0.69, 0.72, 0.73, 0.71], 8.0)
    recs += records(bench, [0.99] * 6, 8.0, seed=43)  # another seed: not read
    assert bench.choose(recs, 8.0) == keys[4]  # r = 2
    tie_existing = records(bench, [0.73, 0.73, 0.73, 0.73, 0.73, 0.73], 8.0)
    assert bench.choose(tie_existing, 8.0) == keys[0]  # every candidate tied: the existing r = 8, C = 1
    tie_ranks = records(bench, [0.70, 0.71, 0.70, 0.72, 0.72, 0.72], 8.0)
    assert bench.choose(tie_ranks, 8.0) == keys[3]  # r = 4, 2, 1 tied: the larger r
    tie_r8 = records(bench, [0.70, 0.74, 0.74, 0.72, 0.72, 0.72], 8.0)
    assert bench.choose(tie_r8, 8.0) == keys[1]  # C = 3 and adaptive tied: C = 3 (list order)
    nps = [k for _, k in bench.np_candidates()]
    assert bench.choose(records(bench, [0.76, 0.76, 0.75, 0.74], math.inf), math.inf) == nps[0]  # tie: r = 8
    assert bench.choose(records(bench, [0.75, 0.76, 0.76, 0.74], math.inf), math.inf) == nps[1]  # tie: larger r
    assert bench.chosen_keys(recs + records(bench, [0.75, 0.76, 0.76, 0.74], math.inf), [8.0]) == [
        (keys[4], {"chosen_for_epsilon": 8.0}), (nps[1], {"reference": True})]
    with pytest.raises(ValueError, match="1 of its 6 candidates have no proxy run with seed 42"):
        bench.choose(recs[:5], 8.0)
    with pytest.raises(ValueError, match="no proxy run"):
        bench.choose(recs, 3.0)


def test_tables_render_without_records(bench):
    assert len(bench.proxy_table([])) == 2 + 6
    assert "not chosen" in bench.austen_table([], [])[2]
