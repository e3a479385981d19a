"""Per-example losses: what DP-SGD clips is each example's own loss (DESIGN invariant 2).

Hugging Face models return one batch loss whose denominator (``num_items_in_batch``, or the number of tokens in the
micro-batch) depends on the other examples. Clipping the gradient of such a loss does not bound an example's
contribution. Here each example's loss is the mean over *its own* non-ignored tokens (Li et al. 2022, §2: the
per-example objective of DP-SGD), computed from the model's logits.

Each default equals **the model's own loss on a batch of one** (``model(**one_example, labels=...).loss``: what the
plain ``Trainer``, PEFT or trl train for that example), head by head: the causal shift (and, under prompt learning,
PEFT's -100 labels for the virtual tokens), the seq2seq decoder inputs the model builds from ``labels``,
``config.problem_type`` for classification heads. The tests check each against exactly that
(``tests/helpers/oracle.py``).

A per-example loss function has the signature ``fn(outputs, labels) -> Tensor[B]``.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.auto import modeling_auto as auto

__all__ = [
    "PerExampleLoss",
    "causal_lm_loss",
    "causal_lm_targets",
    "mean_over_targets",
    "token_cross_entropy",
    "token_loss",
    "sequence_classification_loss",
    "cross_entropy_classification_loss",
    "question_answering_loss",
    "check_loss_per_example",
    "LabelSmoothedLoss",
    "label_smoothed_default",
    "smoothed_token_cross_entropy",
    "trainer_shifts_smoothed_labels",
    "user_loss_given",
    "check_models_own_loss",
    "labels_to_compare",
    "default_per_example_loss",
    "check_rows_are_examples",
    "decoder_input_ids_from_labels",
    "decoder_attention_mask_from_labels",
    "is_seq2seq_lm",
    "seq2seq_model_inputs",
]

PerExampleLoss = Callable[[Any, torch.Tensor], torch.Tensor]
IGNORE_INDEX = -100


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """Losses are computed in at least float32 (half-precision logits under autocast are upcast)."""
    return x if x.dtype == torch.float64 else x.float()


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy ``(B, T)`` of ``(B, T, V)`` logits (upcast to at least float32) against ``targets``;
    0 where the target is ``IGNORE_INDEX``."""
    return F.cross_entropy(_upcast(logits.reshape(-1, logits.shape[-1])), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="none").view(targets.shape[0], -1)


def mean_over_targets(per_token: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``(B,)``: each row's per-token losses averaged over its own labelled targets; a row with none has loss 0."""
    b = targets.shape[0]
    counts = targets.reshape(b, -1).ne(IGNORE_INDEX).sum(1)
    return per_token.reshape(b, -1).sum(1) / counts.clamp(min=1)


def _mean_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy averaged over each example's own labelled tokens; an example with none has loss 0."""
    return mean_over_targets(token_cross_entropy(logits, labels), labels)


def causal_lm_targets(labels: torch.Tensor, virtual: int = 0) -> torch.Tensor:
    """The target of each position of a causal LM: ``labels[t + 1]`` (``IGNORE_INDEX`` at the last position), after
    ``virtual`` ignored positions (prompt learning's virtual tokens, see :func:`causal_lm_loss`)."""
    if virtual > 0:
        labels = F.pad(labels, (virtual, 0), value=IGNORE_INDEX)
    # Shift the labels, not the logits (as HF's ForCausalLMLoss does): slicing (B, T, V) logits would copy them.
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def _logits(outputs: Any) -> torch.Tensor:
    logits = outputs.get("logits") if isinstance(outputs, dict) else getattr(outputs, "logits", None)
    if logits is None:
        raise ValueError(
            f"The model's output ({type(outputs).__name__}) has no logits: each example's loss is formed from the "
            "logits, and a forward that returns only a loss over the whole batch (e.g. a fused "
            "linear-cross-entropy, as use_liger_kernel=True installs) cannot be clipped per example. Make the forward "
            "return the logits in training, or pass per_example_loss=fn(outputs, labels) that returns one loss per "
            "example from what it does return."
        )
    return logits


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
    return _mean_token_loss(logits, causal_lm_targets(labels, logits.shape[1] - labels.shape[1]))


def token_loss(outputs: Any, labels: torch.Tensor) -> torch.Tensor:
    """Unshifted token loss: masked LM, token classification, seq2seq decoder labels."""
    return _mean_token_loss(_token_logits(outputs, labels), labels)


def _problem_type(config: Any, problem_type: str | None, num_labels: int | None, labels: torch.Tensor) -> str:
    """``config.problem_type`` as HF's ``ForSequenceClassificationLoss`` resolves it (read at call time)."""
    if config is not None:
        problem_type, num_labels = getattr(config, "problem_type", None), getattr(config, "num_labels", None)
    if problem_type is not None:
        return problem_type
    if num_labels == 1:
        return "regression"
    if labels.dtype in (torch.long, torch.int):
        return "single_label_classification"
    return "multi_label_classification"


def sequence_classification_loss(problem_type: str | None = None, num_labels: int | None = None,
                                 config: Any = None) -> PerExampleLoss:
    """Per-example loss of HF classification heads that follow ``config.problem_type`` (``*ForSequenceClassification``,
    ``*ForImageClassification``, ``*ForVideoClassification``, AST): HF's ``ForSequenceClassificationLoss`` on a batch
    of one. Regression: squared error (mean over the labels if ``num_labels > 1``); single-label: cross-entropy;
    multi-label: binary cross-entropy averaged over the labels. With ``config``, its ``problem_type`` and
    ``num_labels`` are read at each call (HF sets ``problem_type`` on its first loss)."""

    def loss(outputs: Any, labels: torch.Tensor) -> torch.Tensor:
        logits = _upcast(_logits(outputs))
        kind = _problem_type(config, problem_type, num_labels, labels)
        if kind == "regression":
            err = (logits.squeeze(-1) - labels.to(logits.dtype).squeeze(-1)) ** 2
            return err.reshape(err.shape[0], -1).mean(1)
        if kind == "single_label_classification":
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), reduction="none")
        if kind == "multi_label_classification":
            bce = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none")
            return bce.reshape(bce.shape[0], -1).mean(1)
        raise ValueError(f"Invalid config.problem_type {kind!r} (transformers raises on it too).")

    return loss


