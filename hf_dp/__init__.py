"""hf_dp: differentially private fine-tuning for the Hugging Face ecosystem.

Public API: everything a user needs is importable from here.
"""

from .accounting import MechanismRecord, PrivacyAccountant, calibrate_noise_multiplier, group_privacy
from .arguments import DPTrainingArguments, NotPrivateWarning
from .clipping.engine import ClippingEngine
from .clipping.layers import UnsupportedLayerError
from .losses import causal_lm_loss, default_per_example_loss, sequence_classification_loss, token_loss
from .sampling import PoissonBatchSampler, ShuffledBatchSampler
from .trainer import DPTrainer

__version__ = "0.1.0"

__all__ = [
    "ClippingEngine",
    "DPTrainer",
    "DPTrainingArguments",
    "MechanismRecord",
    "NotPrivateWarning",
    "PoissonBatchSampler",
    "PrivacyAccountant",
    "ShuffledBatchSampler",
    "UnsupportedLayerError",
    "calibrate_noise_multiplier",
    "causal_lm_loss",
    "default_per_example_loss",
    "group_privacy",
    "sequence_classification_loss",
    "token_loss",
]
