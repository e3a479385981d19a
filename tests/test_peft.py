"""PEFT adapters under DP are exact: LoRA (Linear and GPT-2 Conv1D targets), prefix tuning, prompt tuning."""

from __future__ import annotations

import pytest
import torch
from helpers import cls_dataset, lm_dataset, tiny_bert, tiny_gpt2
from peft import LoraConfig, PrefixTuningConfig, PromptTuningConfig, TaskType, get_peft_model
from test_groupwise import run_group_step
from test_oracle import check_update, dp_args

from hf_dp import DPTrainer


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


def _nonzero_init(model):
    """LoRA's B starts at zero (so A gets no gradient at step 0): randomise it so both factors are tested."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


CASES = {
    "lora_gpt2_conv1d": (lambda: _nonzero_init(lora_gpt2()), lambda: lm_dataset(6)),
    "lora_bert": (lambda: _nonzero_init(lora_bert()), lambda: cls_dataset(6, 2)),
    "prefix_gpt2": (lambda: prefix_gpt2(False), lambda: lm_dataset(6)),
    "prefix_gpt2_projection": (lambda: prefix_gpt2(True), lambda: lm_dataset(6)),
    "prompt_gpt2": (prompt_gpt2, lambda: lm_dataset(6)),
    "prompt_bert": (prompt_bert, lambda: cls_dataset(6, 2)),
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


@pytest.mark.parametrize("case", ["lora_gpt2_conv1d", "prefix_gpt2_projection", "prompt_gpt2"])
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


def test_prompt_tuning_inference_unchanged():
    """The per-example prompt lookup is used only in training; generation/eval use PEFT's own path."""
    torch.manual_seed(3)
    model = prompt_gpt2()
    ids = torch.randint(2, 50, (3, 5))
    model.eval()
    before = model(input_ids=ids).logits
    DPTrainer  # noqa: B018 - import kept for symmetry
    from hf_dp.peft_support import per_example_prompts

    per_example_prompts(model)
    torch.testing.assert_close(model(input_ids=ids).logits, before)
    model.train()
    torch.testing.assert_close(model(input_ids=ids).logits, before)
