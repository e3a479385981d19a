"""DP reward modelling with trl (``hf_dp/reward.py``): ``DPRewardTrainer`` / ``DPRewardConfig``.

The oracle (float64, σ = 0, q = 1): one step of SGD with lr = 1 moves the parameters by ``-(1/N) Σ_r clip(∇L_r)``
where ``L_r`` is **trl's own reward loss** (``RewardTrainer.compute_loss``: pairwise ``-log σ(r_c - r_r - margin)``,
plus ``center_rewards_coefficient·(r_c + r_r)²``) on a batch of ONE preference row, collated by trl, from a plain
trl ``RewardTrainer`` on a copy of the same model.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from helpers import VOCAB, assert_refused_before_any_release, assert_updates_close, chat_tokenizer
from helpers import one_step_against_oracle as dp_update  # noqa: E402
from helpers.preference import padding_dependent

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from transformers import GPT2Config, GPT2ForSequenceClassification, LlamaConfig, LlamaForSequenceClassification  # noqa: E402, E501
from trl import RewardConfig, RewardTrainer  # noqa: E402

from hf_dp import DPRewardConfig, DPRewardTrainer, DPTrainingArguments  # noqa: E402

ROWS = [("hello how are you", " fine thanks", " a dog ran"),
        ("what is your name", " my name is bot", " the cat"),
        ("hi", " good day", " the cat sat on a mat"),
        ("a dog ran", " on the mat", " hello")]


def tiny_llama_reward():
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, num_labels=1,
                      pad_token_id=0, bos_token_id=0, eos_token_id=1)
    return LlamaForSequenceClassification(cfg)


def tiny_gpt2_reward():
    cfg = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, num_labels=1, pad_token_id=0, bos_token_id=0, eos_token_id=1)
    return GPT2ForSequenceClassification(cfg)


def pairs(n: int = 4, margin: bool = False, users: list[str] | None = None) -> Dataset:
    rows = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in ROWS[:n]]
    for i, row in enumerate(rows):
        if margin:
            row["margin"] = 0.25 * i
        if users is not None:
            row["user"] = users[i]
    return Dataset.from_list(rows)


def reward_args(tmp_path, per_device: int = 2, ga: int = 2, **kw) -> DPRewardConfig:
    """One exact step. trl keeps activation checkpointing on, so flat clipping would take two passes ("auto"); here
    it is book-keeping (``flat_clipping_passes="one"``), exact to round-off, unless a test asks for two passes."""
    kw.setdefault("flat_clipping_passes", "one")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DPRewardConfig(**{
            "output_dir": str(tmp_path), "noise_multiplier": 0.0, "per_sample_max_grad_norm": 1.0,
            "per_device_train_batch_size": per_device, "gradient_accumulation_steps": ga, "max_steps": 1,
            "learning_rate": 1.0, "optim": "sgd", "lr_scheduler_type": "constant", "weight_decay": 0.0,
            "use_cpu": True, "report_to": "none", "save_strategy": "no", "dp_seed": 0, "disable_tqdm": True,
            "logging_strategy": "no", "max_length": 64, **kw,
        })


def make_trainer(model, data, args, **kw) -> DPRewardTrainer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DPRewardTrainer(model=model, args=args, train_dataset=data, processing_class=chat_tokenizer(), **kw)


def row_grads(model, data, args: DPRewardConfig, tmp_path, **kw) -> list[dict[str, torch.Tensor]]:
    """Each row's gradient of trl's own reward loss on a batch of that row alone (a plain trl RewardTrainer)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = RewardConfig(output_dir=str(tmp_path / "oracle"), use_cpu=True, report_to="none", bf16=False,
                              gradient_checkpointing=False, max_length=args.max_length, seed=args.seed,
                              center_rewards_coefficient=args.center_rewards_coefficient)
        oracle = RewardTrainer(model=model, args=config, train_dataset=data, processing_class=chat_tokenizer(), **kw)
    model = oracle.model
    model.train()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out = []
    for i in range(len(oracle.train_dataset)):
        model.zero_grad(set_to_none=True)
        oracle.compute_loss(model, oracle.data_collator([oracle.train_dataset[i]])).backward()
        out.append({n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in params.items()})
    return out


def test_config_is_rewardconfig_plus_dp_arguments(tmp_path):
    args = reward_args(tmp_path)
    assert isinstance(args, RewardConfig) and isinstance(args, DPTrainingArguments)
    assert args.gradient_checkpointing is True and args.max_grad_norm == 0.0  # trl's default (checkpointing.py)
    with pytest.raises(TypeError, match="DPRewardConfig"):
        make_trainer(tiny_llama_reward(), pairs(), RewardConfig(output_dir=str(tmp_path), use_cpu=True))
    with pytest.raises(ValueError, match="activation_offloading"):
        reward_args(tmp_path, activation_offloading=True)


