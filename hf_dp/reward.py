"""DP reward modelling with trl: :class:`DPRewardTrainer` and :class:`DPRewardConfig`.

``DPRewardTrainer`` is trl's ``RewardTrainer`` — a sequence-classification model with one output scored on the chosen
and the rejected sequence of each preference row, trained with the pairwise (Bradley-Terry) loss
``-log σ(r_chosen - r_rejected - margin)`` (Ouyang et al. 2022, eq. 1), plus trl's optional
``center_rewards_coefficient · (r_chosen + r_rejected)²`` (Eisenstein et al. 2023) — whose optimizer steps are
:class:`~hf_dp.DPTrainer`'s DP steps. **The privacy unit is one preference row** (its two sequences clipped together,
``hf_dp/preference.py``); the loss of a row is trl's loss on a batch of that row alone (trl averages it over the
rows of a batch; DP-SGD sums the clipped per-row gradients and divides by the expected number of rows). An optional
``margin`` column is the row's own. Refused: activation (gradient) checkpointing and offloading.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from trl import RewardConfig, RewardTrainer

from .arguments import DPTrainingArguments, TrlOverridesUnderDP
from .preference import PreferencePairsDP, dp_config

__all__ = ["DPRewardConfig", "DPRewardTrainer"]


@dataclass
class DPRewardConfig(TrlOverridesUnderDP, RewardConfig, DPTrainingArguments):
    r"""Configuration of [`DPRewardTrainer`]: trl's `RewardConfig` plus every field of [`DPTrainingArguments`].

    trl's defaults are kept (`max_length=1024`, `disable_dropout=True`, `learning_rate=1e-4`,
    `gradient_checkpointing=True`, ...), except `bf16` (when not set: `True` only with an accelerator and no `fp16`)
    and `max_grad_norm` (`0.0`: DP clips per row with `per_sample_max_grad_norm`).
    `per_device_train_batch_size` and the expected batch count preference rows (each is two sequences).
    """

    def __post_init__(self):
        super().__post_init__()
        if self.activation_offloading:
            raise ValueError("activation_offloading is not supported under DP (untested with the per-example hooks).")


class _RewardTrainer(RewardTrainer):
    """``RewardTrainer`` taking its ``peft_config`` as ``trl_peft_config`` (``DPTrainer.__init__`` consumes a
    ``peft_config`` keyword itself; here trl applies the adapter)."""

    def __init__(self, *args: Any, trl_peft_config: Any = None, **kwargs: Any):
        super().__init__(*args, peft_config=trl_peft_config, **kwargs)


class DPRewardTrainer(PreferencePairsDP, _RewardTrainer):
    """trl's ``RewardTrainer`` whose optimizer steps are DP-SGD / DP-Adam steps, one preference row as the unit.

    Use it as ``RewardTrainer``, with :class:`DPRewardConfig`::

        model = AutoModelForSequenceClassification.from_pretrained(name, num_labels=1)
        args = DPRewardConfig(output_dir="out", target_epsilon=8.0, per_sample_max_grad_norm=1.0,
                              per_device_train_batch_size=8, gradient_accumulation_steps=8)
        trainer = DPRewardTrainer(model=model, args=args, train_dataset=pairs, processing_class=tokenizer)
        trainer.train()
    """

    _name = "DP-Reward"
    _dp_compute_loss_is_not_trained = True  # trl's compute_loss (batch mean) serves evaluation only
    non_model_keys = frozenset({"margin"})

    def compute_loss(self, *args: Any, **kwargs: Any):
        """trl's ``compute_loss``, used by evaluation only (a DP step clips each row's own loss)."""
        return super().compute_loss(*args, **kwargs)

    def __init__(self, model: Any, args: Any = None, *pargs: Any, peft_config: Any = None, **kwargs: Any):
        if kwargs.get("per_example_loss") is not None:
            raise ValueError("DPRewardTrainer trains trl's pairwise loss of each preference row; per_example_loss is "
                             "not accepted.")
        args = dp_config(DPRewardConfig, args, "DPRewardTrainer")
        super().__init__(model, args, *pargs, trl_peft_config=peft_config, **kwargs)
        # trl's: no label names, so that evaluation calls trl's compute_loss (DPTrainer set ["labels"] for column
        # removal; the training labels are added by the checked collator after it, PreferencePairsDP).
        self.label_names = []

    def expected_sequences(self, feature: dict) -> tuple[list[int], list[int]]:
        """trl's reward ``DataCollatorForPreference``: the chosen and rejected token ids as they are."""
        return list(feature["chosen_ids"]), list(feature["rejected_ids"])

    def pair_labels(self, batch: dict, num_rows: int) -> torch.Tensor:
        """Each sequence's label is its row's margin (0 without a ``margin`` column): ``(2B,)``."""
        margin = batch.get("margin")
        if margin is None:
            margin = torch.zeros(num_rows)
        return torch.cat([margin, margin])

    @staticmethod
    def _rewards(outputs: Any) -> torch.Tensor:
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
        if logits.dim() != 2 or logits.shape[-1] != 1:
            raise ValueError(f"A reward model outputs one score per sequence (num_labels=1); got logits of shape "
                             f"{tuple(logits.shape)}.")
        return logits.squeeze(-1)

    def sequence_scores(self, outputs: Any, labels: torch.Tensor) -> torch.Tensor:
        """Each sequence's reward (what the row's loss is a function of), for the first-step checks."""
        return self._rewards(outputs)

    def pair_losses(self, outputs: Any, labels: torch.Tensor) -> torch.Tensor:
        """trl's ``RewardTrainer.compute_loss`` on each row alone: ``(2m,)``, row ``r``'s loss at ``r``, 0 at
        ``m + r``."""
        rewards_chosen, rewards_rejected = self._rewards(outputs).chunk(2)
        margin = labels.chunk(2)[0].to(rewards_chosen.device)
        loss = -F.logsigmoid(rewards_chosen - rewards_rejected - margin)
        if self.args.center_rewards_coefficient is not None:
            loss = loss + self.args.center_rewards_coefficient * (rewards_chosen + rewards_rejected) ** 2
        return torch.cat([loss, torch.zeros_like(loss.detach())])