def cross_entropy_classification_loss(outputs: Any, labels: torch.Tensor) -> torch.Tensor:
    """Per-example cross-entropy over classes, whatever ``config.problem_type`` says: the loss of the speech
    classification heads (Wav2Vec2/HuBERT/WavLM/... ``ForSequenceClassification``, ``WhisperForAudioClassification``),
    whose ``forward`` applies ``CrossEntropyLoss`` unconditionally."""
    logits = _upcast(_logits(outputs))
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), reduction="none")


def question_answering_loss(outputs: Any, labels: torch.Tensor) -> torch.Tensor:
    """Per-example extractive-QA loss, HF's ``ForQuestionAnsweringLoss`` on a batch of one: the mean of the
    start- and end-position cross-entropies. ``labels`` is ``(B, 2)``: ``[start_position, end_position]`` per example.
    Positions outside the sequence are clamped to ``T`` and ignored, as HF does (such a term contributes 0 here; HF's
    mean over no term would be NaN)."""
    start_logits, end_logits = (_upcast(outputs[k] if isinstance(outputs, dict) else getattr(outputs, k))
                                for k in ("start_logits", "end_logits"))
    if labels.dim() != 2 or labels.shape[1] != 2:
        raise ValueError(f"question_answering_loss needs labels of shape (batch, 2) = [start, end], got "
                         f"{tuple(labels.shape)}.")
    ignored = start_logits.shape[1]
    positions = labels.clamp(0, ignored)
    start = F.cross_entropy(start_logits, positions[:, 0], ignore_index=ignored, reduction="none")
    end = F.cross_entropy(end_logits, positions[:, 1], ignore_index=ignored, reduction="none")
    return (start + end) / 2


def _class_names(mapping: Any) -> set[str]:
    names: set[str] = set()
    for v in mapping.values():
        names.update(v if isinstance(v, (list, tuple)) else [v])
    return names


