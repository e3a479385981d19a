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
from .clipping.rules import UnsupportedLayerError, Use, register_layer_rule, unregister_layer_rule
from .guarantee import post_processing
from .history import attach_privacy_history, read_privacy_history
from .losses import causal_lm_loss, default_per_example_loss, sequence_classification_loss, token_loss
from .optim import DPAdamBC
from .plan import plan_privacy
from .probe import plan_probe_then_finetune, probe_epsilon, probe_then_finetune, train_only
from .record import PrivacyRecord
from .sampling import PoissonBatchSampler, PoissonUserSampler, ShuffledBatchSampler
from .sharpness import loss_landscape, sharpness
from .synthetic import generate_synthetic_dataset, save_synthetic_dataset
from .trainer import DPTrainer
from .units import chunk_documents, looks_grouped

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
    "attach_privacy_history",
    "audit_report",
    "make_canaries",
    "plan_privacy",
    "plan_probe_then_finetune",
    "probe_epsilon",
    "probe_then_finetune",
    "train_only",
    "ClippingEngine",
    "CrossLayerFlattening",
    "CrossModelFlattening",
    "DPAdamBC",
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
    "Use",
    "WithinLayerFlattening",
    "calibrate_noise_multiplier",
    "card_from_dp_state",
    "chunk_documents",
    "causal_lm_loss",
    "default_per_example_loss",
    "generate_synthetic_dataset",
    "group_privacy",
    "looks_grouped",
    "loss_landscape",
    "post_processing",
    "privacy_report",
    "read_privacy_history",
    "register_layer_rule",
    "save_synthetic_dataset",
    "sequence_classification_loss",
    "sharpness",
    "token_loss",
    "unregister_layer_rule",
    "validate_card",
]
