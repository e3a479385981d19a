#!/usr/bin/env python
"""Cost of the once-per-run counterfactual check (DESIGN invariant 12, ``hf_dp/counterfactual.py``) against a DP step.

Runs ``--steps`` DP steps (``dp_self_check`` off, σ = 1, AdamW) of a random-init model on rows of random lengths
between ``T/8`` and ``T`` (padded by the collator, right side), one intra-op thread, and reports the process CPU time
(stable on a shared machine) and wall time of:

* ``known``: the train-start refusals from the configuration (:meth:`DPTrainer._check_known_dependences`: the hard
  batch collated; a left-padding probe only when the batch is left-padded);
* ``alone``: the first-step counterfactual check (:meth:`DPTrainer._check_examples_alone`: the first micro-batch
  and the hard batch, up to 4 examples each re-collated alone);
* a DP step: the median of steps 2.. (the first step, which also holds the other first-step checks, is not counted).

    python benchmarks/alone_cost.py                      # GPT-2 layout 4 x 256, vocab 8192, T=128, B=16
    python benchmarks/alone_cost.py --arch bert --batch-size 32
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=["gpt2", "bert"], default="gpt2")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--examples", type=int, default=512)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")

    import torch
    from datasets import Dataset
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel, TrainerCallback

    from hf_dp import DPTrainer, DPTrainingArguments

    torch.set_num_threads(1)
    torch.manual_seed(0)
    t = args.seq_len
    if args.arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.heads,
                                           vocab_size=args.vocab, n_positions=t, resid_pdrop=0.0, embd_pdrop=0.0,
                                           attn_pdrop=0.0))
    else:
        model = BertForSequenceClassification(BertConfig(
            num_hidden_layers=args.layers, hidden_size=args.width, num_attention_heads=args.heads,
            intermediate_size=4 * args.width, vocab_size=args.vocab, max_position_embeddings=t, num_labels=2,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(max(2, t // 8), t + 1, (args.examples,), generator=g).tolist()
    ids = [torch.randint(1, args.vocab, (n,), generator=g).tolist() for n in lengths]
    labels = ids if args.arch == "gpt2" else [i % 2 for i in range(args.examples)]
    data = Dataset.from_dict({"input_ids": ids, "labels": labels})

    def collate(features):
        longest = max(len(f["input_ids"]) for f in features)
        batch = {"input_ids": torch.tensor([f["input_ids"] + [0] * (longest - len(f["input_ids"])) for f in features]),
                 "attention_mask": torch.tensor([[1] * len(f["input_ids"]) + [0] * (longest - len(f["input_ids"]))
                                                 for f in features])}
        lab = [f["labels"] for f in features]
        batch["labels"] = torch.tensor([x + [-100] * (longest - len(x)) for x in lab] if args.arch == "gpt2" else lab)
        return batch

    class Steps(TrainerCallback):
        def __init__(self):
            self.cpu, self.wall = [], []

        def on_step_begin(self, *a, **k):
            self.t = (time.process_time(), time.perf_counter())

        def on_step_end(self, *a, **k):
            self.cpu.append(time.process_time() - self.t[0])
            self.wall.append(time.perf_counter() - self.t[1])

    timed: dict[str, tuple[float, float]] = {}

    def timing(name, fn):
        def wrapped(*a, **k):
            c, w = time.process_time(), time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timed[name] = (time.process_time() - c, time.perf_counter() - w)
        return wrapped

    dp_args = DPTrainingArguments(
        output_dir="/tmp/hf_dp_alone_cost", per_device_train_batch_size=args.batch_size, max_steps=args.steps,
        noise_multiplier=1.0, per_sample_max_grad_norm=1.0, poisson_sampling=False, use_cpu=True, report_to="none",
        save_strategy="no", disable_tqdm=True, logging_strategy="no", dp_self_check=False, learning_rate=1e-5)
    steps = Steps()
    trainer = DPTrainer(model=model, args=dp_args, train_dataset=data, data_collator=collate, callbacks=[steps])
    trainer._check_known_dependences = timing("known", trainer._check_known_dependences)
    trainer._check_examples_alone = timing("alone", trainer._check_examples_alone)
    trainer.train()
    step_cpu, step_wall = statistics.median(steps.cpu[1:]), statistics.median(steps.wall[1:])
    out = {"step_cpu": step_cpu, "step_wall": step_wall}
    print(f"{args.arch} {args.layers}x{args.width}, vocab {args.vocab}, rows of {t // 8}-{t} tokens, batch "
          f"{args.batch_size}: DP step {step_cpu:.3f} s CPU ({step_wall:.3f} s wall, median of {len(steps.cpu) - 1})")
    for name, (cpu, wall) in timed.items():
        out[name] = cpu
        print(f"  {name}: {cpu:.3f} s CPU ({wall:.3f} s wall) = {cpu / step_cpu:.2f} DP steps, once per run")
    return out


if __name__ == "__main__":
    main()
