"""PEFT adapters under DP: LoRA, prefix tuning, prompt tuning and P-tuning with exact per-example gradients.

* **LoRA** (``lora_A`` / ``lora_B`` are ``nn.Linear``, also around GPT-2 ``Conv1D`` with ``fan_in_fan_out``) and
  **prefix tuning** (``PrefixEncoder``: an ``nn.Embedding`` looked up with batch-expanded prompt tokens, optionally
  followed by a ``Linear``-``Tanh``-``Linear`` projection) need nothing special: their layers have rules.
* **Prompt tuning and P-tuning**: PEFT's ``get_prompt`` runs the prompt encoder once, on ``prompt_tokens[:1]``, and
  repeats the result over the batch (peft#2043), so the gradient reaching the encoder is already summed over
  examples and could not be clipped per example. :func:`per_example_prompts` makes the model encode the prompt for
  every example (the pre-#2043 behaviour), which gives identical outputs and exact per-example gradients. P-tuning's
  MLP reparameterisation is ``Linear``/``ReLU`` layers (exact); its LSTM one is exact through the clipping engine's
  recurrent layers (``clipping/recurrent.py``; ``encoder_dropout > 0`` is refused: its mask cannot be replayed).

Li et al. 2022 §5.2 compare these adapters with full fine-tuning under DP; Yu et al. 2024 use DP LoRA.
"""

from __future__ import annotations

import types
from typing import Any

from torch import nn

__all__ = ["is_peft_model", "apply_peft_config", "per_example_prompts", "adapter_summary"]


def is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, PeftModel)


def apply_peft_config(model: nn.Module, peft_config: Any) -> nn.Module:
    """``get_peft_model(model, peft_config)``, TRL-style; refuses a model that already is a ``PeftModel``."""
    from peft import PeftConfig, get_peft_model

    if not isinstance(peft_config, PeftConfig):
        raise TypeError(f"peft_config must be a peft.PeftConfig, got {type(peft_config).__name__}.")
    if is_peft_model(model):
        raise ValueError("The model is already a PeftModel; pass either a PeftModel or peft_config, not both.")
    return get_peft_model(model, peft_config)


def _active_config(model: nn.Module) -> Any:
    return model.peft_config[model.active_adapter]


def per_example_prompts(model: nn.Module) -> None:
    """For a prompt-tuning or P-tuning ``PeftModel``: encode the virtual tokens once per example (in place).

    PEFT's ``get_prompt`` encodes ``prompt_tokens[:1]`` and repeats the result ``batch_size`` times (peft#2043), so
    the gradient reaching the prompt encoder is summed over examples. Here the encoder sees the ``(B, n)`` index
    tensor instead: the prompts' values are identical, and every layer of the encoder (the embedding, and P-tuning's
    MLP head) sees each example's copy, so per-example gradients are exact. This also keeps the engine's expansion of
    batch-broadcast ids from meeting PEFT's own repeat (which made ``B²`` prompts and crashed P-tuning).
    No-op for other adapters and in inference mode (generation and evaluation use PEFT's own path).
    """
    from peft import PeftType

    if not is_peft_model(model) or _active_config(model).peft_type not in (PeftType.PROMPT_TUNING, PeftType.P_TUNING):
        return
    if getattr(model, "_hf_dp_per_example_prompts", False):
        return
    original = model.get_prompt

    def get_prompt(self, batch_size: int, task_ids: Any = None, *args: Any, **kwargs: Any):
        config = _active_config(self)
        if config.inference_mode or config.peft_type not in (PeftType.PROMPT_TUNING, PeftType.P_TUNING):
            return original(batch_size, task_ids, *args, **kwargs)
        encoder = self.prompt_encoder[self.active_adapter]
        # All num_virtual_tokens * num_transformer_submodules tokens, as PEFT's own path encodes them.
        tokens = self.prompt_tokens[self.active_adapter].unsqueeze(0).expand(batch_size, -1)
        return encoder(tokens.to(encoder.embedding.weight.device))

    model.get_prompt = types.MethodType(get_prompt, model)
    model._hf_dp_per_example_prompts = True


def adapter_summary(model: nn.Module) -> dict[str, Any]:
    """What is trained: ``{"method": "full" | "lora" | "prefix_tuning" | "prompt_tuning", "trainable_parameters"}``."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if not is_peft_model(model):
        return {"method": "full", "trainable_parameters": trainable}
    config = _active_config(model)
    return {"method": str(config.peft_type.value).lower(), "trainable_parameters": trainable,
            "peft_config": {k: v for k, v in config.to_dict().items() if isinstance(v, (int, float, str, bool, list))}}
