"""benchmarks/utility_sft.py (issue 25, DP-SFT by completion perplexity): the parts that can be wrong without a run —
the validation split never reads the test conversations, a run key names every setting and parses back, and the
table's aggregation over seeds."""

from __future__ import annotations

import math
from pathlib import Path

import datasets
import pytest
from helpers import load_example

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "utility_sft.py"


@pytest.fixture(scope="module")
def bench():
    return load_example("utility_sft.py", "hf_dp_benchmark_utility_sft", folder="benchmarks")


def test_validation_split_comes_from_training_conversations_only(bench):
    chats = datasets.DatasetDict(train=datasets.Dataset.from_dict({"i": list(range(10))}),
                                 test=datasets.Dataset.from_dict({"i": list(range(100, 104))}))
    val = bench.split_chats(chats, "val", val=3)
    assert val["train"]["i"] == list(range(7)) and val["test"]["i"] == [7, 8, 9]
    assert not set(val["test"]["i"]) & set(chats["test"]["i"])
    assert bench.split_chats(chats, "test", val=3) is chats
    with pytest.raises(ValueError, match="validation size"):
        bench.split_chats(chats, "val", val=10)


def test_run_key_names_every_setting_and_parses_back(bench):
    for text in ("lora|8.0|clip|adam", "full|3.0|automatic|adam_bc|lr=0.005|batch=128|steps=4|C=1",
                 "lora|inf|-|adam|lr=0.02|np_packing=true|split=val", "public|0.0|-|-|split=val"):
        run = bench.parse_key(text)
        k = bench.key(run)
        assert bench.key(bench.parse_key(k)) == k
        assert f"split={run['split']}" in k and f"max_length={run['max_length']}" in k
        if run["method"] != "public":
            assert all(f"|{n}=" in k for n in ("lr", "batch", "steps"))
            assert ("|C=" in k) == (not math.isinf(run["epsilon"]))
    assert bench.parse_key("lora|8.0|clip|adam|lr=0.02") != bench.parse_key("lora|8.0|clip|adam")
    for bad in ("lora|8.0|-|adam", "lora|inf|clip|adam", "lora|8.0|clip|adam|batch=100", "lora|8.0|clip|adam|x=1",
                "lora|8.0|clip|adam|split=train", "public|8.0|-|-"):
        with pytest.raises(ValueError):
            bench.parse_key(bad)


def test_summary_averages_seeds_per_key(bench):
    run = bench.parse_key("lora|8.0|clip|adam")
    other = bench.parse_key("lora|3.0|clip|adam")
    records = [{**run, "seed": 1, "perplexity": 10.0}, {**run, "seed": 2, "perplexity": 14.0},
               {**other, "seed": 1, "perplexity": 20.0}]
    by = bench.summary(records)
    assert by[bench.key(run)]["perplexity"] == 12.0 and by[bench.key(run)]["seeds"] == 2
    assert by[bench.key(run)]["perplexity_sd"] == pytest.approx(math.sqrt(8.0))
    assert by[bench.key(other)]["perplexity_sd"] is None
