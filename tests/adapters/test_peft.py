"""PEFT adapters under DP are exact: LoRA (Linear and GPT-2 Conv1D targets), prefix tuning, prompt tuning, P-tuning.

The oracle is the PeftModel's own loss on a batch of one (``helpers.single_example_loss``): what PEFT and the plain
``Trainer`` train, including the last virtual token's prediction of the first real token under prompt learning.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    check_update,
    cls_dataset,
    dp_args,
    lm_dataset,
    p_tuning,
    run_group_step,
    seq2seq_dataset,
    t5_frozen_bias,
    tiny_bert,
    tiny_gpt2,
    tiny_llama,
)
from peft import (
    AdaLoraConfig,
    LoHaConfig,
    LoKrConfig,
    LoraConfig,
    PrefixTuningConfig,
    PromptTuningConfig,
    TaskType,
    get_peft_model,
)

from hf_dp import DPTrainer, UnsupportedLayerError


def lora_gpt2():
    # c_attn is a transformers Conv1D: PEFT wraps it with fan_in_fan_out; dropout 0 so the oracle is deterministic.
    cfg = LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"],
                     lora_dropout=0.0, fan_in_fan_out=True)
    return get_peft_model(tiny_gpt2(), cfg)


def lora_bert():
    cfg = LoraConfig(task_type=TaskType.SEQ_CLS, r=2, lora_alpha=4, target_modules=["query", "value"],
                     lora_dropout=0.0)
    return get_peft_model(tiny_bert(num_labels=2), cfg)


def prefix_gpt2(projection: bool):
    cfg = PrefixTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=3, prefix_projection=projection,
                             encoder_hidden_size=8)
    return get_peft_model(tiny_gpt2(), cfg)


def prompt_gpt2():
    return get_peft_model(tiny_gpt2(), PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4))


def prompt_bert():
    return get_peft_model(tiny_bert(num_labels=2), PromptTuningConfig(task_type=TaskType.SEQ_CLS,
                                                                      num_virtual_tokens=3))


def prompt_t5(submodules: int):
    cfg = PromptTuningConfig(task_type=TaskType.SEQ_2_SEQ_LM, num_virtual_tokens=3,
                             num_transformer_submodules=submodules)
    return get_peft_model(t5_frozen_bias(), cfg)


def _nonzero_init(model):
    """LoRA's B starts at zero (so A gets no gradient at step 0): randomise it so both factors are tested."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


