"""hf_dp: differentially private fine-tuning for the Hugging Face ecosystem.

Public API: everything a user needs is importable from here.
"""

from . import audit
from .accounting import MechanismRecord, PrivacyAccountant, calibrate_noise_multiplier, group_privacy
from .arguments import DPTrainingArguments, NotPrivateWarning
from .audit import CanaryExposureCallback, MembershipInferenceCallback, audit_report, make_canaries
from .callbacks import CrossLayerFlattening, CrossModelFlattening, WithinLayerFlattening
from .cards import card_from_dp_state, privacy_report, validate_card
from .clipping.engine import ClippingEngine
from .clipping.layers import UnsupportedLayerError
from .losses import causal_lm_loss, default_per_example_loss, sequence_classification_loss, token_loss
from .record import PrivacyRecord
from .sampling import PoissonBatchSampler, PoissonUserSampler, ShuffledBatchSampler
from .sharpness import loss_landscape, sharpness
from .synthetic import generate_synthetic_dataset, save_synthetic_dataset
from .trainer import DPTrainer

__version__ = "0.1.0"

_TRL_EXPORTS = {"DPSFTConfig": "sft", "DPSFTTrainer": "sft", "DPDPOConfig": "dpo", "DPDPOTrainer": "dpo",
                "DPRewardConfig": "reward", "DPRewardTrainer": "reward"}


def __getattr__(name: str):
    """The trl trainers — ``DPSFTTrainer`` / ``DPSFTConfig`` (``hf_dp/sft.py``), ``DPDPOTrainer`` / ``DPDPOConfig``
    (``hf_dp/dpo.py``), ``DPRewardTrainer`` / ``DPRewardConfig`` (``hf_dp/reward.py``) — need trl, an optional
    dependency (``pip install hf_dp[trl]``): they are imported on first use, so ``import hf_dp`` works without trl."""
    if name in _TRL_EXPORTS:
        import importlib

        try:
            module = importlib.import_module(f".{_TRL_EXPORTS[name]}", __name__)
        except ImportError as err:
            if getattr(err, "name", None) != "trl":
                raise
            raise ImportError(f"hf_dp.{name} needs trl: pip install 'hf_dp[trl]'.") from err
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CanaryExposureCallback",
    "MembershipInferenceCallback",
    "audit",
    "audit_report",
    "make_canaries",
    "ClippingEngine",
    "CrossLayerFlattening",
    "CrossModelFlattening",
    "DPDPOConfig",
    "DPDPOTrainer",
    "DPRewardConfig",
    "DPRewardTrainer",
    "DPSFTConfig",
    "DPSFTTrainer",
    "DPTrainer",
    "DPTrainingArguments",
    "MechanismRecord",
    "NotPrivateWarning",
    "PoissonBatchSampler",
    "PoissonUserSampler",
    "PrivacyAccountant",
    "PrivacyRecord",
    "ShuffledBatchSampler",
    "UnsupportedLayerError",
    "WithinLayerFlattening",
    "calibrate_noise_multiplier",
    "card_from_dp_state",
    "causal_lm_loss",
    "default_per_example_loss",
    "generate_synthetic_dataset",
    "group_privacy",
    "loss_landscape",
    "privacy_report",
    "save_synthetic_dataset",
    "sequence_classification_loss",
    "sharpness",
    "token_loss",
    "validate_card",
]