def _base_model(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _decoder_shift(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The model's own function from ``labels`` to decoder inputs, or ``None`` (see
    :func:`decoder_input_ids_from_labels`)."""
    base = _base_model(model)
    prepare = getattr(base, "prepare_decoder_input_ids_from_labels", None)
    if callable(prepare):
        return lambda labels: prepare(labels=labels)
    shift = getattr(base, "_shift_right", None)
    if callable(shift):
        return shift
    shift = getattr(sys.modules.get(type(base).__module__), "shift_tokens_right", None)
    config = getattr(base, "config", None)
    if callable(shift) and config is not None:
        params = list(inspect.signature(shift).parameters)
        if params[1:] == ["pad_token_id", "decoder_start_token_id"]:
            return lambda labels: shift(labels, config.pad_token_id, config.decoder_start_token_id)
        if params[1:] == ["pad_token_id"]:
            return lambda labels: shift(labels, config.pad_token_id)
    return None


def decoder_input_ids_from_labels(model: nn.Module, labels: torch.Tensor) -> torch.Tensor | None:
    """The decoder inputs an encoder-decoder model's own forward builds from ``labels`` (teacher forcing).

    Mirrors the model exactly, by the model's own code: ``prepare_decoder_input_ids_from_labels`` where the model
    has it (BART, mBART, T5, Marian, Pegasus, ...), else its ``_shift_right`` (T5 family), else the
    ``shift_tokens_right(labels, pad_token_id, decoder_start_token_id)`` of the model's own module, which is what
    M2M100 / NLLB / Blenderbot(Small) / Whisper call in ``forward``. ``None`` if none exists: the caller then passes
    ``labels=`` and lets the model build them (the model then also computes its batch loss, which is discarded).
    """
    shift = _decoder_shift(model)
    return None if shift is None else shift(labels)


def decoder_attention_mask_from_labels(model: nn.Module, decoder_input_ids: torch.Tensor) -> torch.Tensor | None:
    """The decoder attention mask an encoder-decoder's own forward builds when it builds the decoder inputs from
    ``labels`` (and none is passed), or ``None`` if its forward builds none.

    ``EncoderDecoderModel`` masks the shifted labels' pad tokens (``decoder_input_ids != pad_token_id``, which also
    masks the start token when it equals the pad token); Pix2Struct does the same and then always attends to the
    first token. Passing ``decoder_input_ids`` alone would skip that mask and train another objective than the
    model's own loss on a batch of one. Read from the forward's code, as :func:`_causal_loss_kind` does.
    """
    base = _base_model(model)
    code = _forward_code(type(base))
    pad = getattr(getattr(base, "config", None), "pad_token_id", None)
    if code is None or pad is None or not any(
            p in code for p in ("decoder_input_ids != self.config.pad_token_id",
                                "decoder_input_ids.ne(self.config.pad_token_id)")):
        return None
    mask = decoder_input_ids.ne(pad).long()
    if "decoder_attention_mask[:, 0] = 1" in code:
        mask[:, 0] = 1
    return mask


def _names(*kinds: str) -> set[str]:
    names: set[str] = set()
    for kind in kinds:
        names |= _class_names(getattr(auto, f"MODEL_FOR_{kind}_MAPPING_NAMES", {}))
    return names


def _transformers_forward(cls: type) -> Callable | None:
    """The ``forward`` of the nearest class in ``cls``'s MRO defined by transformers (a user subclass that wraps
    ``super().forward`` keeps its head's loss)."""
    for klass in cls.__mro__:
        if klass.__module__.startswith("transformers.") and "forward" in vars(klass):
            return vars(klass)["forward"]
    return None


def _forward_code(cls: type, own: bool = False) -> str | None:
    """The code of a head's ``forward`` without docstring and comments (``ast.unparse``): of ``cls`` itself if
    ``own``, else of the nearest transformers class in its MRO. ``None`` if the source is unavailable."""
    fn = cls.forward if own else (_transformers_forward(cls) or cls.forward)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):  # pragma: no cover
        return None
    body = tree.body[0].body if tree.body and hasattr(tree.body[0], "body") else []
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body.pop(0)  # the docstring
    return ast.unparse(tree)


def _follows_problem_type(cls: type) -> bool:
    """Whether a classification head's ``forward`` picks its loss by ``config.problem_type`` (directly or through
    ``self.loss_function``) rather than applying cross-entropy unconditionally."""
    code = _forward_code(cls)
    return code is None or "problem_type" in code or "loss_function" in code


def _causal_loss_kind(base: nn.Module) -> str | None:
    """How a causal-LM head's own loss reads ``labels``: ``"shifted"`` (``self.loss_function`` is HF's
    ForCausalLMLoss: ``logits[t]`` predicts ``labels[t + 1]``), ``"unshifted"`` (a plain cross-entropy of
    ``logits.view(-1, V)`` against ``labels.view(-1)``: BartForCausalLM, TrOCR, WhisperForCausalLM, ... document
    that their labels are *not* shifted inside the model), or ``None`` (anything else: codebooks, n-gram streams,
    label smoothing, no loss)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    code = _forward_code(type(base))
    if code is None:
        return None
    if "self.loss_function(" in code:
        return "shifted" if getattr(base, "loss_function", None) is ForCausalLMLoss else None
    if "labels.view(-1)" in code and "logits.view(-1" in code and not any(
            w in code for w in ("shift", "codebook", "label_smoothing")):
        return "unshifted"
    return None


def is_seq2seq_lm(model: nn.Module) -> bool:
    """An encoder-decoder LM trained by teacher forcing on ``labels`` (BART, T5, Marian, M2M100, Whisper,
    VisionEncoderDecoder, ...)."""
    base = _base_model(model)
    cls = type(base).__name__
    if not getattr(getattr(base, "config", None), "is_encoder_decoder", False):
        return False
    return cls in _names("SEQ_TO_SEQ_CAUSAL_LM", "SPEECH_SEQ_2_SEQ", "VISION_2_SEQ", "IMAGE_TEXT_TO_TEXT") or (
        cls.endswith("ForConditionalGeneration"))


def _uses_causal_loss_function(base: nn.Module) -> bool:
    """Whether the model's own forward computes its loss with ``self.loss_function`` and that is HF's
    ForCausalLMLoss (a subclass with a forward of its own is judged by that forward)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    code = _forward_code(type(base), own=True)
    return code is not None and "self.loss_function(" in code and getattr(base, "loss_function", None) is (
        ForCausalLMLoss)


