"""Worker for tests/trl_trainers/test_sft.py: one packed DP-SFT step per process, for each given σ; writes what each
rank ended with.

Run under `accelerate launch --num_processes 2 tests/scripts/sft_worker.py OUT C SIGMA [SIGMA ...]`. Each σ is one
run from the same initial model (so σ = 0 and σ > 0 share one launch: the launch, not the step, costs the time).
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from helpers import close_distributed, make_sft_trainer, sft_args, sft_distributed_dataset, tiny_llama  # noqa: E402

# N = 8 rows = per_device 2 × GA 2 × 2 processes: q = 1.
PER_DEVICE, GA = 2, 2


def main(out_dir: str, clip: float, sigmas: list[float]) -> None:
    torch.set_num_threads(1)
    for sigma in sigmas:
        run_dir = os.path.join(out_dir, f"sigma{sigma}")
        torch.manual_seed(0)  # same init on every rank (DDP also broadcasts rank 0's parameters)
        model = tiny_llama().double()
        args = sft_args(run_dir, per_device=PER_DEVICE, ga=GA, packing=True, assistant_only_loss=True,
                        per_sample_max_grad_norm=clip, noise_multiplier=sigma,
                        flat_clipping_passes="auto")  # trl's checkpointing on: two passes across ranks
        trainer = make_sft_trainer(model, sft_distributed_dataset(), args)
        before = {k: p.detach().clone() for k, p in model.named_parameters()}
        trainer.train()
        rank = trainer.args.process_index
        os.makedirs(run_dir, exist_ok=True)
        torch.save({k: p.detach() - before[k] for k, p in model.named_parameters()},
                   os.path.join(run_dir, f"update_rank{rank}.pt"))
        with open(os.path.join(run_dir, f"info_rank{rank}.json"), "w") as f:
            json.dump({"world_size": trainer.args.world_size, "padding_free": trainer.padding_free,
                       "expected_batch_size": trainer.expected_batch_size, "sample_rate": trainer.sample_rate,
                       "num_examples": trainer.num_examples_private, "steps": trainer.accountant.steps}, f)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), [float(s) for s in sys.argv[3:]])
    close_distributed()
