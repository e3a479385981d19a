"""Worker for tests/test_dpo.py: one DP-DPO step per process (σ = 0); writes what each rank ended with.

Run under `accelerate launch --num_processes 2 tests/scripts/dpo_worker.py OUT C`.
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from helpers import close_distributed, tiny_llama  # noqa: E402
from helpers.preference import distributed_pairs, dpo_args  # noqa: E402
from helpers.preference import make_dpo_trainer as make_trainer  # noqa: E402

# N = 8 rows = per_device 2 × GA 2 × 2 processes: q = 1.
PER_DEVICE, GA = 2, 2


def main(out_dir: str, clip: float) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)  # same init on every rank (DDP also broadcasts rank 0's parameters)
    model = tiny_llama().double()
    trainer = make_trainer(model, distributed_pairs(),
                           dpo_args(out_dir, per_device=PER_DEVICE, ga=GA, per_sample_max_grad_norm=clip))
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    trainer.train()
    rank = trainer.args.process_index
    os.makedirs(out_dir, exist_ok=True)
    torch.save({k: p.detach() - before[k] for k, p in model.named_parameters()},
               os.path.join(out_dir, f"update_rank{rank}.pt"))
    with open(os.path.join(out_dir, f"info_rank{rank}.json"), "w") as f:
        json.dump({"world_size": trainer.args.world_size, "expected_batch_size": trainer.expected_batch_size,
                   "sample_rate": trainer.sample_rate, "num_examples": trainer.num_examples_private,
                   "steps": trainer.accountant.steps, "nonfinite": trainer.nonfinite_examples}, f)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
    close_distributed()
