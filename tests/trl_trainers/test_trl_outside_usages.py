"""Ordinary trl usages (DP-SFT, DP-DPO, DP-reward) found by an outside probe (session 10) that broke the guarantee or
stopped a run with an untrue cause, each closed by the invariant it violated.

The probe (tiny random-init models, float64, σ = 0, q = 1) compared each usage's summed clipped update with the oracle:
trl's own loss on each unit collated alone by trl. Most usages held (the report lists them); these did not:

* The loss of a unit is the model's own loss on it (DESIGN invariant 9): a prompt-learning adapter (prompt tuning,
  P-tuning) prepends virtual tokens to the logits, which trl skips (``log_probs[:, -seq_len:]``); DP-DPO aligned the
  log-probs with the first positions instead and stopped at the first step with a bare shape error. Now the same
  alignment as trl: exact against trl's loss per row.
* A privacy unit is one example a collator can collate (invariants 8, 11): a user-tokenised SFT row with no tokens
  (``skip_prepare_dataset``) cannot be collated (padded: a float tensor; packed: no segment) and stopped the run when
  Poisson sampling first drew it, after steps were released. Refused before training, with the row.
* A refusal says what to do (common rules): DP-SFT on a Mixture-of-Experts model with trl's defaults was refused
  with "set model.config.output_router_logits = False", which cannot help (trl turns it back on from
  ``router_aux_loss_coef``, the architecture's own coefficient by default). Now it names ``router_aux_loss_coef=0.0``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import (
    VOCAB,
    assert_refused_before_any_release,
    assert_updates_close,
    chat_tokenizer,
    make_sft_trainer,
    sft_args,
    sft_dataset,
    tiny_llama,
)
from helpers import one_step_against_oracle as dp_update
from helpers.chat import PAIRS
from helpers.preference import dpo_args, dpo_row_grads, dpo_trl_oracle, make_dpo_trainer, pairs

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402


# ---------------------------------------------------------------------- DPO: a unit's loss is trl's loss on it
@pytest.mark.parametrize("adapter", ["prompt_tuning", "p_tuning"])
def test_dpo_prompt_learning_adapter_equals_trl_loss_per_row(tmp_path, adapter):
    """Prompt tuning / P-tuning through ``peft_config=``: the policy's logits carry the virtual tokens first, the
    reference's (adapter disabled) do not. q = 1 (N = 4), σ = 0, the prompt encoder in float64: the update is
    Σ_r clip(∇ trl_loss(row r)) / 4. Unfixed: RuntimeError (size mismatch) at the first step."""
    import peft

    config = {"prompt_tuning": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2),
              "p_tuning": lambda: peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=2,
                                                           encoder_hidden_size=8)}[adapter]()
    torch.manual_seed(0)
    model = tiny_llama().double()
    args = dpo_args(tmp_path)
    oracle = dpo_trl_oracle(copy.deepcopy(model), pairs(), args, tmp_path, peft_config=config)
    trainer = make_dpo_trainer(model, pairs(), args, peft_config=copy.deepcopy(config))
    for net in (oracle.model, trainer.model):
        net.prompt_encoder.double()  # PEFT builds it in float32; float64 for an exact comparison
    torch.manual_seed(1)
    start = {n: torch.randn_like(p) * 0.5 for n, p in oracle.model.named_parameters() if p.requires_grad}
    for net in (oracle.model, trainer.model):
        for n, p in net.named_parameters():
            if n in start:
                p.data.copy_(start[n])
    grads = dpo_row_grads(oracle, list(range(4)))
    assert set(grads[0]) == set(start) and all(n.startswith("prompt_encoder") for n in start)
    update, expected = dp_update(trainer, grads, expected_batch=4)
    assert_updates_close(update, expected)


# ---------------------------------------------------------------------- SFT: every row is an example
def tokenised_rows_with_an_empty_one() -> Dataset:
    tok = chat_tokenizer()
    return Dataset.from_list([{"input_ids": tok(f"{p} {c}")["input_ids"]} for p, c in PAIRS] + [{"input_ids": []}])


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_sft_row_without_tokens_refused_before_training(tmp_path, packing):
    """A user-tokenised training set (``skip_prepare_dataset``) with a row of no tokens: unchecked, the padded run
    crashed with torch's dtype error and the packed one with a segment-count error whenever that row was drawn —
    after released steps (step 3 with ``dp_seed=3``). Refused at construction, naming the row."""
    args = sft_args(tmp_path, per_device=2, ga=1, packing=packing, dataset_kwargs={"skip_prepare_dataset": True})
    with pytest.raises(ValueError, match=r"Row 4 of the training set has no tokens \(empty input_ids\)"):
        make_sft_trainer(tiny_llama().double(), tokenised_rows_with_an_empty_one(), args)


def test_sft_row_without_tokens_refused_at_train_start_after_a_replaced_training_set(tmp_path):
    """The training set replaced after construction (``trainer.train_dataset = ...``) is checked again at train
    start, before anything is released."""
    rows = tokenised_rows_with_an_empty_one()
    args = sft_args(tmp_path, per_device=2, ga=1, dataset_kwargs={"skip_prepare_dataset": True})
    trainer = make_sft_trainer(tiny_llama().double(), rows.select(range(4)), args)
    trainer.train_dataset = rows
    assert_refused_before_any_release(trainer, r"Row 4 of the training set has no tokens")


# ---------------------------------------------------------------------- SFT: a refusal says what to do
def test_sft_moe_load_balancing_loss_refused_naming_router_aux_loss_coef(tmp_path):
    """trl's defaults (``router_aux_loss_coef=None``: Mixtral's own 0.001) add the batch's load-balancing loss; the
    model's config had ``output_router_logits=False``, which trl overrides. Refused naming the setting that turns it
    off, and with it off the trainer is built (each example's own token loss)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    def moe():
        return MixtralForCausalLM(MixtralConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=1, max_position_embeddings=64,
            pad_token_id=0, bos_token_id=0, eos_token_id=1))

    model = moe()
    assert model.config.output_router_logits is False
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=0.001: trl adds .* Set router_aux_loss_coef=0.0 in "
                                         r"DPSFTConfig"):
        make_sft_trainer(model, sft_dataset("text"), sft_args(tmp_path))
    trainer = make_sft_trainer(moe(), sft_dataset("text"), sft_args(tmp_path, router_aux_loss_coef=0.0))
    assert trainer.model.config.output_router_logits is False and trainer.task == "causal_lm"
