"""DP synthetic text: reproducible by seed, dataset card carries the generator's record, private data never read."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import VOCAB, lm_dataset, tiny_gpt2
from huggingface_hub import DatasetCard
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hf_dp import DPTrainer, DPTrainingArguments
from hf_dp.cards import privacy_metadata, privacy_report, validate_card
from hf_dp.synthetic import (
    generate_synthetic_dataset,
    save_synthetic_dataset,
    synthetic_info,
    write_dataset_card,
)


class PrivateDataAccessed(AssertionError):
    pass


class GuardedDataset:
    """Stands in for the private training set after training: its size is known, any other access fails."""

    def __init__(self, n: int):
        self._n = n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, item):
        raise PrivateDataAccessed(f"read row {item!r} of the private data")

    def __iter__(self):
        raise PrivateDataAccessed("iterated over the private data")

    def __getattr__(self, name):
        raise PrivateDataAccessed(f"accessed private_data.{name}")


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer over the tiny GPT-2 vocabulary: ``<s>`` = 0 (bos = eos), ``<pad>`` = 1, ``w2``..``w60``."""
    vocab = {"<s>": 0, "<pad>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="<s>", pad_token="<pad>")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("gen")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = DPTrainingArguments(output_dir=str(out), per_device_train_batch_size=4, noise_multiplier=1.0,
                                   max_steps=2, use_cpu=True, report_to="none", save_strategy="no",
                                   disable_tqdm=True, learning_rate=1e-2, per_sample_max_grad_norm=1.0)
    torch.manual_seed(0)
    trainer = DPTrainer(model=tiny_gpt2(), args=args, train_dataset=lm_dataset(32))
    trainer.train()
    return trainer, out


def gen(model, n=10, **kw):
    base = dict(max_new_tokens=6, batch_size=4, seed=7, progress=False)
    base.update(kw)
    return generate_synthetic_dataset(model, word_tokenizer(), n, **base)


def test_generation_is_reproducible_by_seed_and_leaves_the_global_rng_alone(trained):
    trainer, _ = trained
    model = trainer.model
    state = torch.get_rng_state()
    a, b = gen(model), gen(model)
    assert torch.equal(state, torch.get_rng_state())
    assert a["text"] == b["text"] and len(a) == 10 and a.column_names == ["text"]
    assert all(t and all(w.startswith("w") for w in t.split()) for t in a["text"])
    assert len(set(a["text"])) > 5  # sampled, not greedy
    assert gen(model, seed=8)["text"] != a["text"]
    assert gen(model, n=6)["text"] == a["text"][:6]  # batch b's seed does not depend on num_samples
    assert len(set(gen(model, top_k=1)["text"])) == 1  # settings are used: top-k = 1 is greedy, one text
    info = synthetic_info(a)
    assert info["differential_privacy"] is None
    assert info["sampling"] | {"seed": 7} == info["sampling"] and info["sampling"]["top_k"] == 50


def test_prompts_are_cycled_and_stripped_from_the_output(trained):
    trainer, _ = trained
    ds = gen(trainer.model, n=5, prompt=["w5 w6 w7", "w9"], top_k=None, top_p=0.9)
    assert ds["prompt"] == ["w5 w6 w7", "w9", "w5 w6 w7", "w9", "w5 w6 w7"]
    assert all(len(t.split()) <= 6 for t in ds["text"])
    assert gen(trainer.model, n=5, prompt=["w5 w6 w7", "w9"], top_k=None, top_p=0.9)["text"] == ds["text"]
    assert synthetic_info(ds)["sampling"]["top_k"] is None
    with pytest.raises(ValueError, match="top_p"):
        gen(trainer.model, top_p=0.0)


def test_nothing_in_the_synthetic_path_reads_the_private_data(trained, tmp_path):
    trainer, _ = trained
    guard = GuardedDataset(len(trainer.train_dataset))
    with pytest.raises(PrivateDataAccessed):
        guard[0]
    original = trainer.train_dataset
    trainer.train_dataset = guard

    def no_loader(*args, **kwargs):
        raise PrivateDataAccessed("asked for the private train loader")

    trainer.get_train_dataloader = no_loader
    try:
        ds = gen(trainer.model, privacy=trainer)
        info = synthetic_info(ds)
        card = write_dataset_card(tmp_path / "syn", trainer, info["sampling"])
        trainer.create_model_card(output_dir=tmp_path / "model")
        ds2 = gen(trainer.model, privacy=str(tmp_path / "model"))  # from the generator's model card
    finally:
        trainer.train_dataset = original
        del trainer.get_train_dataloader
    assert info["differential_privacy"] == privacy_metadata(trainer.privacy_record())
    assert card.data.to_dict()["differential_privacy"]["dataset_size"] == 32
    assert synthetic_info(ds2)["differential_privacy"] == info["differential_privacy"]


def test_dataset_card_carries_the_generators_record_and_the_sampling_settings(trained, tmp_path):
    trainer, _ = trained
    ds = gen(trainer.model, n=8, privacy=trainer, prompt="w3")
    out = save_synthetic_dataset(ds, tmp_path / "dp-synthetic", license="cc0-1.0")
    assert (out / "data" / "train.jsonl").is_file()
    card = DatasetCard.load(out / "README.md")
    data = card.data.to_dict()
    dp = privacy_metadata(trainer.privacy_record())
    assert data["differential_privacy"] == dp  # post-processing: the same (ε, δ) and mechanism
    assert privacy_report(out) == dp
    validate_card(out)
    syn = data["synthetic_data"]
    assert syn["post_processing"] is True and syn["num_samples"] == 8 and syn["prompt"] == "w3"
    assert syn["top_k"] == 50 and syn["seed"] == 7 and syn["max_new_tokens"] == 6 and syn["temperature"] == 1.0
    assert {"synthetic", "differential-privacy", "hf_dp"} <= set(data["tags"])
    assert data["task_categories"] == ["text-generation"] and data["license"] == "cc0-1.0"
    assert "post-processing" in card.text and "| top_k | 50 |" in card.text and "must not be derived from" in card.text
    assert f"ε = {dp['epsilon']:.3g}" in card.text
    write_dataset_card(out, dp, synthetic_info(ds)["sampling"])  # rewriting keeps the license given before
    assert DatasetCard.load(out / "README.md").data.to_dict()["license"] == "cc0-1.0"
    with pytest.raises(ValueError, match="needs the generator's differential_privacy record"):
        write_dataset_card(tmp_path / "none", None, synthetic_info(ds)["sampling"])
    with pytest.raises(ValueError, match="Invalid differential_privacy record"):
        write_dataset_card(tmp_path / "bad", {**dp, "delta": 2.0}, synthetic_info(ds)["sampling"])


def test_lora_generator(tmp_path):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(tiny_gpt2(), LoraConfig(r=2, target_modules=["c_attn"], task_type="CAUSAL_LM"))
    ds = gen(model, n=4)
    assert ds["text"] == gen(model, n=4)["text"] and synthetic_info(ds)["sampling"]["generator_class"].startswith(
        "PeftModel")
