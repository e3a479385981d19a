"""hf_dp: differentially private fine-tuning for the Hugging Face ecosystem.

Public API: everything a user needs is importable from here.
"""

from . import audit
from .accounting import MechanismRecord, PrivacyAccountant, calibrate_noise_multiplier, group_privacy
from .arguments import DPTrainingArguments, NotPrivateWarning
from .audit import CanaryExposureCallback, MembershipInferenceCallback, audit_report, make_canaries
from .callbacks import CrossLayerFlattening, CrossModelFlattening, WithinLayerFlattening
from .clipping.engine import ClippingEngine
from .clipping.layers import UnsupportedLayerError
from .losses import causal_lm_loss, default_per_example_loss, sequence_classification_loss, token_loss
from .sampling import PoissonBatchSampler, PoissonUserSampler, ShuffledBatchSampler
from .sharpness import loss_landscape, sharpness
from .trainer import DPTrainer

__version__ = "0.1.0"

__all__ = [
    "CanaryExposureCallback",
    "MembershipInferenceCallback",
    "audit",
    "audit_report",
    "make_canaries",
    "ClippingEngine",
    "CrossLayerFlattening",
    "CrossModelFlattening",
    "DPTrainer",
    "DPTrainingArguments",
    "MechanismRecord",
    "NotPrivateWarning",
    "PoissonBatchSampler",
    "PoissonUserSampler",
    "PrivacyAccountant",
    "ShuffledBatchSampler",
    "UnsupportedLayerError",
    "WithinLayerFlattening",
    "calibrate_noise_multiplier",
    "causal_lm_loss",
    "default_per_example_loss",
    "group_privacy",
    "loss_landscape",
    "sequence_classification_loss",
    "sharpness",
    "token_loss",
]
