"""benchmarks/utility_proxy.py (issue 25: settings chosen on a public proxy task, then applied to Austen): the parts
that can be wrong without a run — the proxy split labels each entry by its fortune file, is exact in size, disjoint
and stratified, and refuses entries from other files; the candidates are the pre-registered keys, each the same run
for utility.py's parser; the choice rule takes the best proxy validation accuracy of the chosen seed, ties to the
earlier candidate, and refuses to choose while a candidate is not run."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import load_example


@pytest.fixture(scope="module")
def bench():
    return load_example("utility_proxy.py", "hf_dp_benchmark_utility_proxy", folder="benchmarks")


def test_proxy_split_labels_by_file_exact_disjoint_stratified(bench):
    files = bench.FORTUNE_FILES
    sources = [files[0]] * 12 + [files[1]] * 9 + [files[2]] * 6 + [files[3]] * 3 + [files[4]] * 6 + [files[5]] * 3
    labels, train, val = bench.proxy_split(sources, 26, 13, seed=0)
    assert labels == [files.index(s) for s in sources]
    assert len(train) == 26 and len(val) == 13 and not set(train) & set(val)
    assert np.bincount(np.asarray(labels)[train]).tolist() == [8, 6, 4, 2, 4, 2]
    assert np.bincount(np.asarray(labels)[val]).tolist() == [4, 3, 2, 1, 2, 1]
    assert bench.proxy_split(sources, 26, 13, seed=0) == (labels, train, val)
    with pytest.raises(ValueError, match="outside the proxy"):
        bench.proxy_split(sources + ["literature"], 26, 13)


def test_candidates_are_the_preregistered_keys(bench):
    lora8 = bench.candidates("lora", 8.0)
    assert len(lora8) == 7 and lora8[0] == f"lora|8.0|clip|adam|{bench.utility.CHOSEN}"  # L1: the fine-food recipe
    assert bench.candidates("lora", math.inf)[5] == "lora|inf|-|adam|head_lr=0.05|lr=0.01|batch=1024|max_steps=16"
    heads = bench.candidates("head", 3.0)
    assert len(heads) == 8 and heads[:2] == ["head|3.0|clip|adam|lr=0.05|batch=256|max_steps=48",
                                             "head|3.0|clip|adam|lr=0.05|batch=512|max_steps=24"]
    assert heads[-1] == "head|3.0|clip|adam|lr=0.005|batch=512|max_steps=24"
    run = bench.utility.parse_key(heads[-1])
    assert (run["lr"], run["batch"], run["max_steps"]) == (0.005, 512, 24)


def test_choice_is_best_accuracy_ties_to_the_earlier_and_refuses_a_partial_list(bench):
    keys = bench.candidates("lora", 8.0)
    accs = [0.70, 0.74, 0.74, 0.60, 0.73, 0.71, 0.72]  # L2 and L3 tie: L2 (earlier) is chosen
    records = [{**bench.utility.parse_key(k), "seed": 42, "accuracy": a} for k, a in zip(keys, accs)]
    records.append({**bench.utility.parse_key(keys[3]), "seed": 43, "accuracy": 0.99})  # another seed: not read
    assert bench.choose(records, "lora", 8.0) == keys[1]
    records[2]["accuracy"] = 0.75
    assert bench.choose(records, "lora", 8.0) == keys[2]
    with pytest.raises(ValueError, match="1 of its 7 candidates have no proxy run"):
        bench.choose(records[:6], "lora", 8.0)
    with pytest.raises(ValueError, match="no proxy run"):  # non-private is its own choice: DP records do not count
        bench.choose(records, "lora", math.inf)


def test_reuse_copies_the_same_key_and_seed_instead_of_running(bench, tmp_path):
    key = bench.candidates("lora", 8.0)[0]
    earlier = [{**bench.utility.parse_key(key), "seed": 42, "accuracy": 0.735, "task": "austen"}]
    records: list = []
    saved = {"reused_from": "benchmarks/utility_austen.json"}
    bench.run_keys(tmp_path / "out.json", saved, records, None, [key], [42], {"chosen_on": "proxy"}, str(tmp_path),
                   earlier)  # cache None: a run would fail, so nothing ran
    assert records == [{**earlier[0], "chosen_on": "proxy", "reused_from": "benchmarks/utility_austen.json"}]
    assert (tmp_path / "out.json").is_file()
