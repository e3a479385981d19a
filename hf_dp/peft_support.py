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

import contextlib
import types
from collections.abc import Iterator
from typing import Any

from torch import nn

from .clipping.rules import UnsupportedLayerError

__all__ = ["is_peft_model", "apply_peft_config", "per_example_prompts", "check_adapter_objective",
           "check_adapter_rows",
           "adapter_summary", "adapter_advice", "explain_adapter_refusal", "data_initialised_adapters",
           "data_initialisation_note", "data_initialisation_warning"]


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


def check_adapter_objective(model: nn.Module) -> None:
    """Refuse an adapter whose model adds a term to its own loss that DPTrainer does not train.

    AdaLoRA (Zhang et al. 2023, Eq. 4) adds ``orth_reg_weight · R(P, Q)``, an orthogonality penalty on every
    ``lora_A`` / ``lora_B``, to ``outputs.loss`` (``AdaLoraModel.forward``). DPTrainer trains each example's own loss
    computed from the logits (``losses.py``), so that term would silently be left out (DESIGN invariant 9); and its
    gradient reaches ``lora_A`` / ``lora_B`` outside any layer's forward, where no hook could clip it per example.
    """
    if not is_peft_model(model):
        return
    from peft import PeftType

    for name, config in model.peft_config.items():
        check_adapter_rows(name, config)
        weight = getattr(config, "orth_reg_weight", 0.0) or 0.0
        if config.peft_type == PeftType.ADALORA and weight > 0:
            raise ValueError(
                f"AdaLoRA adapter {name!r} has orth_reg_weight={weight}: PEFT adds an orthogonality penalty on "
                "lora_A / lora_B to the model's own loss, which DPTrainer does not train (each example's loss is "
                "computed from the logits, and the penalty's gradient reaches lora_A / lora_B outside any layer's "
                "forward, where it cannot be clipped per example). Set `AdaLoraConfig(..., orth_reg_weight=0.0)`: "
                "AdaLoRA's adapters are then trained exactly, per example."
            )


def check_adapter_rows(name: str, config: Any) -> None:
    """Refuse an adapter that runs its layers on a data-dependent selection of each row's tokens (DESIGN invariant 1).

    Activated LoRA (``alora_invocation_tokens``, PEFT's ``ALoraLinearVariant``) applies ``lora_B(lora_A(x[mask]))`` to
    the tokens of each row from the last invocation sequence on, gathered over the whole batch into one flat
    ``(Σ_i k_i, d)`` input, where ``k_i`` depends on where row ``i``'s invocation tokens are. hf_dp proves a flat
    layout once, on the first micro-batch, and then reads ``k`` rows per example: a later batch whose rows have
    other ``k_i`` would be split at the wrong rows (mixtures of examples clipped as one) or fail mid-training."""
    tokens = getattr(config, "alora_invocation_tokens", None)
    if tokens:
        raise ValueError(
            f"Adapter {name!r} is an activated LoRA (alora_invocation_tokens={list(tokens)}): PEFT applies it only to "
            "each row's tokens from its last invocation sequence on, gathered over the whole batch into one flat "
            "input of lora_A / lora_B, so how many of those rows belong to each example depends on the example's "
            "data. hf_dp proves the rows' layout on the first batch and cannot assign them to examples at every "
            "later step (a batch whose rows hold the invocation elsewhere would be split at the wrong rows, or stop "
            "training). Train a plain LoRA adapter (drop alora_invocation_tokens): it is exact under DP."
        )


#: LoRA initialisations (``init_lora_weights``) that PEFT computes from data the user runs through the model, not
#: from the weights alone: EVA (Paischer et al. 2024, explained-variance adaptation: the SVD of each layer's inputs),
#: CorDA (Yang et al. 2024: the covariance of each layer's inputs) and LoRA-GA (Wang et al. 2024: the gradients of the
#: loss). What they read, by the PEFT call that feeds them the data.
DATA_INITIALISATIONS = {
    "eva": "the SVD of the layers' inputs on the batches given to initialize_lora_eva_weights",
    "corda": "the covariance of the layers' inputs on the data run by preprocess_corda",
    "lora_ga": "the gradients of the loss on the batches given to preprocess_loraga",
}


def data_initialised_adapters(model: nn.Module) -> list[str]:
    """The adapters of ``model`` whose initial weights PEFT computed from data (:data:`DATA_INITIALISATIONS`), each
    ``"'name' (init_lora_weights='eva': what it read)"``; empty for other models and initialisations (the default,
    Gaussian, PiSSA, OLoRA, LoftQ, ... read the weights only).

    Such weights are released with the model (the adapter starts from them, and the update adds to them), but they
    were computed from that data without noise, outside the DP mechanism: if the data was the private training data,
    the released model depends on it beyond ε (DESIGN invariant 13: a model carries what was done to it)."""
    if not is_peft_model(model):
        return []
    out = []
    for name, config in getattr(model, "peft_config", {}).items():
        init = getattr(config, "init_lora_weights", None)
        if not isinstance(init, str):
            continue
        key = "corda" if init.lower().startswith("corda") else init.lower()
        if key in DATA_INITIALISATIONS:
            out.append(f"{name!r} (init_lora_weights={init!r}: {DATA_INITIALISATIONS[key]})")
    return out


def data_initialisation_note(model: nn.Module) -> str | None:
    """The ``dp_guarantee`` note for adapters initialised from data (:func:`data_initialised_adapters`), or None.
    One note, without ``"; "`` (the card lists notes split there)."""
    found = data_initialised_adapters(model)
    if not found:
        return None
    return ("adapter weights initialised from data before DP training, without noise (" + ", ".join(found) + "): "
            "not covered if that data is private")


