#!/usr/bin/env python
"""Step time of the README's main job, DP vs non-private, measured alternately in one process.

``examples/dp_text_classification.py --non_private_baseline`` runs the DP training and then the non-private one,
so on a shared machine a change of load between the two phases shows up in their ratio. This script runs a few
optimizer steps of each, alternating ``--rounds`` times, with the example's own model, data, arguments and
:class:`StepTimer`, and prints the median step time of each and their ratio (the noise calibration of
``on_train_begin`` is outside the steps; the DP self-check of the first step is off here)::

    python benchmarks/main_job_step_time.py                 # 3 rounds x 4 steps, expected batch 256
    python benchmarks/main_job_step_time.py --rounds 5 -- --num_trainable_layers 1 --learning_rate 1e-3

Arguments after ``--`` go to the example's parser.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import warnings
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "dp_text_classification.py"


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("example_args", nargs="*")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    spec = importlib.util.spec_from_file_location("dp_text_classification", EXAMPLE)
    ex = importlib.util.module_from_spec(spec)
    sys.modules["dp_text_classification"] = ex
    spec.loader.exec_module(ex)

    from transformers import AutoTokenizer, DataCollatorWithPadding, Trainer

    from hf_dp import DPTrainer

    script_args, dp_args = ex.parse_args(["--output_dir", "/tmp/main_job_step_time", "--max_steps", str(args.steps),
                                          "--dp_self_check", "false", "--disable_tqdm", "true",
                                          "--logging_steps", "1000", "--save_final_model", "false",
                                          *args.example_args])
    raw = ex.load_data(script_args, dp_args.seed)
    tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
    data = ex.tokenize(raw, tokenizer, script_args.max_seq_length)
    collator = DataCollatorWithPadding(tokenizer)
    labels = raw["train"].features["label"].names
    times: dict[str, list[float]] = {"dp": [], "non_private": []}
    for _ in range(args.rounds):
        for kind in ("dp", "non_private"):
            model, _ = ex.prepare_model(script_args, labels)
            timer = ex.StepTimer()
            if kind == "dp":
                trainer = DPTrainer(model=model, args=dp_args, train_dataset=data["train"], processing_class=tokenizer,
                                    data_collator=collator, callbacks=[timer])
            else:
                trainer = Trainer(model=model, args=ex.non_private_arguments(dp_args, args.steps),
                                  train_dataset=data["train"], processing_class=tokenizer, data_collator=collator,
                                  callbacks=[timer])
            trainer.train()
            times[kind] += timer.durations
    dp, np_ = statistics.median(times["dp"]), statistics.median(times["non_private"])
    print(f"median step: DP {dp:.3f} s, non-private {np_:.3f} s, ratio {dp / np_:.2f}x "
          f"({len(times['dp'])} / {len(times['non_private'])} steps, expected batch "
          f"{dp_args.per_device_train_batch_size * dp_args.gradient_accumulation_steps})")
    return {"dp": dp, "non_private": np_, "ratio": dp / np_}


if __name__ == "__main__":
    main()
