"""Worker for tests/distributed/test_distributed.py: one short DP run per process; writes what each rank ended with.

Run under `accelerate launch --cpu --num_processes 2 tests/scripts/dist_worker.py OUT SIGMA [CLIPPING STEPS] ...`:
several runs (groups of OUT SIGMA CLIPPING STEPS) one after another in the same two processes, each a fresh model and
trainer, so the test pays the launch (two imports of torch/transformers) once.
"""

import json
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from helpers import close_distributed, lm_dataset, tiny_gpt2  # noqa: E402

from hf_dp import DPTrainer, DPTrainingArguments  # noqa: E402


def main(out_dir: str, sigma: float, clipping: str = "flat", steps: int = 1) -> None:
    torch.manual_seed(0)  # same init on every rank (DDP also broadcasts rank 0's parameters)
    model = tiny_gpt2().double()
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = DPTrainingArguments(
            output_dir=out_dir, noise_multiplier=sigma, per_sample_max_grad_norm=0.5, per_device_train_batch_size=3,
            gradient_accumulation_steps=2, max_steps=steps, learning_rate=1.0,
            clipping=clipping, optim="sgd", lr_scheduler_type="constant",
            weight_decay=0.0, use_cpu=os.environ.get("HF_DP_TEST_USE_CPU", "1") == "1", report_to="none",
            save_strategy="no", dp_seed=17, disable_tqdm=True,
        )
    trainer = DPTrainer(model=model, args=args, train_dataset=lm_dataset(24, seed=3))
    result = trainer.train()
    rank = trainer.args.process_index
    gc = trainer.group_clipper
    update = {k: (before[k] - p.detach()) for k, p in model.named_parameters()}
    torch.save(update, os.path.join(out_dir, f"update_rank{rank}.pt"))
    with open(os.path.join(out_dir, f"info_rank{rank}.json"), "w") as f:
        json.dump({"world_size": trainer.args.world_size, "expected_batch_size": trainer.expected_batch_size,
                   "sample_rate": trainer.sample_rate, "epsilon": trainer.privacy_spent()["epsilon"],
                   "steps": trainer.accountant.steps, "seed": trainer._noise.seed,
                   "training_loss": result.training_loss,
                   "thresholds": None if gc is None else gc.thresholds.tolist(),
                   "groups": None if gc is None else [g.params for g in gc.groups]}, f)


if __name__ == "__main__":
    argv = sys.argv[1:]
    if len(argv) == 2:
        main(argv[0], float(argv[1]))
    else:
        assert len(argv) % 4 == 0, argv
        for i in range(0, len(argv), 4):
            main(argv[i], float(argv[i + 1]), argv[i + 2], int(argv[i + 3]))
    close_distributed()