@pytest.mark.parametrize("build, extra", [
    (tiny_llama_reward, {}),
    (tiny_llama_reward, {"margin": True, "center_rewards_coefficient": 0.05}),
    (tiny_gpt2_reward, {"margin": True}),
    (tiny_llama_reward, {"flat_clipping_passes": "two"}),
], ids=["llama", "llama_margin_centered", "gpt2_margin", "llama_two_pass"])
def test_update_equals_trl_reward_loss_per_row(tmp_path, build, extra):
    """q = 1 (2 rows × GA 2 = N = 4), σ = 0, float64: Σ_r clip(∇ trl_reward_loss(row r)) / 4, the pair clipped as
    one unit (margins and the reward-centering term are the row's own). Two passes (trl's checkpointing on): pass 2
    is the model's own backward, Llama's RMSNorm rounds in float32 inside, hence 1e-5."""
    extra = dict(extra)
    tol = dict(rtol=1e-5, atol=1e-8) if extra.get("flat_clipping_passes") == "two" else {}
    data = pairs(margin=extra.pop("margin", False))
    torch.manual_seed(0)
    model = build().double()
    args = reward_args(tmp_path, **extra)
    grads = row_grads(copy.deepcopy(model), data, args, tmp_path)
    trainer = make_trainer(model, data, args)
    update, expected = dp_update(trainer, grads, expected_batch=4)
    assert_updates_close(update, expected, **tol)


def test_label_smoothing_factor_is_ignored_as_trl_does(tmp_path):
    """trl's reward loss never reads ``label_smoothing_factor``; with it set (on a num_labels=1 head, which the
    Trainer's label smoother could not take) the update is still trl's pairwise loss per row."""
    torch.manual_seed(0)
    model = tiny_llama_reward().double()
    args = reward_args(tmp_path, label_smoothing_factor=0.1)
    grads = row_grads(copy.deepcopy(model), pairs(), args, tmp_path)
    update, expected = dp_update(make_trainer(model, pairs(), args), grads, expected_batch=4)
    assert_updates_close(update, expected)


def test_lora_update_equals_trl_reward_loss_per_row(tmp_path):
    """LoRA through trl's peft_config (the score head trained in full, as PEFT's SEQ_CLS task saves it)."""
    from peft import LoraConfig

    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                      init_lora_weights=False, task_type="SEQ_CLS")
    torch.manual_seed(0)
    model = tiny_llama_reward().double()
    args = reward_args(tmp_path)
    grads = row_grads(copy.deepcopy(model), pairs(), args, tmp_path, peft_config=lora)
    trainer = make_trainer(model, pairs(), args, peft_config=lora)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable == set(grads[0]) and any("lora_" in n for n in trainable)
    update, expected = dp_update(trainer, grads, expected_batch=4)
    assert_updates_close(update, expected)


def test_neighbouring_rows_move_the_summed_update_by_at_most_c(tmp_path):
    c = 1e-3
    sums = []
    for m in (4, 3):
        torch.manual_seed(0)
        trainer = make_trainer(tiny_llama_reward().double(), pairs(m),
                               reward_args(tmp_path / str(m), per_device=m, ga=1, per_sample_max_grad_norm=c))
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        sums.append({n: (before[n] - p.detach()) * m for n, p in trainer.model.named_parameters()})
    moved = math.sqrt(sum(float((sums[0][n] - sums[1][n]).pow(2).sum()) for n in sums[0]))
    assert c * 0.5 < moved <= c * (1 + 1e-6)


def test_user_level_a_users_pairs_are_one_unit(tmp_path):
    """privacy_unit='user' (mean over a user's rows): ann has rows 0, 1, 3 and bob row 2."""
    torch.manual_seed(0)
    model = tiny_llama_reward().double()
    data = pairs(users=["ann", "ann", "bob", "ann"])
    args = reward_args(tmp_path, per_device=2, ga=1, privacy_unit="user", user_id_column="user")
    grads = row_grads(copy.deepcopy(model), data, args, tmp_path)
    users = [{n: (grads[0][n] + grads[1][n] + grads[3][n]) / 3 for n in grads[0]}, grads[2]]
    trainer = make_trainer(model, data, args)
    update, expected = dp_update(trainer, users, expected_batch=2)
    assert_updates_close(update, expected)


