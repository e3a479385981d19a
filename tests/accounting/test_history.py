"""Issue 22, invariants 4 and 5 (DESIGN 13): a model carries its privacy history; the unit the user thinks they have.

History: a model that a ``DPTrainer`` trained, given to a new ``DPTrainer`` in any of the shapes a user produces (the
same object, a ``PeftModel`` over it, the base under a trained ``PeftModel``, ``merge_and_unload()``'s result,
``save_pretrained``/``from_pretrained``, a deep copy, an adapter saved alone), continues its accountant: ε composes,
and is checked against prv-accountant called directly on the combined mechanisms (not our accountant).

Unit: rows cut by transformers' run_clm ``group_texts`` are detected (warned once, recorded in dp_state.json and the
card); padded ordinary data sets are not. The document-level recipe's neighbouring bound is in test_guarantee.py.
"""

from __future__ import annotations

import copy
import json
import warnings
from itertools import chain

import pytest
import torch
from datasets import Dataset
from helpers import VOCAB, cls_dataset, lm_dataset, quick_dp_args, tiny_gpt2
from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant
from transformers import AutoModelForCausalLM, TrainerCallback, default_data_collator

from hf_dp import DPTrainer, PrivacyRecord, attach_privacy_history, chunk_documents, looks_grouped, read_privacy_history
from hf_dp.cards import privacy_report, validate_card
from hf_dp.history import CONFIG_KEY

N = 8
DELTA = 0.05


def args(out, **kw):
    return quick_dp_args(out, **{"target_delta": DELTA, "logging_steps": 100, **kw})  # ε logged at the end only


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return tiny_gpt2()


def lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], fan_in_fan_out=True))


def train(model, out, data=None, **kw) -> DPTrainer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPTrainer(model=model, args=args(out, **kw), train_dataset=lm_dataset(N) if data is None else data)
        trainer.train()
    return trainer


def new_trainer(model, out, data=None, **kw) -> DPTrainer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DPTrainer(model=model, args=args(out, **kw), train_dataset=lm_dataset(N) if data is None else data)


def prv_epsilon(mechanisms, delta=DELTA, eps_error=0.01) -> float:
    """ε upper bound of prv-accountant itself (not hf_dp's accountant) for (σ, q, steps) mechanisms."""
    prvs = [PoissonSubsampledGaussianMechanism(sampling_probability=q, noise_multiplier=s) for s, q, _ in mechanisms]
    steps = [n for _, _, n in mechanisms]
    acc = PRVAccountant(prvs=prvs, max_self_compositions=steps, eps_error=eps_error, delta_error=delta / 1000)
    return float(acc.compute_epsilon(delta=delta, num_self_compositions=steps)[2])


def rdp_epsilon(mechanisms, delta=DELTA) -> float:
    """ε of prv-accountant's RDP accountant (Mironov 2017) for (σ, q, steps) mechanisms."""
    from prv_accountant.other_accountants import RDP

    prvs = [PoissonSubsampledGaussianMechanism(sampling_probability=q, noise_multiplier=s) for s, q, _ in mechanisms]
    return float(RDP(prvs=prvs).compute_epsilon(delta=delta, num_self_compositions=[n for _, _, n in mechanisms])[2])


Q = 4 / N  # quick_dp_args: per-device batch 4, no accumulation


# ------------------------------------------------------------------------------------------ history: the shapes
def test_second_trainer_on_the_trained_model_composes(tmp_path):
    model = gpt2()
    first = train(model, tmp_path / "a", noise_multiplier=1.0, max_steps=2)
    with pytest.warns(UserWarning, match="already trained with DP, 2 earlier DP steps"):
        second = DPTrainer(model=model, args=args(tmp_path / "b", noise_multiplier=1.5, max_steps=3),
                           train_dataset=lm_dataset(N))
    assert second.accountant.steps == 2  # before its own first step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        second.train()
    spent = second.privacy_spent()
    expected = prv_epsilon([(1.0, Q, 2), (1.5, Q, 3)])
    alone = prv_epsilon([(1.5, Q, 3)])
    assert spent["steps"] == 5
    assert spent["epsilon"] == pytest.approx(expected, rel=1e-6)
    assert spent["epsilon"] > alone + 0.1 and spent["epsilon"] > first.privacy_spent()["epsilon"]
    assert second.dp_guarantee == "strict"
    assert second.state.log_history[-1]["epsilon"] == pytest.approx(expected, abs=1e-4)  # the logs too
    # The same history, read back off the model: both runs, each with its own steps only.
    runs = read_privacy_history(model)
    assert sorted(r["steps"] for r in runs) == [2, 3]


