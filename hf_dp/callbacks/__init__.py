"""Optional behaviour for DPTrainer as ``TrainerCallback``s."""

from .flatness import CrossLayerFlattening, CrossModelFlattening, WithinLayerFlattening

__all__ = ["CrossLayerFlattening", "CrossModelFlattening", "WithinLayerFlattening"]
