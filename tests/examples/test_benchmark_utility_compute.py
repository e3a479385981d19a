"""benchmarks/utility_compute.py (issue 25, session 13: more compute for both sides, the level chosen on the proxy):
the parts that can be wrong without a run — the levels are the proxy's session-12 choices with the steps multiplied
and nothing else changed; DP's level is the best proxy validation accuracy (seed 42), ties to the smaller level; the
non-private reference is the best among the non-private levels ≤ DP's only (a better non-private run at more compute
is not taken), ties to the smaller; both refuse while a level they rank has no record."""

from __future__ import annotations

import math

import pytest
from helpers import load_example


@pytest.fixture(scope="module")
def bench():
    return load_example("utility_compute.py", "hf_dp_benchmark_utility_compute", folder="benchmarks")


def records(bench, accs: dict[tuple[float, int], float], seed: int = 42) -> list[dict]:
    return [{**bench.utility.parse_key(bench.level_key(e, lv)), "seed": seed, "accuracy": a}
            for (e, lv), a in accs.items()]


def test_levels_multiply_the_steps_of_the_proxy_choices_only(bench):
    assert bench.level_key(8.0, 1) == "lora|8.0|clip|adam|head_lr=0.05|lr=0.01|batch=256|max_steps=64"  # L7
    assert bench.level_key(3.0, 4) == "lora|3.0|clip|adam|head_lr=0.05|lr=0.01|batch=256|max_steps=256"
    assert bench.level_key(math.inf, 1) == "lora|inf|-|adam|head_lr=0.05|lr=0.01|batch=512|max_steps=32"  # L2
    assert bench.level_key(math.inf, 2) == "lora|inf|-|adam|head_lr=0.05|lr=0.01|batch=512|max_steps=64"
    with pytest.raises(ValueError, match="compute level must be one of"):
        bench.level_key(8.0, 3)


def test_dp_level_best_accuracy_ties_to_the_smaller(bench):
    recs = records(bench, {(8.0, 1): 0.72, (8.0, 2): 0.75, (8.0, 4): 0.75})  # ×2 and ×4 tie: ×2
    recs += records(bench, {(8.0, 1): 0.99}, seed=43)  # another seed: not read
    assert bench.choose_level(recs, 8.0) == 2
    recs[2]["accuracy"] = 0.76
    assert bench.choose_level(recs, 8.0) == 4
    assert bench.choose_level(records(bench, {(3.0, 1): 0.7, (3.0, 2): 0.7, (3.0, 4): 0.7}), 3.0) == 1
    with pytest.raises(ValueError, match="1 of the levels ×1, ×2, ×4 have no proxy run"):
        bench.choose_level(recs[:2], 8.0)
    with pytest.raises(ValueError, match="reference_level"):
        bench.choose_level(recs, math.inf)


def test_reference_is_the_best_nonprivate_level_not_above_dp(bench):
    np_recs = records(bench, {(math.inf, 1): 0.80, (math.inf, 2): 0.79, (math.inf, 4): 0.90})
    assert bench.reference_level(np_recs, 2) == 1  # ×4's 0.90 is above DP's level: not taken
    assert bench.reference_level(np_recs, 4) == 4
    assert bench.reference_level(np_recs, 1) == 1
    np_recs[1]["accuracy"] = 0.80  # ×1 and ×2 tie: ×1
    assert bench.reference_level(np_recs, 2) == 1
    assert bench.reference_level(np_recs[:2], 2) == 1  # ×4 not run: not needed at DP ×2
    with pytest.raises(ValueError, match="no proxy run"):
        bench.reference_level(np_recs[:2], 4)
    dp = records(bench, {(8.0, 1): 0.70, (8.0, 2): 0.74, (8.0, 4): 0.73})
    assert bench.chosen_keys(dp + np_recs, [8.0]) == [
        (bench.level_key(8.0, 2), {"level": 2, "chosen_for_epsilon": 8.0}),
        (bench.level_key(math.inf, 1), {"level": 1, "reference_for_dp_level": 2})]
