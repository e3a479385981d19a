"""TEST-ONLY shim: run accelerate's FSDP plugin on CPU (gloo), which accelerate itself never selects.

accelerate 1.15, ``accelerate/state.py``: ``PartialState._prepare_backend`` gives a CPU-only job the type
``MULTI_CPU`` (gloo; with ``use_cpu``) and ``AcceleratorState.__init__`` sets ``DistributedType.FSDP`` (and
``fsdp_plugin``) only inside ``elif self.distributed_type in [MULTI_GPU, MULTI_MLU, MULTI_SDAA, MULTI_MUSA, MULTI_NPU,
MULTI_XPU, MULTI_HPU, MULTI_NEURON]``. On CPU the plugin is therefore dropped without an error and the job runs as
DDP. torch's FSDP2 itself runs on CPU with gloo, so this shim builds the Accelerator as usual (MULTI_CPU) and then
flips the shared state to FSDP with the plugin, which is all ``Accelerator.prepare`` looks at. On GPUs none of this
is needed: accelerate's FSDP plugin is used as is. Never import this from the package.
"""

from __future__ import annotations

import os

import torch
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin


def force_fsdp_on_cpu(accelerator, plugin: FullyShardedDataParallelPlugin) -> None:
    """Turn the (Borg, process-wide) accelerate state of a MULTI_CPU job into FSDP with ``plugin``."""
    state = accelerator.state
    if state.distributed_type not in (DistributedType.MULTI_CPU, DistributedType.FSDP):
        raise RuntimeError(f"the CPU FSDP shim expects a MULTI_CPU job, got {state.distributed_type}")
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    AcceleratorState._shared_state["fsdp_plugin"] = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    # MULTI_CPU uses device cpu:0; FSDP compares it with the parameters' device ("cpu").
    state.device = torch.device("cpu")
    PartialState._shared_state["device"] = torch.device("cpu")


class CPUFSDPTrainerMixin:
    """Mix in before a Trainer class: with ``use_cpu=True`` and ``fsdp=``/``fsdp_config=`` (or ``accelerate launch
    --use_fsdp``), the job really shards with FSDP on CPU instead of silently running DDP."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if self.args.fsdp_plugin_args is not None:  # TrainingArguments(fsdp=..., fsdp_config=...)
            plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        elif os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":  # accelerate launch --use_fsdp
            plugin = FullyShardedDataParallelPlugin()
        else:
            return
        force_fsdp_on_cpu(self.accelerator, plugin)
        self.is_fsdp_enabled = True