def test_first_trainer_trained_again_after_a_second_one_composes_all_three_runs(tmp_path):
    """Notebook cells run out of order: trainer A trains the model, trainer B trains it, A.train() again. A's
    accountant re-reads the model at train(): its own steps, B's, and its new ones."""
    model = gpt2()
    first = train(model, tmp_path / "a", max_steps=2)
    train(model, tmp_path / "b", max_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first.train()
    assert first.accountant.steps == 2 + 1 + 2
    assert sorted(r["steps"] for r in read_privacy_history(model)) == [1, 4]  # B's 1; A's 2 + 2 (one run)


def test_peft_model_over_a_dp_trained_base_and_merge_and_unload(tmp_path):
    base = gpt2()
    train(base, tmp_path / "a", max_steps=2)
    peft_model = lora(base)  # get_peft_model(DP-trained base): the base's weights are part of the released model
    second = new_trainer(peft_model, tmp_path / "b", max_steps=1)
    assert second.accountant.steps == 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        second.train()
    assert second.accountant.steps == 3
    merged = peft_model.merge_and_unload()  # LoRA folded into the base weights
    assert new_trainer(merged, tmp_path / "c").accountant.steps == 3


def test_base_under_a_trained_peft_model_carries_the_adapters_training(tmp_path):
    peft_model = lora(gpt2())
    train(peft_model, tmp_path / "a", max_steps=2)
    base = peft_model.get_base_model()  # still holds the DP-trained LoRA layers
    assert sum(r["steps"] for r in read_privacy_history(base)) == 2
    # A parameter of the trained model reused inside another module (no config of its own) carries it too.
    wrapper = torch.nn.Sequential(peft_model.get_base_model().transformer.wte)
    assert sum(r["steps"] for r in read_privacy_history(wrapper)) == 2


def test_save_pretrained_round_trip_and_deep_copy(tmp_path):
    model = gpt2()
    train(model, tmp_path / "a", max_steps=2)
    model.save_pretrained(tmp_path / "saved")  # the user's own save: no dp_state.json, the config carries it
    assert CONFIG_KEY in json.loads((tmp_path / "saved" / "config.json").read_text())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert new_trainer(loaded, tmp_path / "b").accountant.steps == 2
    assert new_trainer(copy.deepcopy(model), tmp_path / "c").accountant.steps == 2
    assert new_trainer(gpt2(), tmp_path / "d").accountant.steps == 0  # a fresh model: a fresh accountant


def test_adapter_saved_alone_continues_with_attach_privacy_history(tmp_path):
    from peft import PeftModel

    trained = train(lora(gpt2()), tmp_path / "a", max_steps=2)
    trained.save_model(tmp_path / "adapter")  # adapter files + dp_state.json, no config.json
    loaded = PeftModel.from_pretrained(gpt2(), tmp_path / "adapter", is_trainable=True)
    assert read_privacy_history(loaded) == []  # what peft loads knows nothing of it (documented)
    attach_privacy_history(loaded, tmp_path / "adapter")
    assert new_trainer(loaded, tmp_path / "b").accountant.steps == 2


class Interrupt(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            raise KeyboardInterrupt  # the user stops the cell


def test_interrupted_run_carries_the_steps_it_took(tmp_path):
    model = gpt2()
    trainer = new_trainer(model, tmp_path / "a", max_steps=5)
    trainer.add_callback(Interrupt())
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert new_trainer(model, tmp_path / "b").accountant.steps == 2  # the re-run cell continues


def test_resume_from_checkpoint_counts_each_step_once(tmp_path):
    model = gpt2()
    train(model, tmp_path / "a", max_steps=2, save_strategy="steps", save_steps=1)
    trainer = new_trainer(model, tmp_path / "a", max_steps=2)  # the same model: it carries the 2 steps
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-1"))
    assert trainer.accountant.steps == 2  # checkpoint-1's step and one more, not 2 + 2
    assert sum(r["steps"] for r in read_privacy_history(model)) == 2


def test_model_init_fresh_model_fresh_history_unless_it_carries_one(tmp_path):
    trained = gpt2()
    train(trained, tmp_path / "a", max_steps=2)
    trained.save_pretrained(tmp_path / "saved")
    for init, steps in ((gpt2, 1), (lambda: AutoModelForCausalLM.from_pretrained(tmp_path / "saved"), 3)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = DPTrainer(model_init=init, args=args(tmp_path / "b", max_steps=1), train_dataset=lm_dataset(N))
            trainer.train()
        assert trainer.accountant.steps == steps


# ------------------------------------------------------------------------------------------ history: the budget
def test_target_epsilon_budgets_what_is_left(tmp_path):
    model = gpt2()
    train(model, tmp_path / "a", noise_multiplier=1.0, max_steps=2, accountant="rdp")
    first = rdp_epsilon([(1.0, Q, 2)])
    target = first + 1.0
    # (RDP: the same calibration code path as PRV, ~20x cheaper; ε checked with prv-accountant's own RDP.)
    second = train(model, tmp_path / "b", noise_multiplier=None, target_epsilon=target, max_steps=2, accountant="rdp")
    composed = rdp_epsilon([(1.0, Q, 2), (second.noise_multiplier, Q, 2)])  # σ calibrated to what is left
    assert first < composed <= target and second.privacy_spent()["epsilon"] == pytest.approx(composed, rel=1e-6)
    spent_model = gpt2()
    train(spent_model, tmp_path / "d", noise_multiplier=1.0, max_steps=2, accountant="rdp")
    refused = new_trainer(spent_model, tmp_path / "e", noise_multiplier=None, target_epsilon=0.5 * first,
                          accountant="rdp")
    with pytest.raises(ValueError, match="already"):
        refused.train()


# ------------------------------------------------------------------------------------------ history: what is said
def test_card_and_dp_state_say_it_continues(tmp_path):
    model = gpt2()
    train(model, tmp_path / "a", max_steps=2)
    second = train(model, tmp_path / "b", max_steps=1)
    second.save_model(tmp_path / "out")
    text = (tmp_path / "out" / "README.md").read_text()
    assert "it continues from 2 earlier DP steps in 1 earlier run" in text and "| 3 (2 earlier DP steps" in text
    validate_card(tmp_path / "out")
    dp = privacy_report(tmp_path / "out")
    assert dp["steps"] == 3 and dp["continues_from"]["steps"] == 2 and dp["continues_from"]["this_run_steps"] == 1
    assert dp["epsilon"] == pytest.approx(second.privacy_spent()["epsilon"], rel=1e-5)
    record = PrivacyRecord.load(tmp_path / "out")
    assert record.steps == 3 and [r["steps"] for r in record.earlier_runs] == [2]


def test_other_privacy_unit_or_a_not_strict_earlier_run_is_recorded_as_not_strict(tmp_path):
    model = gpt2()
    train(model, tmp_path / "a", max_steps=1, dp_seed=3)  # a known seed: the first run was not strict
    users = lm_dataset(N).add_column("author", ["a", "b", "c", "d"] * 2)
    second = new_trainer(model, tmp_path / "b", data=users, privacy_unit="user", user_id_column="author",
                         per_device_train_batch_size=2)
    guarantee = second.dp_guarantee
    assert guarantee.startswith("not strict") and "another privacy unit (example" in guarantee
    assert "whose guarantee was not strict (fixed dp_seed" in guarantee
    assert second.accountant.steps == 1  # composed nevertheless: never only the new steps


def test_malformed_history_is_refused(tmp_path):
    model = gpt2()
    setattr(model.config, CONFIG_KEY, [{"run_id": "x", "mechanisms": [{"noise_multiplier": -1.0, "sample_rate": 0.5,
                                                                     "steps": 2}]}])
    with pytest.raises(ValueError, match="privacy history .* cannot be read"):
        new_trainer(model, tmp_path)


# ------------------------------------------------------------------------------------------ the privacy unit
def documents(n: int = 6, seed: int = 0) -> Dataset:
    """Tokenised documents of different lengths, as a tokenizer returns them (no labels)."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(2, VOCAB, (int(torch.randint(3, 15, (1,), generator=g)),), generator=g).tolist()
           for _ in range(n)]
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})


def run_clm_group_texts(dataset: Dataset, block_size: int) -> Dataset:
    """transformers' examples/pytorch/language-modeling/run_clm.py ``group_texts``, verbatim but for the names."""

    def group_texts(examples):
        concatenated_examples = {k: list(chain(*examples[k])) for k in examples.keys()}
        total_length = len(concatenated_examples[list(examples.keys())[0]])
        total_length = (total_length // block_size) * block_size
        result = {
            k: [t[i: i + block_size] for i in range(0, total_length, block_size)]
            for k, t in concatenated_examples.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    return dataset.map(group_texts, batched=True)


def test_grouped_blocks_are_detected_said_once_and_recorded(tmp_path):
    grouped = run_clm_group_texts(documents(12), block_size=6)
    assert looks_grouped(grouped) == 6
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = DPTrainer(model=gpt2(), args=args(tmp_path, max_steps=1), train_dataset=grouped,
                            data_collator=default_data_collator)
        trainer.train()
    said = [w for w in caught if "fixed-length blocks of concatenated text" in str(w.message)]
    assert len(said) == 1
    trainer.save_model(tmp_path / "out")
    assert "blocks of concatenated text" in PrivacyRecord.load(tmp_path / "out").privacy_unit_detail
    dp = privacy_report(tmp_path / "out")
    assert "one block, not one document" in dp["privacy_unit_detail"]
    text = (tmp_path / "out" / "README.md").read_text()
    assert "What one unit is here" in text and "which may not be one document" in text


@pytest.mark.parametrize("kind", ["padded_lm", "same_length_padded", "classification_padded_to_max",
                                  "prompt_masked_labels", "different_lengths", "chunked_within_documents"])
def test_ordinary_data_sets_are_not_taken_for_grouped_blocks(kind):
    if kind == "padded_lm":
        data = lm_dataset(N)  # right-padded, labels -100 on padding
    elif kind == "same_length_padded":
        data = Dataset.from_dict({"input_ids": [[5, 6, 7, 0]] * 4, "attention_mask": [[1, 1, 1, 0]] * 4,
                                  "labels": [[5, 6, 7, -100]] * 4})
    elif kind == "classification_padded_to_max":
        data = cls_dataset(N, 3)
    elif kind == "prompt_masked_labels":
        data = Dataset.from_dict({"input_ids": [[5, 6, 7, 8]] * 4, "labels": [[-100, -100, 7, 8]] * 4})
    elif kind == "different_lengths":
        data = documents()
    else:
        data = chunk_documents(documents(), block_size=4)
    assert looks_grouped(data, pad_token_id=0) is None


def test_padded_data_set_gets_no_unit_warning(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = DPTrainer(model=gpt2(), args=args(tmp_path, max_steps=1), train_dataset=lm_dataset(N))
    assert not [w for w in caught if "fixed-length blocks" in str(w.message)]
    assert trainer.privacy_record().privacy_unit_detail is None


def test_user_level_units_silence_the_check(tmp_path):
    grouped = run_clm_group_texts(documents(12), block_size=6)
    grouped = grouped.add_column("document_id", list(range(len(grouped))))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DPTrainer(model=gpt2(), args=args(tmp_path, privacy_unit="user", user_id_column="document_id"),
                  train_dataset=grouped, data_collator=default_data_collator)
    assert not [w for w in caught if "fixed-length blocks" in str(w.message)]


def test_chunk_documents_never_crosses_a_document():
    docs = documents(5)
    chunks = chunk_documents(docs, block_size=4)
    for doc_id in range(len(docs)):
        mine = [row["input_ids"] for row in chunks if row["document_id"] == doc_id]
        assert list(chain(*mine)) == docs[doc_id]["input_ids"]  # in order, complete, nothing of another document
        assert all(1 <= len(c) <= 4 for c in mine)
    assert chunks["labels"] == chunks["input_ids"]
