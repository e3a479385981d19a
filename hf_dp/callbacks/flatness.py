"""Privacy-Flat (Chen et al.) flatness regularisers as ``TrainerCallback``s for ``DPTrainer``.

Each callback says whether the run keeps a strict DP guarantee (``dp_guarantee_notes()``, collected by
``DPTrainer.dp_guarantee``). Chen et al. §2.3 admit that their method does not keep a strict guarantee; every
callback here has a variant that does, as the default, and the paper's variant as an explicit, labelled opt-in.

* :class:`WithinLayerFlattening` — adversarial weight perturbation (AWP, Wu et al. 2020) in the first
  ``warmup_steps`` steps (§2.1): the DP step is taken at ``w + v`` and applied to ``w``. ``privacy="strict"``
  builds ``v`` from the previous step's *privatized* gradient (DP-SAT, Park et al. 2023): post-processing, no extra
  cost. ``privacy="paper"`` computes ``v`` from a raw, unclipped, un-noised gradient on private data, as the paper.
* :class:`CrossLayerFlattening` — greedy sparse prefix-layer selection by the sharpness of Def. 1 (Alg. 1, lines
  2-15) before training; the removed layers' prefixes are held at zero. Strict only if the selection data is public.
* :class:`CrossModelFlattening` — weight distillation ``λ ‖w − w_nor‖₂`` towards a reference ``w_nor`` (§2.1,
  λ = 0.01). Its gradient is data-independent given ``w_nor``, so it is added *after* privatization. Strict when
  ``w_nor`` comes from public data or from a DP run; the paper's ``w_nor`` (non-private on the private data) is not.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from ..guarantee import post_processing
from ..sharpness import mean_loss, sharpness

__all__ = ["WithinLayerFlattening", "CrossLayerFlattening", "CrossModelFlattening"]


def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


class WithinLayerFlattening(TrainerCallback):
    """AWP in the first ``warmup_steps`` DP steps (Chen et al. §2.1, "within-layer weight flattening").

    Args:
        radius: ``‖v‖``, the size of the weight perturbation (relative to ``‖w‖`` if ``relative``).
        warmup_steps: ``T``: perturb in the first ``T`` optimizer steps only.
        privacy: ``"strict"`` (``v = ρ ĝ_{t−1} / ‖ĝ_{t−1}‖`` from the last privatized gradient) or ``"paper"``
            (``v = ρ ∇L / ‖∇L‖`` from a raw gradient on one private training batch; not covered by the guarantee).
        relative: scale ``radius`` by the norm of the trainable weights.
    """

    def __init__(self, radius: float = 0.01, warmup_steps: int = 100, privacy: str = "strict", relative: bool = True):
        if privacy not in ("strict", "paper"):
            raise ValueError(f"privacy must be 'strict' or 'paper', got {privacy!r}.")
        if not radius > 0 or warmup_steps < 0:
            raise ValueError("radius must be > 0 and warmup_steps >= 0.")
        self.radius, self.warmup_steps, self.privacy, self.relative = radius, warmup_steps, privacy, relative
        self._last_private_grad: dict[str, torch.Tensor] | None = None
        self._applied: dict[str, torch.Tensor] | None = None
        self.perturbation_norms: list[float] = []

    def dp_guarantee_notes(self) -> list[str]:
        if self.privacy == "paper":
            return ["within-layer flattening computed weight perturbations from raw (unclipped, un-noised) private "
                    "gradients (Chen et al. §2.3)"]
        return []

    def _direction(self, model: nn.Module, train_dataloader: Any) -> dict[str, torch.Tensor] | None:
        params = _trainable(model)
        if self.privacy == "strict":
            return self._last_private_grad  # None at the first step: no perturbation
        batch = next((b for b in iter(train_dataloader) if "labels" in b), None)
        if batch is None:
            raise ValueError("WithinLayerFlattening(privacy='paper') needs a training batch with `labels`; the train "
                             "dataloader yielded none.")
        device = next(iter(params.values())).device
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        loss = model(**batch).loss
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        return {n: (g if g is not None else torch.zeros_like(p)).detach() for (n, p), g in zip(params.items(), grads)}

    def on_step_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        if state.global_step >= self.warmup_steps or model is None:
            return
        direction = self._direction(model, train_dataloader)
        if direction is None:
            return
        params = _trainable(model)
        norm = math.sqrt(sum(float(d.pow(2).sum()) for d in direction.values()))
        if not norm > 0 or not math.isfinite(norm):
            return
        scale = self.radius / norm
        if self.relative:
            scale *= math.sqrt(sum(float(p.detach().pow(2).sum()) for p in params.values()))
        self._applied = {n: direction[n] * scale for n in params if n in direction}
        self.perturbation_norms.append(norm * scale)
        with torch.no_grad(), post_processing():  # a function of the last release (strict); "paper" is noted
            for n, v in self._applied.items():
                params[n].add_(v)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if model is None:
            return
        params = _trainable(model)
        if self._applied is not None:  # back to w: the gradient taken at w + v is applied to w
            with torch.no_grad(), post_processing():
                for n, v in self._applied.items():
                    params[n].sub_(v)
            self._applied = None
        if self.privacy == "strict":
            # The gradient the DPTrainer just released (noised): reusing it is post-processing.
            self._last_private_grad = {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}


class CrossModelFlattening(TrainerCallback):
    """Weight distillation ``λ ‖w − w_nor‖₂`` towards a reference ``w_nor`` (Chen et al. §2.1).

    Args:
        reference: ``{param name: tensor}`` (names as in ``model.named_parameters()``), e.g. a state dict of the
            same adapter trained elsewhere.
        source: where ``w_nor`` comes from: ``"public"`` (public data), ``"dp"`` (a DP run; its cost is its own),
            or ``"private_non_dp"`` (the paper's setting: trained normally on the private data — not strict).
        weight: ``λ`` (0.01 in the paper).
    """

    SOURCES = ("public", "dp", "private_non_dp")

    def __init__(self, reference: dict[str, torch.Tensor], source: str, weight: float = 0.01):
        if source not in self.SOURCES:
            raise ValueError(f"source must be one of {self.SOURCES}, got {source!r}.")
        self.reference = {n: t.detach().clone() for n, t in reference.items()}
        self.source, self.weight = source, weight

    def dp_guarantee_notes(self) -> list[str]:
        if self.source == "private_non_dp":
            return ["cross-model flattening towards weights trained without DP on the private data"]
        return []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        """Add ``λ (w − w_nor) / ‖w − w_nor‖`` to the already privatized gradient (data-independent given w_nor)."""
        params = _trainable(model)
        missing = [n for n in params if n not in self.reference]
        if missing:
            raise ValueError(f"The reference weights lack trainable parameters: {missing[:5]}")
        diffs = {n: p.detach() - self.reference[n].to(p.device, p.dtype) for n, p in params.items()}
        norm = math.sqrt(sum(float(d.pow(2).sum()) for d in diffs.values()))
        if norm == 0:
            return
        for n, p in params.items():
            extra = self.weight * diffs[n] / norm
            p.grad = extra if p.grad is None else p.grad + extra


class CrossLayerFlattening(TrainerCallback):
    """Greedy sparse prefix-layer selection by sharpness (Chen et al. Def. 1, Alg. 1 lines 2-15), for a PEFT
    prefix-tuning model.

    Before training, starting from prefixes at every layer, repeatedly drop the layer whose removal lowers the
    sharpness the most, until ``keep_layers`` remain or sharpness stops falling. A removed layer's prefix keys and
    values are set to zero and kept there (their gradients are zeroed after privatization) — a zero prefix only
    dilutes that layer's attention, the closest a fixed-length PEFT prefix gets to "no prefix".

    Args:
        batches: the batches sharpness is measured on (dicts with ``labels``).
        keep_layers: the sparsity target (number of prefix layers kept).
        data_is_public: ``True`` only if ``batches`` are public data. Otherwise the selection used private data
            without noise and the run is marked not strict.
        sharpness_kwargs: passed to :func:`hf_dp.sharpness` (default: Def. 1 maximised in Keskar's box,
            ``method="box"``; ``{"method": "paper"}`` for the paper's descent-line approximation).
    """

    def __init__(self, batches: Iterable[dict], keep_layers: int, data_is_public: bool = False,
                 sharpness_kwargs: dict[str, Any] | None = None):
        self.sharpness_kwargs = dict(sharpness_kwargs or {})
        self.batches = list(batches)
        self.keep_layers = keep_layers
        self.data_is_public = data_is_public
        self.removed: list[int] = []
        self.sharpness_trace: list[float] = []

    def dp_guarantee_notes(self) -> list[str]:
        if not self.data_is_public:
            return ["cross-layer flattening selected prefix layers by sharpness measured on private data"]
        return []

    @staticmethod
    def _prefix(model: nn.Module) -> tuple[nn.Parameter, Any]:
        config = model.peft_config[model.active_adapter]
        if str(config.peft_type.value) != "PREFIX_TUNING" or getattr(config, "prefix_projection", False):
            raise ValueError("CrossLayerFlattening needs a PEFT prefix-tuning model without prefix_projection.")
        return model.prompt_encoder[model.active_adapter].embedding.weight, config

    def _mask(self, weight: torch.Tensor, config: Any, layers: list[int]) -> torch.Tensor:
        """Boolean mask of the embedding columns holding the given layers' keys and values."""
        per_layer = 2 * config.token_dim
        mask = torch.zeros(weight.shape[1], dtype=torch.bool, device=weight.device)
        for layer in layers:
            mask[layer * per_layer:(layer + 1) * per_layer] = True
        return mask

    def select(self, model: nn.Module) -> list[int]:
        """Run the greedy elimination; returns the removed layers (also applied to the model). Its changes to the
        prefix are declared post-processing (on private batches the run is noted not strict)."""
        with post_processing():
            return self._select(model)

    def _select(self, model: nn.Module) -> list[int]:
        weight, config = self._prefix(model)
        kept = list(range(config.num_layers))
        original = weight.detach().clone()

        def score(removed: list[int]) -> float:
            with torch.no_grad():
                weight.copy_(original)
                weight[:, self._mask(weight, config, removed)] = 0
            return sharpness(model, self.batches, **self.sharpness_kwargs)

        current = score([])
        self.sharpness_trace = [current]
        while len(kept) > self.keep_layers:
            trials = {layer: score(self.removed + [layer]) for layer in kept}
            best = min(trials, key=trials.get)
            if trials[best] >= current:
                break  # sharpness stopped falling
            self.removed.append(best)
            kept.remove(best)
            current = trials[best]
            self.sharpness_trace.append(current)
        with torch.no_grad():
            weight.copy_(original)
            weight[:, self._mask(weight, config, self.removed)] = 0
        self.final_loss = mean_loss(model, self.batches)
        return self.removed

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == 0 and not self.removed:
            self.select(model)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if not self.removed:
            return
        weight, config = self._prefix(model)
        if weight.grad is not None:
            weight.grad[:, self._mask(weight, config, self.removed)] = 0  # removed prefixes stay at zero