def check_loss_per_example(losses: Any, rows: int | None = None) -> torch.Tensor:
    """``losses`` as the per-example loss returned them, if they are one loss per example (a 1-D tensor); else a
    ``ValueError`` naming the cause, before any other check reads them: a scalar is a loss reduced over the batch (a
    mean or a sum), which no per-example clipping can split (DESIGN invariant 2). One exception: on a micro-batch of
    ``rows = 1`` row holding one example (not packed), a scalar is that example's loss whatever the reduction (a
    ``.squeeze()`` that dropped the batch axis, or a mean over a batch of one): it is returned as shape ``(1,)``, so a
    Poisson micro-batch of one never stops a run that trains on larger ones. Its length is checked where the
    batch's example count is known (the DP step) and its per-example meaning by the counterfactual check."""
    if isinstance(losses, torch.Tensor) and losses.dim() == 0 and rows == 1:
        return losses.reshape(1)
    if not isinstance(losses, torch.Tensor) or losses.dim() != 1:
        shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
        raise ValueError(
            f"per_example_loss must return one loss per example, a tensor of shape (batch,); it returned {shape}"
            + (" — a loss reduced over the whole batch (a mean or a sum)" if shape == () else "")
            + ". Reduce over each example's own tokens only: e.g. cross_entropy(..., reduction='none') per token, "
            "then a sum or mean per row; keep the batch axis (squeeze(-1), not squeeze())."
        )
    return losses


def check_models_own_loss(model: nn.Module, inputs: dict, labels: torch.Tensor, loss: PerExampleLoss,
                          half: bool = False) -> None:
    """``loss`` (hf_dp's default for ``model``'s head) on one example equals the loss the model's own forward returns
    for it (``model(**inputs, labels=labels).loss`` on a batch of one: what the plain ``Trainer`` trains), to 1e-3
    (5e-2 in half precision), or ``ValueError`` (DESIGN invariant 2). Run without gradient; skipped where the model
    returns no finite scalar loss (no ``loss`` output, or an example without a labelled token: HF's mean is NaN), or
    cannot compute one from these inputs (its forward raises when given ``labels``: nothing to compare with). A
    :class:`LabelSmoothedLoss` is compared with transformers' ``LabelSmoother`` on the model's outputs (what the
    Trainer trains with ``label_smoothing_factor``) and its unsmoothed form with the model's own loss."""
    if labels.shape[0] != 1:
        raise ValueError("check_models_own_loss compares one example (a batch of one).")
    with torch.no_grad():
        try:
            outputs = model(**{**inputs, "labels": labels})
        except Exception:  # noqa: BLE001 - the model has no loss of its own for these inputs; nothing is compared
            return
        own = outputs.get("loss") if isinstance(outputs, dict) else getattr(outputs, "loss", None)
        if not isinstance(own, torch.Tensor) or own.numel() != 1 or not bool(torch.isfinite(own).all()):
            return
        tol = 5e-2 if half else 1e-3
        if isinstance(loss, LabelSmoothedLoss):  # the smoothed loss is the Trainer's; its labels, the model's own
            loss.check_against_trainer(outputs, labels, tol)
            loss = loss.unsmoothed
        ours = loss(outputs, labels)
    if ours.shape != (1,) or not torch.allclose(ours.double(), own.double().reshape(1), rtol=tol, atol=tol):
        raise ValueError(
            f"The per-example loss hf_dp computes for {type(_base_model(model)).__name__} "
            f"({getattr(loss, '__name__', type(loss).__name__)}: {ours.flatten().tolist()}) differs from the loss "
            f"the model's own forward returns for the same example alone ({float(own):.6g}): the model's loss is "
            "not the one hf_dp's default for its head reproduces (an extra term, a scale, another reduction), so "
            "training would optimise another objective than the plain Trainer. Pass `per_example_loss=fn` with "
            "fn(outputs, labels) -> each example's own loss, shape (batch,), that reproduces the model's loss.")


