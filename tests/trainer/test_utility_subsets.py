"""Issue 25, session 10: ``benchmarks/utility.py``'s ``n`` setting (train on the first n training reviews).

A run key with ``|n=…`` round-trips, the earlier keys are unchanged by it (so their recorded runs stay
reproducible and are still skipped as done), the training rows are the first n (after the validation carve) with the
evaluation rows unchanged, and an n larger than the split is refused before any training.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import load_example

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def utility():
    return load_example("utility.py", "hf_dp_benchmark_utility", folder="benchmarks")


def fake_cache(n_train: int = 40, n_test: int = 10) -> dict:
    def part(n: int, offset: int) -> dict:
        return {"features": [torch.full((3,), float(offset + i)) for i in range(n)],
                "states": [torch.full((2, 3), float(offset + i)) for i in range(n)],
                "labels": [i % 2 for i in range(n)]}

    return {"train": part(n_train, 0), "test": part(n_test, 1000)}


def test_n_key_round_trips_and_earlier_keys_are_unchanged(utility):
    text = "lora|8.0|clip|adam|head_lr=0.1|lr=0.01|batch=128|max_steps=32|n=1000"
    run = utility.parse_key(text)
    assert run["n"] == 1000 and utility.key(run) == text
    earlier = "lora|8.0|clip|adam|head_lr=0.1|lr=0.01|batch=512|max_steps=32"
    assert utility.key(utility.parse_key(earlier)) == earlier
    with pytest.raises(ValueError, match="n must be a positive"):
        utility.parse_key("head|8.0|clip|adam|n=0")


@pytest.mark.parametrize("method", ["head", "top"])
def test_n_takes_the_first_training_rows_and_keeps_the_evaluation_set(utility, method):
    cache = fake_cache()
    field = "features" if method == "head" else "hidden_states"
    first = lambda rows: [float(rows[i][field].flatten()[0]) for i in range(len(rows))]  # noqa: E731
    train, test = utility.datasets_for(cache, method, "test", 16)
    assert first(train) == [float(i) for i in range(16)]
    assert first(test) == first(utility.datasets_for(cache, method, "test")[1])
    train, val = utility.datasets_for(cache, method, "val", 16)
    assert first(train) == [float(i) for i in range(16)]
    assert first(val) == [float(i) for i in range(30, 40)]  # the last quarter (VAL caps it at 500), as without n


def test_n_beyond_the_split_is_refused(utility):
    with pytest.raises(ValueError, match="more than the 30 training reviews"):
        utility.datasets_for(fake_cache(), "head", "val", 31)