# ---------------------------------------------------------------------- a row's loss is its own (DESIGN invariant 12)
def mean_margin_collator():
    """A collator that mixes rows through a batch statistic: every row's margin becomes the batch's mean margin (the
    tokens are untouched, so PairedRows passes them)."""
    from trl.trainer.reward_trainer import DataCollatorForPreference

    class MeanMargin(DataCollatorForPreference):
        def torch_call(self, examples):
            batch = super().torch_call(examples)
            batch["margin"] = batch["margin"].mean().expand_as(batch["margin"]).clone()
            return batch

    return MeanMargin(pad_token_id=0)


@pytest.mark.parametrize("leak", [None, "collator", "model"])
def test_each_row_compared_with_itself_alone_leaks_refused(tmp_path, monkeypatch, leak):
    """As for DPO (tests/test_dpo.py): honest rows pass the counterfactual check on both batches; a collator that
    mixes the rows' margins, or rewards that depend on the batch's padded length, are refused before any update."""
    from hf_dp import counterfactual
    from hf_dp.clipping.rules import UnsupportedLayerError

    checked = []
    check = counterfactual.check_examples_alone

    def spy(*args, **kwargs):
        checked.append(kwargs["what"])
        return check(*args, **kwargs)

    monkeypatch.setattr(counterfactual, "check_examples_alone", spy)
    torch.manual_seed(0)
    kw = {"data_collator": mean_margin_collator()} if leak == "collator" else {}
    trainer = make_trainer(tiny_llama_reward().double(), pairs(4, margin=True),
                           reward_args(tmp_path, per_device=2, ga=2), **kw)
    if leak == "model":
        padding_dependent(trainer.model)
    if leak is None:
        trainer.train()
        assert trainer.accountant.steps == 1
        assert checked == [" (the first micro-batch)", " (a batch of the training set's shortest and longest rows)"]
        return
    assert_refused_before_any_release(trainer, "depends on the other rows of its batch", UnsupportedLayerError)
    assert checked


def test_a_non_finite_row_counts_once(tmp_path):
    """A row whose margin is NaN (loss and gradient NaN: clipping factor 0) is one non-finite example, not two (one
    per sequence), and the logged loss is the mean over the other rows of trl's loss on each row alone (not over
    their sequences)."""
    torch.manual_seed(0)
    model = tiny_llama_reward().double()
    data = pairs(4, margin=True)
    data = data.map(lambda row, i: {"margin": math.nan if i == 2 else row["margin"]}, with_indices=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = RewardConfig(output_dir=str(tmp_path / "oracle"), use_cpu=True, report_to="none", bf16=False,
                              gradient_checkpointing=False, max_length=64)
        oracle = RewardTrainer(model=copy.deepcopy(model), args=config, train_dataset=data,
                               processing_class=chat_tokenizer())
    with torch.no_grad():
        losses = [float(oracle.compute_loss(oracle.model, oracle.data_collator([oracle.train_dataset[i]])))
                  for i in range(4)]
    assert math.isnan(losses[2])
    trainer = make_trainer(model, data, reward_args(tmp_path, per_device=2, ga=2, logging_strategy="steps",
                                                    logging_steps=1))
    result = trainer.train()
    assert trainer.accountant.steps == 1 and trainer.nonfinite_examples == 1
    logged = [e for e in trainer.state.log_history if "nonfinite_examples" in e]
    assert [e["nonfinite_examples"] for e in logged] == [1]
    finite = [x for x in losses if not math.isnan(x)]
    assert result.training_loss == pytest.approx(sum(finite) / len(finite), rel=1e-9)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_card_checkpoint_and_resume(tmp_path):
    from huggingface_hub import ModelCard

    common = {"per_device": 1, "ga": 1, "noise_multiplier": 1.0, "max_steps": 2, "learning_rate": 1e-3,
              "target_delta": 1e-2, "dp_self_check": False}
    trainer = make_trainer(tiny_llama_reward(), pairs(), reward_args(tmp_path, save_strategy="steps", save_steps=1,
                                                                     **common), eval_dataset=pairs(2))
    trainer.train()
    trainer.evaluate()  # trl's own loss and metrics in evaluation
    assert any("eval_accuracy" in entry for entry in trainer.state.log_history)
    card = ModelCard.load(tmp_path / "checkpoint-1" / "README.md")
    assert {"trl", "reward-trainer", "differential-privacy"} <= set(card.data.tags)
    dp = card.data.differential_privacy
    assert dp["dataset_size"] == 4 and dp["sampling_rate"] == 0.25 and "preference row" in dp["example_description"]
    resumed = make_trainer(tiny_llama_reward(), pairs(), reward_args(tmp_path, **common))
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert resumed.accountant.steps == 2