def data_initialisation_warning(model: nn.Module) -> str | None:
    """What the trainer says once, at construction, of adapters initialised from data; None if there are none."""
    found = data_initialised_adapters(model)
    if not found:
        return None
    return ("hf_dp: the adapter " + ", ".join(found) + " was initialised from data before DP training. Those initial "
            "weights were computed without noise and are released with the model, so the DP guarantee does not "
            "cover them unless that data is public: dp_guarantee (dp_state.json, the model card) says \"not "
            "strict\". Run the initialisation on public data only, or use a data-free one (init_lora_weights=True, "
            "'gaussian', 'pissa', 'olora').")


def adapter_summary(model: nn.Module) -> dict[str, Any]:
    """What is trained: ``{"method": "full" | "lora" | "prefix_tuning" | "prompt_tuning", "trainable_parameters"}``."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if not is_peft_model(model):
        return {"method": "full", "trainable_parameters": trainable}
    config = _active_config(model)
    return {"method": str(config.peft_type.value).lower(), "trainable_parameters": trainable,
            "peft_config": {k: v for k, v in config.to_dict().items() if isinstance(v, (int, float, str, bool, list))}}


def explain_adapter_refusal(message: str, model: nn.Module) -> str | None:
    """The advice for a refusal that names PEFT adapter parameters, or ``None`` when it names none.

    A refusal's usual way forward, "freeze it or train through a PEFT adapter (LoRA)", is circular when the refused
    parameters *are* an adapter's: e.g. ``target_modules="all-linear"`` on a mixture-of-experts model puts LoRA on the
    router and the 3-D expert parameters, where PEFT applies it as a weight delta (``ParamWrapper``) that no layer hook
    sees per example. Each adapter layer named in ``message`` is listed with the way forward: leave it out of the
    adapter; LoRA on the attention and dense projections is exact.
    """
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # pragma: no cover
        return None
    names = [n for n, m in model.named_modules() if n and isinstance(m, BaseTunerLayer) and f"{n}." in message]
    outer = [n for n, m in model.named_modules() if n and isinstance(m, BaseTunerLayer)]
    # the outermost adapter layer around each (PEFT nests them: `experts.base_layer` inside `experts`)
    names = sorted({next((o for o in outer if n == o or n.startswith(o + ".")), n) for n in names})
    if not names:
        return None
    from peft.tuners.lora import LoraLayer

    try:
        from peft.tuners.trainable_tokens.layer import TrainableTokensLayer
    except ImportError:  # pragma: no cover
        TrainableTokensLayer = ()  # noqa: N806
    modules = dict(model.named_modules())
    lora = [n for n in names if isinstance(modules[n], LoraLayer)]
    tied = any(getattr(m, "tied_adapter", None) is not None for m in modules.values()
               if isinstance(m, TrainableTokensLayer))  # PEFT's trainable tokens also in a tied output layer
    tokens = [n for n in names if tied and isinstance(modules[n], TrainableTokensLayer)]
    other = [n for n in names if n not in lora and n not in tokens]

    def listing(layers: list[str]) -> str:
        return ", ".join(layers[:6]) + (f" and {len(layers) - 6} more" if len(layers) > 6 else "")

    notes = []
    if lora:
        notes.append(
            f"The refused parameters belong to PEFT adapter layers ({listing(lora)}), so training through an adapter "
            "is not the way forward for them: leave these layers out of the adapter, by listing the layers to adapt "
            "in `target_modules` (e.g. the attention projections, on which LoRA is exact) instead of \"all-linear\" "
            "(on mixture-of-experts models it also adapts the router and the expert parameters) and keeping them out "
            "of `target_parameters`; or freeze their adapter parameters.")
    if tokens:
        notes.append(
            f"The refused parameters belong to PEFT's trainable tokens ({listing(tokens)}, from "
            "`trainable_token_indices`): with input embeddings tied to the output layer, PEFT also applies the new "
            "tokens' rows in the output layer's weight, outside the embedding's forward. Drop "
            "`trainable_token_indices` (LoRA on the attention projections is exact), or untie the embeddings "
            "(`tie_word_embeddings=False`), with which trainable tokens are exact.")
    if other:
        kinds = sorted({type(modules[n]).__module__.split(".")[2] if type(modules[n]).__module__.startswith(
            "peft.tuners.") else type(modules[n]).__name__ for n in other})
        notes.append(
            f"The refused parameters belong to PEFT adapter layers ({listing(other)}) of a kind ({', '.join(kinds)}) "
            "whose weight delta PEFT computes from the adapter parameters outside any layer hf_dp can clip per "
            "example. Adapters trained exactly: LoRA (also DoRA, rsLoRA, AdaLoRA), IA3, VeRA, prefix tuning, prompt "
            "tuning and P-tuning: use e.g. `LoraConfig` with the same `target_modules`, or freeze these adapter "
            "parameters.")
    return "\n".join(notes)


@contextlib.contextmanager
def adapter_advice(model: nn.Module) -> Iterator[None]:
    """Re-raise a refusal that names PEFT adapter parameters with :func:`explain_adapter_refusal`'s advice added."""
    try:
        yield
    except UnsupportedLayerError as err:
        note = explain_adapter_refusal(str(err), model)
        if note is None:
            raise
        raise UnsupportedLayerError(f"{err}\n{note}") from err
