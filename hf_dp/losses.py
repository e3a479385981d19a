"""Per-example losses: what DP-SGD clips is each example's own loss (DESIGN invariant 2).

Hugging Face models return one batch loss whose denominator (``num_items_in_batch``, or the number of tokens in the
micro-batch) depends on the other examples. Clipping the gradient of such a loss does not bound an example's
contribution. Here each example's loss is the mean over *its own* non-ignored tokens (Li et al. 2022, §2: the
per-example objective of DP-SGD), computed from the model's logits.

A per-example loss function has the signature ``fn(outputs, labels) -> Tensor[B]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.auto import modeling_auto as auto

__all__ = [
    "PerExampleLoss",
    "causal_lm_loss",
    "token_loss",
    "sequence_classification_loss",
    "default_per_example_loss",
    "decoder_input_ids_from_labels",
]

PerExampleLoss = Callable[[Any, torch.Tensor], torch.Tensor]
IGNORE_INDEX = -100


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """Losses are computed in at least float32 (half-precision logits under autocast are upcast)."""
    return x if x.dtype == torch.float64 else x.float()


def _mean_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy averaged over each example's own labelled tokens; an example with none has loss 0."""
    b = labels.shape[0]
    per_token = F.cross_entropy(
        _upcast(logits.reshape(-1, logits.shape[-1])), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(b, -1)
    counts = labels.reshape(b, -1).ne(IGNORE_INDEX).sum(1)
    return per_token.sum(1) / counts.clamp(min=1)


def _logits(outputs: Any) -> torch.Tensor:
    return outputs["logits"] if isinstance(outputs, dict) else outputs.logits


def _token_logits(outputs: Any, labels: torch.Tensor) -> torch.Tensor:
    """The logits of the labelled positions, for unshifted token losses: prompt-learning adapters (PEFT prompt
    tuning, P-tuning) prepend virtual tokens, whose logits come first and have no labels."""
    logits = _logits(outputs)
    return logits[:, logits.shape[1] - labels.shape[1]:] if logits.shape[1] > labels.shape[1] else logits


def causal_lm_loss(outputs: Any, labels: torch.Tensor) -> torch.Tensor:
    """Next-token loss: logits at ``t`` predict ``labels[t + 1]`` (the shift HF causal LMs apply internally).

    Under prompt learning (PEFT prompt tuning / P-tuning) the logits also cover the ``n`` virtual tokens prepended to
    the input. PEFT pads the labels with ``n`` times -100 on the left before the model's shift
    (``PeftModelForCausalLM.forward``), so the last virtual token's logits predict the first real token: that target
    is part of the objective PEFT and the plain ``Trainer`` train, and it is kept here.
    """
    logits = _logits(outputs)
    virtual = logits.shape[1] - labels.shape[1]
    if virtual > 0:
        labels = F.pad(labels, (virtual, 0), value=IGNORE_INDEX)
    # Shift the labels, not the logits (as HF's ForCausalLMLoss does): slicing (B, T, V) logits would copy them.
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    return _mean_token_loss(logits, shifted)


def token_loss(outputs: Any, labels: torch.Tensor) -> torch.Tensor:
    """Unshifted token loss: masked LM, token classification, seq2seq decoder labels."""
    return _mean_token_loss(_token_logits(outputs, labels), labels)


def sequence_classification_loss(problem_type: str | None = None, num_labels: int | None = None) -> PerExampleLoss:
    """Per-example loss of HF ``*ForSequenceClassification`` heads, following ``config.problem_type``."""

    def loss(outputs: Any, labels: torch.Tensor) -> torch.Tensor:
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
        kind = problem_type
        if kind is None:
            if num_labels == 1:
                kind = "regression"
            elif labels.dtype in (torch.long, torch.int):
                kind = "single_label_classification"
            else:
                kind = "multi_label_classification"
        if kind == "regression":
            err = (_upcast(logits).squeeze(-1) - labels.to(_upcast(logits).dtype).squeeze(-1)) ** 2
            return err.reshape(err.shape[0], -1).mean(1)
        if kind == "single_label_classification":
            return F.cross_entropy(_upcast(logits).view(-1, logits.shape[-1]), labels.view(-1), reduction="none")
        bce = F.binary_cross_entropy_with_logits(_upcast(logits), labels.to(_upcast(logits).dtype), reduction="none")
        return bce.reshape(bce.shape[0], -1).mean(1)

    return loss


def _class_names(mapping: Any) -> set[str]:
    names: set[str] = set()
    for v in mapping.values():
        names.update(v if isinstance(v, (list, tuple)) else [v])
    return names


def _base_model(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def decoder_input_ids_from_labels(model: nn.Module, labels: torch.Tensor) -> torch.Tensor | None:
    """The decoder inputs an encoder-decoder model's own forward builds from ``labels`` (teacher forcing).

    Mirrors the model exactly, by the model's own code: ``prepare_decoder_input_ids_from_labels`` where the model
    has it (BART, mBART, T5, Marian, Pegasus, ...), else its ``_shift_right`` (T5 family), else the
    ``shift_tokens_right(labels, pad_token_id, decoder_start_token_id)`` of the model's own module, which is what
    M2M100 / NLLB / Blenderbot(Small) call in ``forward``. ``None`` if none exists: the caller then passes
    ``labels=`` and lets the model build them (the model then also computes its batch loss, which is discarded).
    """
    import inspect
    import sys

    base = _base_model(model)
    prepare = getattr(base, "prepare_decoder_input_ids_from_labels", None)
    if callable(prepare):
        return prepare(labels=labels)
    shift = getattr(base, "_shift_right", None)
    if callable(shift):
        return shift(labels)
    shift = getattr(sys.modules.get(type(base).__module__), "shift_tokens_right", None)
    config = getattr(base, "config", None)
    if callable(shift) and config is not None:
        params = list(inspect.signature(shift).parameters)
        if params[1:] == ["pad_token_id", "decoder_start_token_id"]:
            return shift(labels, config.pad_token_id, config.decoder_start_token_id)
        if params[1:] == ["pad_token_id"]:
            return shift(labels, config.pad_token_id)
    return None


def default_per_example_loss(model: nn.Module) -> tuple[PerExampleLoss, str]:
    """Choose the per-example loss for a model by its head, as transformers' auto classes know it.

    Returns ``(loss_fn, task)`` with ``task`` in ``{"causal_lm", "masked_lm", "seq2seq_lm", "sequence_classification",
    "token_classification"}``. Raises ``ValueError`` for other heads: pass ``per_example_loss=`` to ``DPTrainer``.
    """
    base = _base_model(model)
    cls = type(base).__name__
    config = getattr(base, "config", None)
    if cls in _class_names(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) or cls.endswith(("LMHeadModel", "ForCausalLM")):
        return causal_lm_loss, "causal_lm"
    seq2seq = _class_names(auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
    if cls in seq2seq or cls.endswith("ForConditionalGeneration"):
        return token_loss, "seq2seq_lm"
    if cls in _class_names(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES) or cls.endswith("ForMaskedLM"):
        return token_loss, "masked_lm"
    if cls in _class_names(auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES) or cls.endswith("ForTokenClassification"):
        return token_loss, "token_classification"
    if cls in _class_names(auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES) or cls.endswith(
        "ForSequenceClassification"
    ):
        return (
            sequence_classification_loss(getattr(config, "problem_type", None), getattr(config, "num_labels", None)),
            "sequence_classification",
        )
    raise ValueError(
        f"hf_dp has no default per-example loss for {cls}. Pass `per_example_loss=fn` to DPTrainer, where "
        "fn(outputs, labels) returns one loss per example (shape [batch]) that depends on that example only."
    )