def adalora_llama(orth_reg_weight: float = 0.0):
    """AdaLoRA's E starts at zero (so A and B get no gradient at step 0): randomise it so all three are tested."""
    cfg = AdaLoraConfig(task_type=TaskType.CAUSAL_LM, init_r=4, target_r=2, target_modules=["q_proj", "v_proj"],
                        total_step=10, lora_dropout=0.0, orth_reg_weight=orth_reg_weight)
    model = get_peft_model(tiny_llama(), cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_E" in name:
                p.normal_(0, 0.1)
    return model


CASES = {
    "lora_gpt2_conv1d": (lambda: _nonzero_init(lora_gpt2()), lambda: lm_dataset(6)),
    "lora_bert": (lambda: _nonzero_init(lora_bert()), lambda: cls_dataset(6, 2)),
    "adalora_llama": (adalora_llama, lambda: lm_dataset(6)),
    "prefix_gpt2": (lambda: prefix_gpt2(False), lambda: lm_dataset(6)),
    "prefix_gpt2_projection": (lambda: prefix_gpt2(True), lambda: lm_dataset(6)),
    "prompt_gpt2": (prompt_gpt2, lambda: lm_dataset(6)),
    "prompt_bert": (prompt_bert, lambda: cls_dataset(6, 2)),
    "prompt_llama": (lambda: get_peft_model(tiny_llama(), PromptTuningConfig(task_type=TaskType.CAUSAL_LM,
                                                                            num_virtual_tokens=2)),
                     lambda: lm_dataset(6, seed=2)),
    "prompt_t5": (lambda: prompt_t5(1), lambda: seq2seq_dataset(6)),
    "prompt_t5_two_submodules": (lambda: prompt_t5(2), lambda: seq2seq_dataset(6)),
    "prefix_t5": (lambda: get_peft_model(t5_frozen_bias(), PrefixTuningConfig(task_type=TaskType.SEQ_2_SEQ_LM,
                                                                            num_virtual_tokens=3)),
                  lambda: seq2seq_dataset(6)),
    "p_tuning_gpt2": (lambda: p_tuning(tiny_gpt2(), TaskType.CAUSAL_LM), lambda: lm_dataset(6)),
    "p_tuning_bert": (lambda: p_tuning(tiny_bert(num_labels=2), TaskType.SEQ_CLS), lambda: cls_dataset(6, 2)),
    "p_tuning_t5": (lambda: p_tuning(t5_frozen_bias(), TaskType.SEQ_2_SEQ_LM), lambda: seq2seq_dataset(6)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_adapter_flat_clipping_matches_oracle(tmp_path, case):
    torch.manual_seed(0)
    make_model, make_data = CASES[case]
    model = make_model()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(("lora" in n or "prompt_encoder" in n or "classifier" in n or "score" in n)
                             for n in trainable), trainable
    check_update(model, make_data(), tmp_path, per_device=2, ga=3)


@pytest.mark.parametrize("case", ["lora_gpt2_conv1d", "prefix_gpt2_projection", "prompt_gpt2", "p_tuning_gpt2"])
def test_adapter_per_layer_clipping_matches_oracle(tmp_path, case):
    torch.manual_seed(1)
    make_model, make_data = CASES[case]
    run_group_step(make_model(), make_data(), tmp_path, "per_layer", thresholds="median")


def test_peft_config_argument_wraps_the_model(tmp_path):
    torch.manual_seed(2)
    cfg = LoraConfig(task_type=TaskType.CAUSAL_LM, r=2, target_modules=["c_attn"], lora_dropout=0.1,
                     fan_in_fan_out=True)
    trainer = DPTrainer(model=tiny_gpt2(), args=dp_args(tmp_path, 2, 1, 1.0), train_dataset=lm_dataset(8),
                        peft_config=cfg)
    assert all("lora" in n for n in trainer.clipping_engine.params)
    trainer.args.max_steps = 2
    trainer.train()  # with LoRA dropout on: runs, self-check (dropout off) passes
    assert trainer.accountant.steps == 2
    with pytest.raises(ValueError, match="already a PeftModel"):
        DPTrainer(model=lora_gpt2(), args=dp_args(tmp_path, 2, 1, 1.0), train_dataset=lm_dataset(8), peft_config=cfg)


def test_adalora_orthogonal_regularization_is_refused(tmp_path):
    """AdaLoRA's own loss adds orth_reg_weight · R(lora_A, lora_B) (PEFT's default 0.5), which the per-example loss
    does not train: refused at construction, with orth_reg_weight=0.0 as the way forward (exact: CASES above)."""
    with pytest.raises(ValueError, match="orth_reg_weight=0.0"):
        DPTrainer(model=adalora_llama(0.5), args=dp_args(tmp_path, 2, 1, 1.0), train_dataset=lm_dataset(4))
    cfg = AdaLoraConfig(task_type=TaskType.CAUSAL_LM, init_r=4, target_r=2, target_modules=["q_proj"], total_step=10)
    with pytest.raises(ValueError, match="orthogonality penalty"):
        DPTrainer(model=tiny_llama(), args=dp_args(tmp_path, 2, 1, 1.0), train_dataset=lm_dataset(4), peft_config=cfg)


def test_trainable_tokens_untied_matches_oracle(tmp_path):
    """``trainable_token_indices`` (PEFT's new-token rows, by the generic fallback) with LoRA, untied embeddings."""
    torch.manual_seed(0)
    model = get_peft_model(tiny_llama(), LoraConfig(task_type=TaskType.CAUSAL_LM, r=2, target_modules=["q_proj"],
                                                    trainable_token_indices=[3, 5, 7], lora_dropout=0.0))
    assert any("trainable_tokens_delta" in n for n, p in model.named_parameters() if p.requires_grad)
    check_update(model, lm_dataset(6), tmp_path, per_device=2, ga=3)


@pytest.mark.parametrize("make, match", [
    (lambda: get_peft_model(tiny_llama(), LoHaConfig(task_type=TaskType.CAUSAL_LM, r=2,
                                                     target_modules=["q_proj", "v_proj"])), r"\(loha\).*`LoraConfig`"),
    (lambda: get_peft_model(tiny_llama(), LoKrConfig(task_type=TaskType.CAUSAL_LM, r=2,
                                                     target_modules=["q_proj", "v_proj"])), r"\(lokr\).*`LoraConfig`"),
    (lambda: get_peft_model(tiny_gpt2(), LoraConfig(task_type=TaskType.CAUSAL_LM, r=2, target_modules=["c_attn"],
                                                    trainable_token_indices=[3, 5], fan_in_fan_out=True)),
     r"trainable tokens.*tied.*tie_word_embeddings=False"),
], ids=["loha", "lokr", "trainable_tokens_tied"])
def test_adapter_refusal_names_the_adapter_kind_and_the_way_forward(tmp_path, make, match):
    """Adapters whose weight delta PEFT builds outside any hooked layer (LoHa, LoKr; trainable tokens on tied
    embeddings, also applied in the LM head) are refused at the first step; the advice is about the adapter the user
    chose (use LoRA; untie or drop the trainable tokens), not about narrowing "all-linear", which they did not use."""
    torch.manual_seed(0)
    trainer = DPTrainer(model=make(), args=dp_args(tmp_path, 2, 1, 1.0), train_dataset=lm_dataset(4))
    with pytest.raises(UnsupportedLayerError, match=match) as err:
        trainer.train()
    assert "all-linear" not in str(err.value) and trainer.accountant.steps == 0


@pytest.mark.parametrize("case", ["prompt_gpt2", "p_tuning_gpt2"])
def test_prompt_tuning_inference_unchanged(case):
    """The per-example prompt encoding gives the same outputs as PEFT's own path, in train and eval mode."""
    torch.manual_seed(3)
    model = CASES[case][0]()
    ids = torch.randint(2, 50, (3, 5))
    model.eval()
    before = model(input_ids=ids).logits
    from hf_dp.peft_support import per_example_prompts

    per_example_prompts(model)
    torch.testing.assert_close(model(input_ids=ids).logits, before)
    model.train()
    torch.testing.assert_close(model(input_ids=ids).logits, before)


def test_prompt_tuning_loss_keeps_first_real_token_target():
    """PEFT pads the labels of the virtual tokens with -100 *before* the causal shift: the last virtual token's
    logits predict the first real token. hf_dp's per-example loss is that loss, example by example."""
    from hf_dp.losses import causal_lm_loss

    torch.manual_seed(4)
    model = prompt_gpt2().double().eval()
    data = lm_dataset(3, seed=4)
    batch = {k: torch.tensor(data[k]) for k in data.column_names}
    ours = causal_lm_loss(model(**{k: v for k, v in batch.items() if k != "labels"}), batch["labels"])
    for i in range(3):
        own = model(**{k: v[i:i + 1] for k, v in batch.items()}).loss
        torch.testing.assert_close(ours[i], own.double(), rtol=1e-6, atol=1e-8)


def test_p_tuning_lstm(tmp_path):
    """P-tuning's LSTM reparameterisation (clipping/recurrent.py): the update matches the oracle."""
    torch.manual_seed(5)
    check_update(p_tuning(tiny_gpt2(), TaskType.CAUSAL_LM, reparam="LSTM"), lm_dataset(6), tmp_path, 2, 3)