def labels_to_compare(task: str, inputs: dict, labels: torch.Tensor) -> torch.Tensor:
    """The labels a first-step comparison of two token losses uses on ``inputs``: ``labels``, or — for a language
    model's token loss when no position of ``labels`` is labelled, where both losses would be 0 and the comparison
    vacuous — the input tokens themselves (padding ignored). The comparison is of the loss functions; the labels
    the step trains are unchanged."""
    ids, mask = inputs.get("input_ids"), inputs.get("attention_mask")
    if task not in ("causal_lm", "causal_lm_unshifted", "masked_lm") or bool((labels != IGNORE_INDEX).any()) \
            or not isinstance(ids, torch.Tensor) or ids.shape != labels.shape:
        return labels
    return ids.masked_fill(mask == 0, IGNORE_INDEX) if isinstance(mask, torch.Tensor) and mask.shape == ids.shape \
        else ids.clone()


def check_rows_are_examples(model: nn.Module) -> None:
    """Refuse a head that folds a dimension of each example into the batch dimension inside its forward: every layer
    then sees ``batch x num_choices`` rows for ``batch`` examples, so no layer's per-row gradient is an example's
    (DESIGN invariant 1), whatever the loss: ``*ForMultipleChoice`` (``input_ids`` of shape (batch, choices, length)
    viewed as (batch·choices, length)). Called for every model, with or without ``per_example_loss``: with a loss of
    the user's own it failed at the first step with a bare shape mismatch of torch's."""
    base = _base_model(model)
    cls = type(base).__name__
    if cls in _names("MULTIPLE_CHOICE") or cls.endswith("ForMultipleChoice"):
        raise ValueError(
            f"{cls} folds the choices into the batch dimension (batch x num_choices rows reach every layer), so "
            "the layers' per-row gradients are not per example and hf_dp cannot clip them per example; a custom "
            "per_example_loss does not change this. Put all choices of an example in one sequence instead (a causal "
            "LM scoring the answer, or a *ForSequenceClassification head over the concatenated choices)."
        )


def default_per_example_loss(model: nn.Module) -> tuple[PerExampleLoss, str]:
    """Choose the per-example loss for a model by its head, as transformers' auto classes know it: the model's own
    loss on a batch of one (what the plain ``Trainer`` trains for that example).

    Returns ``(loss_fn, task)`` with ``task`` in ``{"causal_lm", "causal_lm_unshifted", "masked_lm", "seq2seq_lm",
    "sequence_classification", "token_classification", "image_classification", "video_classification",
    "audio_classification"}``. Raises
    ``ValueError`` for other heads, saying what to pass as ``per_example_loss=``.
    """
    base = _base_model(model)
    cls = type(base).__name__
    config = getattr(base, "config", None)
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            f"{cls} has config.output_router_logits=True: its own loss adds the mixture-of-experts load-balancing "
            "loss, a statistic of the whole batch's routing, which no per-example loss can reproduce and which would "
            "mix examples. Set `model.config.output_router_logits = False` (the per-example token loss is trained), "
            "or pass `per_example_loss=fn` with a loss of your own that depends on each example only."
        )
    if (getattr(config, "z_loss_coefficient", 0) or 0) > 0:
        raise ValueError(
            f"{cls} has config.z_loss_coefficient > 0: its own loss adds a z-loss averaged over every token of the "
            "batch, which hf_dp's default per-example loss does not include. Set `model.config.z_loss_coefficient "
            "= 0.0` or pass `per_example_loss=fn` that adds each example's own z-loss, shape (batch,)."
        )
    # (A "...LMHeadModel" that transformers lists as a masked LM only, e.g. FlaubertWithLMHeadModel, is one.)
    if cls in _names("CAUSAL_LM") or (cls.endswith(("LMHeadModel", "ForCausalLM")) and cls not in _names("MASKED_LM")):
        kind = _causal_loss_kind(base)
        if kind == "shifted":
            return causal_lm_loss, "causal_lm"
        if kind == "unshifted":  # labels already shifted by the user, as the model's docstring asks
            return token_loss, "causal_lm_unshifted"
        raise ValueError(
            f"{cls}'s own loss is not HF's (shifted) causal-LM cross-entropy nor a plain token cross-entropy, so "
            "hf_dp has no default per-example loss for it. Pass `per_example_loss=fn` to DPTrainer, where "
            "`fn(outputs, labels)` returns each example's own loss, shape (batch,), as the model computes it for a "
            "batch of one."
        )
    if is_seq2seq_lm(base) and "self._compute_loss(" in (_forward_code(type(base)) or ""):
        raise ValueError(
            f"{cls}'s own loss is computed by its `_compute_loss` (ProphetNet: the main stream's and the n-gram "
            "streams' predictions of future tokens, with label smoothing config.eps), not a token cross-entropy of "
            "`logits`, so hf_dp has no default per-example loss for it. Pass `per_example_loss=fn` to DPTrainer, "
            "where `fn(outputs, labels)` returns each example's own loss, shape (batch,), as the model computes it "
            "for a batch of one."
        )
    if is_seq2seq_lm(base) and _decoder_shift(base) is not None:
        # (An encoder-decoder with no teacher-forcing shift of its own, e.g. Dia's multi-codebook audio decoder,
        # trains some other loss: refused below.)
        return token_loss, "seq2seq_lm"
    if (cls in _names("IMAGE_TEXT_TO_TEXT", "VISION_2_SEQ") or cls.endswith("ForConditionalGeneration")) and (
        _uses_causal_loss_function(base)
    ):
        # Decoder-only multimodal LMs (Llava, PaliGemma, Qwen-VL, ...) whose forward calls self.loss_function,
        # which is ForCausalLMLoss (the shifted next-token loss). Others (BLIP's label smoothing, ...) are refused.
        return causal_lm_loss, "causal_lm"
    if cls in _names("MASKED_LM") or cls.endswith("ForMaskedLM"):
        return token_loss, "masked_lm"
    if cls in _names("TOKEN_CLASSIFICATION") or cls.endswith("ForTokenClassification"):
        return token_loss, "token_classification"
    for kind, suffix in (("IMAGE", "ForImageClassification"), ("VIDEO", "ForVideoClassification"),
                         ("AUDIO", "ForAudioClassification")):
        if cls in _names(f"{kind}_CLASSIFICATION") or cls.endswith(suffix):
            if "labels" not in _parameters(type(base).forward):
                raise ValueError(
                    f"{cls} computes no training loss (its forward takes no `labels`; e.g. the distillation heads "
                    "'...WithTeacher' are for inference). Fine-tune the plain classification class instead, or pass "
                    "`per_example_loss=fn` to DPTrainer, fn(outputs, labels) -> one loss per example, shape (batch,)."
                )
            if _follows_problem_type(type(base)):
                return sequence_classification_loss(config=config), f"{kind.lower()}_classification"
            return cross_entropy_classification_loss, f"{kind.lower()}_classification"
    if cls in _names("SEQUENCE_CLASSIFICATION") or cls.endswith("ForSequenceClassification"):
        return sequence_classification_loss(config=config), "sequence_classification"
    check_rows_are_examples(model)
    if cls in _names("QUESTION_ANSWERING") or cls.endswith("ForQuestionAnswering"):
        raise ValueError(
            f"{cls} takes its targets as two columns (start_positions, end_positions), and DPTrainer needs one "
            "`labels` tensor per batch. Give each example `labels = [start_position, end_position]`, e.g. "
            "`train = train.map(lambda ex: {'labels': [ex['start_positions'], ex['end_positions']]}, "
            "remove_columns=['start_positions', 'end_positions'])`, keep that column with "
            "`DPTrainingArguments(..., label_names=['labels'])`, and pass "
            "`per_example_loss=hf_dp.losses.question_answering_loss` (HF's start/end loss, per example)."
        )
    raise ValueError(
        f"hf_dp has no default per-example loss for {cls}. Pass `per_example_loss=fn` to DPTrainer, where "
        "`fn(outputs, labels)` takes the model's output on a batch (without `labels`) and the batch's `labels`, and "
        "returns a tensor of shape (batch,): each example's own loss, depending on that example only (a mean over "
        "the batch would not bound one example's contribution). hf_dp.losses has causal_lm_loss, token_loss, "
        "sequence_classification_loss(config=model.config), cross_entropy_classification_loss and "
        "question_answering_loss."
    )


def _parameters(fn: Callable) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # pragma: no cover
        return set()


def seq2seq_model_inputs(model: nn.Module, inputs: dict, labels: torch.Tensor) -> dict:
    """An encoder-decoder LM's inputs for a micro-batch (a copy of ``inputs``): the decoder inputs the model's own
    forward would build from ``labels`` (:func:`decoder_input_ids_from_labels`), so the model is not asked for its
    batch loss, with the decoder attention mask the model builds with them (:func:`decoder_attention_mask_from_labels`:
    EncoderDecoderModel, Pix2Struct); a model with no such function gets ``labels=`` and builds them itself (its batch
    loss is then computed, unused). Inputs that already hold decoder inputs are kept as they are."""
    inputs = dict(inputs)
    if "decoder_input_ids" in inputs or "decoder_inputs_embeds" in inputs:
        return inputs
    decoder_input_ids = decoder_input_ids_from_labels(model, labels)
    if decoder_input_ids is None:
        inputs["labels"] = labels
    else:
        inputs["decoder_input_ids"] = decoder_input_ids
        if "decoder_attention_mask" not in inputs:  # the mask the model builds with them (EncoderDecoder)
            mask = decoder_attention_mask_from_labels(model, decoder_input_ids)
            if mask is not None:
                inputs["decoder_attention_mask"] = mask
    return inputs


# ---------------------------------------------------------------------------------------------- label smoothing
def trainer_shifts_smoothed_labels(model: nn.Module) -> bool:
    """Whether ``Trainer.compute_loss`` smooths ``model``'s labels shifted (``LabelSmoother(..., shift_labels=True)``):
    transformers decides by the class name of the model (under PEFT, of the adapted base model) being a value of
    ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (transformers 5, ``Trainer.compute_loss``)."""
    return type(_base_model(model)).__name__ in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def smoothed_token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Per-token label-smoothed cross-entropy ``(B, T)`` of ``(B, T, V)`` logits (upcast to at least float32):
    ``(1 − ε)·(−log p[target]) + ε·mean_c(−log p[c])``, 0 where the target is ``IGNORE_INDEX``. Averaged over an
    example's own targets this is transformers' ``LabelSmoother`` (Szegedy et al. 2016, §7; ``trainer_pt_utils``) on
    that example alone: its ``nll.sum() / n`` and ``smoothed.sum() / (n·V)`` over the same ``n`` targets."""
    logp = F.log_softmax(_upcast(logits), dim=-1)
    ignored = targets.eq(IGNORE_INDEX)
    nll = -logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    uniform = -logp.mean(-1)
    return ((1 - epsilon) * nll + epsilon * uniform).masked_fill(ignored, 0.0)


def _same(labels: torch.Tensor, **_: Any) -> torch.Tensor:
    return labels


def _shifted(labels: torch.Tensor, **_: Any) -> torch.Tensor:
    return causal_lm_targets(labels)


def _per_row_mean(per_token: torch.Tensor, targets: torch.Tensor, **_: Any) -> torch.Tensor:
    return mean_over_targets(per_token, targets)


class LabelSmoothedLoss:
    """The per-example loss the plain ``Trainer`` trains with ``label_smoothing_factor = ε > 0``: its
    ``LabelSmoother(ε)`` (``Trainer.compute_loss``) on a batch of one, i.e. each example's
    ``(1 − ε)·(mean NLL over its own labelled tokens) + ε·(mean over those tokens of the mean over classes of
    −log p)``; for a classification head, its one label is its one token. Depends on the example alone (DESIGN
    invariant 2), whereas the Trainer's batch form divides by the tokens of the whole batch.

    ``targets(labels, **kw)`` gives each position's target (shifted where the Trainer shifts: causal LMs) and
    ``reduce(per_token, targets, **kw)`` the per-example means (``DPSFTTrainer``: per packed example, ``segments=``).
    ``unsmoothed`` is hf_dp's default for the head without smoothing; the first-step check compares it with the
    model's own loss and this loss with transformers' ``LabelSmoother`` (:func:`check_models_own_loss`).
    ``refusal``: why the Trainer's smoothing cannot be reproduced for this model, raised when the loss is first used
    (the preference trainers replace the default loss and never use it, as trl ignores ``label_smoothing_factor``).
    """

    def __init__(self, epsilon: float, unsmoothed: PerExampleLoss, shift: bool, classification: bool = False,
                 config: Any = None, targets: Callable | None = None, reduce: Callable | None = None,
                 refusal: str | None = None):
        self.epsilon, self.unsmoothed, self.shift = float(epsilon), unsmoothed, shift
        self.classification, self.config, self.refusal = classification, config, refusal
        self.targets = targets or (_shifted if shift else _same)
        self.reduce = reduce or _per_row_mean
        self.__name__ = f"label_smoothed({getattr(unsmoothed, '__name__', type(unsmoothed).__name__)}, {epsilon})"

    def __call__(self, outputs: Any, labels: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if self.refusal is not None:
            raise ValueError(self.refusal)
        logits = _logits(outputs)
        if self.classification:
            kind = _problem_type(self.config, None, None, labels) if self.config is not None else (
                "single_label_classification")
            if kind != "single_label_classification":
                raise ValueError(
                    f"label_smoothing_factor={self.epsilon} with a {kind} head: transformers' LabelSmoother smooths "
                    "over integer class labels (it gathers log p of the label), so the plain Trainer cannot train "
                    "this head with it (it fails at its first loss; a multi-label problem_type set in the config "
                    "before the Trainer is built makes it turn smoothing off). Set label_smoothing_factor=0, or "
                    "set config.problem_type='multi_label_classification' before building the trainer.")
            logits, labels = logits.reshape(logits.shape[0], 1, -1), labels.reshape(labels.shape[0], 1)
        elif logits.shape[1] != labels.shape[1]:
            raise ValueError(
                f"label_smoothing_factor={self.epsilon}: the model returns logits for {logits.shape[1]} positions "
                f"and its labels cover {labels.shape[1]} (a prompt-learning adapter's virtual tokens): the Trainer's "
                "LabelSmoother aligns the labels with the first positions, the virtual tokens', so it would not "
                "train the model's own objective. Set label_smoothing_factor=0 with prompt learning.")
        targets = self.targets(labels, **kwargs)
        return self.reduce(smoothed_token_cross_entropy(logits, targets, self.epsilon), targets, **kwargs)

    def check_against_trainer(self, outputs: Any, labels: torch.Tensor, tol: float) -> None:
        """This loss on one example equals transformers' ``LabelSmoother(ε)`` on it (what ``Trainer.compute_loss``
        returns for a batch of one), to ``tol``, or ``ValueError``."""
        from transformers.trainer_pt_utils import LabelSmoother

        ours = self(outputs, labels)
        theirs = LabelSmoother(epsilon=self.epsilon)(outputs, labels, shift_labels=self.shift)
        if not (bool(torch.isfinite(theirs).all()) and theirs.numel() == 1):
            return  # an example without a labelled token: the Trainer's mean is NaN, nothing to compare
        if ours.shape != (1,) or not torch.allclose(ours.double(), theirs.double().reshape(1), rtol=tol, atol=tol):
            raise ValueError(
                f"hf_dp's label-smoothed per-example loss ({ours.flatten().tolist()}) differs from transformers' "
                f"LabelSmoother({self.epsilon}) on the same example alone ({float(theirs):.6g}), the loss the plain "
                "Trainer trains: training would optimise another objective. Pass `per_example_loss=fn` that "
                "reproduces it, or set label_smoothing_factor=0.")


def label_smoothed_default(model: nn.Module, loss: PerExampleLoss, task: str, epsilon: float,
                           targets: Callable | None = None, reduce: Callable | None = None,
                           shift: bool | None = None) -> PerExampleLoss:
    """The default per-example loss ``loss`` of ``model``'s head (``task`` from :func:`default_per_example_loss`)
    with the plain Trainer's label smoothing ``epsilon`` (its ``label_smoother.epsilon``; ``loss`` itself if 0:
    the Trainer turns smoothing off for a multi-label ``config.problem_type``). ``shift``: whether the labels are
    shifted (default: as ``Trainer.compute_loss`` decides, :func:`trainer_shifts_smoothed_labels`; trl's
    ``SFTTrainer`` always shifts). A head whose own loss reads its labels another way than the Trainer's smoother
    does gets a loss that refuses, with the cause, when first used."""
    if not epsilon:
        return loss
    trainer_shift = trainer_shifts_smoothed_labels(model) if shift is None else shift
    config = getattr(_base_model(model), "config", None)
    classification = task.endswith("classification") and task != "token_classification"
    model_shifts = task == "causal_lm"
    refusal = None  # (a classification head's problem_type is read at each call, as its own loss reads it)
    if not classification and model_shifts != trainer_shift:
        cls = type(_base_model(model)).__name__
        refusal = (
            f"label_smoothing_factor={epsilon}: {cls}'s own loss reads its labels "
            f"{'shifted (next-token)' if model_shifts else 'unshifted'}, but transformers' Trainer smooths them "
            f"{'shifted' if trainer_shift else 'unshifted'} (it shifts only for classes listed in "
            "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, by class name), so the plain Trainer would train another alignment "
            "of the labels than the model's own loss. Set label_smoothing_factor=0, or pass `per_example_loss=fn` "
            "with the smoothed loss you mean, shape (batch,).")
    return LabelSmoothedLoss(epsilon, loss, trainer_shift, classification=classification,
                             config=config if loss is not cross_entropy_classification_loss else None,
                             targets=targets, reduce=reduce, refusal=refusal)


def user_loss_given(per_example_loss: Any, epsilon: float) -> bool:
    """Whether a ``per_example_loss`` of the user's own is given. With one, ``label_smoothing_factor`` (``epsilon``)
    does not change what is trained (as the plain Trainer's ``compute_loss_func`` wins over its label smoother):
    said once, at construction."""
    if epsilon and per_example_loss is not None:
        import warnings

        warnings.warn(
            f"label_smoothing_factor={epsilon} is not applied to your per_example_loss: it is trained as you wrote "
            "it (as the plain Trainer trains a compute_loss_func without smoothing); evaluation losses are the "
            "Trainer's, smoothed. To train hf_dp's default loss with label smoothing, leave per_example_loss unset.",
            UserWarning, stacklevel=3)
    return per_example_loss is not None
