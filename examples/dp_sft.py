#!/usr/bin/env python
# /// script
# requires-python = ">=3.10"
# dependencies = ["hf_dp[trl]", "pyyaml"]
# ///
"""DP chat fine-tuning with trl (``DPSFTTrainer``) on real offline dialogs, after public pre-training.

1. **Public model** (not private): the small GPT-2 that ``examples/dp_clm.py`` pre-trains on Jane Austen's novels
   (same settings, same cache: ``$HF_DP_DATA_CACHE/models/``; pre-trained on first use).
2. **Private chats**: the ``chatterbot-corpus`` English dialogs (``examples/data.py``, BSD-3), each turned into a
   ``messages`` conversation (turns alternate user / assistant; a trailing user turn is dropped), formatted by a chat
   template (``User: ... / Bot: ...``) whose assistant turns are marked for trl's ``assistant_only_loss``: only the
   bot's replies are trained. One conversation is one privacy unit.
3. **DP SFT** with ``DPSFTTrainer`` / ``DPSFTConfig`` (ε = 8 by default), with ``packing=True``: each step's Poisson
   sample of conversations is packed padding-free and every conversation is clipped on its own. Full fine-tuning and
   LoRA (``--methods full lora``).
4. **Held-out metric**: completion perplexity (the bot's tokens only) on held-out conversations, next to the public
   model alone (ε = 0) and non-private SFT (trl's ``SFTTrainer``, packed, fixed batches of the DP run's expected
   size, the same number of steps).

Setup (once)::

    pip install -e ".[trl]" && bash examples/setup_data.sh

Ready-to-run commands::

    python examples/dp_sft.py                                   # full + LoRA, ε = 8, baselines
    python examples/dp_sft.py --methods lora --target_epsilon 3 --baselines false
    python examples/dp_sft.py --packing false                   # the same without packing (slower, same update)
    python examples/dp_sft.py --methods lora --load_in_4bit     # QLoRA: LoRA on a bitsandbytes nf4 base
    accelerate launch --config_file examples/accelerate_configs/multi_process.yaml examples/dp_sft.py \\
        --gradient_accumulation_steps 1 --methods lora --baselines false

Every ``trl.SFTConfig`` / ``hf_dp.DPTrainingArguments`` field is an option (``--help``). Privacy scope: (ε, δ)
covers the private training conversations; the public pre-training data, the held-out evaluation and any
hyperparameter choice made by looking at private results are not covered.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import datasets
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM, HfArgumentParser, PreTrainedTokenizerBase, set_seed

from hf_dp import DPSFTConfig, DPSFTTrainer

logger = logging.getLogger("dp_sft")

HERE = Path(__file__).resolve().parent
DEFAULT_TARGET_EPSILON = 8.0
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}Bot: {% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}\n"
    "{% else %}User: {{ m['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Bot: {% endif %}"
)


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
    """``examples/dp_clm.py``: its public pre-training (cached) and tokenizer."""
    return _load_module("hf_dp_example_dp_clm", "dp_clm.py")


@dataclass
class ScriptArguments:
    """Model, data and comparison arguments.

    Parameters:
        model_name_or_path (`str`, *optional*): a local causal LM (with tokenizer) instead of the public GPT-2.
        vocab_size, n_layer, n_embd, n_head, n_positions, pretrain_max_steps: the public GPT-2 of
            ``examples/dp_clm.py`` (same defaults, same cache).
        max_train_samples / max_eval_samples: seeded subsets of the conversations (held-out ones never trained on).
        methods: `full` and/or `lora` (one DP run each).
        lora_r, lora_alpha: LoRA settings (on GPT-2's `c_attn`, `c_proj`, `c_fc`).
        baselines (`bool`): also the public model alone and non-private SFT of the full model.
        load_in_4bit / load_in_8bit (`bool`): QLoRA — the public model is loaded quantised by bitsandbytes (nf4 or
            int8, computing in float32; `peft.prepare_model_for_kbit_training`) and only LoRA adapters are trained
            (`--methods lora`; a quantised base cannot be fully fine-tuned).
    """

    model_name_or_path: str | None = field(default=None, metadata={"help": "Local causal LM (default: public GPT-2)."})
    vocab_size: int = field(default=8192, metadata={"help": "GPT-2 BPE truncated to this many tokens."})
    n_layer: int = field(default=4, metadata={"help": "Layers of the public GPT-2."})
    n_embd: int = field(default=128, metadata={"help": "Width of the public GPT-2."})
    n_head: int = field(default=4, metadata={"help": "Heads of the public GPT-2."})
    n_positions: int = field(default=128, metadata={"help": "Context of the public GPT-2."})
    pretrain_max_steps: int = field(default=150, metadata={"help": "Public pre-training steps (Austen)."})
    pretrain_batch_size: int = field(default=32, metadata={"help": "Public pre-training batch (blocks)."})
    pretrain_block_size: int = field(default=64, metadata={"help": "Public pre-training block length."})
    model_cache_dir: str | None = field(default=None, metadata={"help": "Cache of pre-trained public models."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Seeded subset of training chats."})
    max_eval_samples: int = field(default=200, metadata={"help": "Held-out chats (never trained on)."})
    methods: list[str] = field(default_factory=lambda: ["full", "lora"], metadata={"help": "full and/or lora."})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha."})
    lora_learning_rate: float = field(default=5e-3, metadata={"help": "Learning rate of the LoRA run."})
    baselines: bool = field(default=True, metadata={"help": "Public model alone and non-private SFT."})
    load_in_4bit: bool = field(default=False, metadata={"help": "QLoRA: quantise the public model to nf4 "
                                                                "(bitsandbytes); LoRA only."})
    load_in_8bit: bool = field(default=False, metadata={"help": "Quantise the public model to int8 (bitsandbytes); "
                                                                "LoRA only."})

    def __post_init__(self) -> None:
        unknown = set(self.methods) - {"full", "lora"}
        if unknown or not self.methods:
            raise ValueError(f"methods must be among full, lora; got {self.methods}.")
        if self.load_in_4bit and self.load_in_8bit:
            raise ValueError("Choose one of --load_in_4bit and --load_in_8bit.")
        if (self.load_in_4bit or self.load_in_8bit) and "full" in self.methods:
            raise ValueError("A bitsandbytes-quantised model cannot be fully fine-tuned (its weights are frozen "
                             "integers): pass --methods lora with --load_in_4bit / --load_in_8bit.")


@dataclass
class DPSFTExampleConfig(DPSFTConfig):
    """``DPSFTConfig`` with defaults that run this example in minutes on 2 CPU cores: ε = 8 (unless
    ``--noise_multiplier``), expected batch 128 (64 × 2), DP-Adam lr 2e-3, 3 epochs, constant schedule,
    ``packing=True``, ``assistant_only_loss=True``, ``max_length=128``, no checkpoints."""

    output_dir: str | None = field(default="out/dp_sft", metadata={"help": "Where models and results go."})
    target_epsilon: float | None = field(default=None, metadata={"help": f"ε (default {DEFAULT_TARGET_EPSILON})."})
    per_device_train_batch_size: int = field(default=64, metadata={"help": "Micro-batch (memory only)."})
    gradient_accumulation_steps: int = field(default=2, metadata={"help": "Chunks per DP step."})
    learning_rate: float = field(default=2e-3, metadata={"help": "AdamW learning rate of the full run."})
    num_train_epochs: float = field(default=3.0, metadata={"help": "Epochs (ceil(N / expected batch) steps each)."})
    lr_scheduler_type: str = field(default="constant", metadata={"help": "Learning-rate schedule."})
    logging_steps: float = field(default=5, metadata={"help": "Log every this many steps."})
    save_strategy: str = field(default="no", metadata={"help": "Checkpoint strategy."})
    report_to: None | str | list[str] = field(default="none", metadata={"help": "Experiment trackers."})
    packing: bool = field(default=True, metadata={"help": "Pack each step's sampled chats (padding-free)."})
    assistant_only_loss: bool = field(default=True, metadata={"help": "Train on the bot's turns only."})
    max_length: int | None = field(default=128, metadata={"help": "Truncate each conversation to this many tokens."})
    seed: int = field(default=42, metadata={"help": "Seed of model init, data split and pre-training."})

    def __post_init__(self) -> None:
        if self.target_epsilon is None and self.noise_multiplier is None:
            self.target_epsilon = DEFAULT_TARGET_EPSILON
        super().__post_init__()


def parse_args(argv: Sequence[str] | None = None) -> tuple[ScriptArguments, DPSFTExampleConfig]:
    parser = HfArgumentParser((ScriptArguments, DPSFTExampleConfig))
    return _load_module("hf_dp_example_cli", "cli.py").parse_args(parser, argv)  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------------------------------
def public_model_path(script_args: ScriptArguments, tokenizer: PreTrainedTokenizerBase, seed: int) -> Path:
    """The public GPT-2 of ``examples/dp_clm.py`` (pre-trained on Austen and cached on first use)."""
    clm = clm_module()
    clm_args = clm.ScriptArguments(
        vocab_size=script_args.vocab_size, n_layer=script_args.n_layer, n_embd=script_args.n_embd,
        n_head=script_args.n_head, n_positions=script_args.n_positions,
        pretrain_max_steps=script_args.pretrain_max_steps, pretrain_batch_size=script_args.pretrain_batch_size,
        pretrain_block_size=script_args.pretrain_block_size, model_cache_dir=script_args.model_cache_dir)
    return clm.pretrain_public_lm(clm_args, tokenizer, seed)


def load_tokenizer(script_args: ScriptArguments) -> PreTrainedTokenizerBase:
    clm = clm_module()
    tok = clm.load_tokenizer(clm.ScriptArguments(vocab_size=script_args.vocab_size,
                                                 tokenizer_name_or_path=script_args.model_name_or_path))
    tok.chat_template = CHAT_TEMPLATE
    return tok


def load_chats(script_args: ScriptArguments, seed: int) -> datasets.DatasetDict:
    """chatterbot dialogs as ``messages`` (user / assistant alternating, ending with the assistant), split."""
    raw = clm_module().data_module().load_chatterbot()

    def to_messages(row: dict[str, Any]) -> dict[str, Any]:
        turns = [t for t in row["text"].split("\n") if t.strip()]
        turns = turns[: len(turns) // 2 * 2]
        return {"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": t}
                             for i, t in enumerate(turns)]}

    chats = raw.map(to_messages, remove_columns=["text"]).filter(lambda r: len(r["messages"]) >= 2)
    split = chats.train_test_split(test_size=script_args.max_eval_samples, seed=seed)
    train = split["train"]
    if script_args.max_train_samples is not None and script_args.max_train_samples < len(train):
        train = train.shuffle(seed=seed).select(range(script_args.max_train_samples))
    return datasets.DatasetDict(train=train, test=split["test"])


@torch.no_grad()
def completion_perplexity(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, chats: datasets.Dataset,
                          max_length: int | None, batch_size: int = 32) -> float:
    """``exp(Σ NLL / Σ tokens)`` over the assistant tokens of held-out chats (as ``assistant_only_loss`` labels
    them), each chat on its own (padded batch)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    rows = []
    for messages in chats["messages"]:
        enc = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = enc["input_ids"][:max_length], enc["assistant_masks"][:max_length]
        rows.append((ids, [t if m else -100 for t, m in zip(ids, mask)]))
    total, count = 0.0, 0
    for i in range(0, len(rows), batch_size):
        part = rows[i:i + batch_size]
        length = max(len(ids) for ids, _ in part)
        ids = torch.full((len(part), length), tokenizer.pad_token_id)
        labels = torch.full((len(part), length), -100)
        attention = torch.zeros((len(part), length), dtype=torch.long)
        for j, (x, y) in enumerate(part):
            ids[j, :len(x)], labels[j, :len(y)], attention[j, :len(x)] = torch.tensor(x), torch.tensor(y), 1
        logits = model(input_ids=ids.to(device), attention_mask=attention.to(device), use_cache=False).logits
        target = labels[:, 1:].to(device)
        total += float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), target.reshape(-1),
                                       ignore_index=-100, reduction="sum"))
        count += int(target.ne(-100).sum())
    model.train(was_training)
    return math.exp(total / max(count, 1))


def lora_config(script_args: ScriptArguments) -> Any:
    from peft import LoraConfig, TaskType

    return LoraConfig(task_type=TaskType.CAUSAL_LM, r=script_args.lora_r, lora_alpha=script_args.lora_alpha,
                      lora_dropout=0.0, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)


def load_private_start(public: Path, script_args: ScriptArguments) -> torch.nn.Module:
    """The public model to fine-tune: as saved, or quantised by bitsandbytes for QLoRA (``--load_in_4bit``: nf4
    with float32 compute, the QLoRA recipe of Dettmers et al. 2023; ``--load_in_8bit``), prepared with
    ``peft.prepare_model_for_kbit_training`` (which also turns on gradient checkpointing on the model)."""
    if not (script_args.load_in_4bit or script_args.load_in_8bit):
        return AutoModelForCausalLM.from_pretrained(public)
    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    if script_args.load_in_4bit:
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    else:
        quant = BitsAndBytesConfig(load_in_8bit=True)
    device_map = {"": torch.cuda.current_device()} if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(public, quantization_config=quant, device_map=device_map,
                                                 dtype=torch.float32)
    return prepare_model_for_kbit_training(model)


def dp_run(method: str, public: Path, script_args: ScriptArguments, args: DPSFTExampleConfig,
           tokenizer: PreTrainedTokenizerBase, chats: datasets.DatasetDict) -> dict[str, Any]:
    set_seed(args.seed)
    run_args = dataclasses.replace(args, output_dir=os.path.join(args.output_dir, f"dp_{method}"))
    if method == "lora":
        run_args = dataclasses.replace(run_args, learning_rate=script_args.lora_learning_rate)
    trainer = DPSFTTrainer(model=load_private_start(public, script_args), args=run_args,
                           train_dataset=chats["train"], processing_class=tokenizer,
                           peft_config=lora_config(script_args) if method == "lora" else None)
    result = trainer.train()
    privacy = trainer.privacy_spent()
    if run_args.should_save:
        trainer.save_model()
    quantised = " on nf4" if script_args.load_in_4bit else " on int8" if script_args.load_in_8bit else ""
    return {**privacy, "run": f"DP SFT of public model ({method}{quantised})",
            "runtime": result.metrics["train_runtime"],
            "trainable": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
            "perplexity": completion_perplexity(trainer.model, tokenizer, chats["test"], args.max_length)}


def non_private_run(public: Path, args: DPSFTExampleConfig, steps: int, tokenizer: PreTrainedTokenizerBase,
                    chats: datasets.DatasetDict, peft_config: Any = None) -> dict[str, Any]:
    """trl's own SFTTrainer (dataset-level packing, fixed batches of the DP run's expected size), same steps; with
    ``peft_config`` (e.g. :func:`lora_config`) LoRA instead of the full model."""
    from trl import SFTConfig, SFTTrainer

    set_seed(args.seed)
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(SFTConfig) if f.init}
    values.update(output_dir=os.path.join(args.output_dir, "non_private"), max_steps=steps, save_strategy="no",
                  max_grad_norm=1.0, bf16=False)
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(public), args=SFTConfig(**values),
                         train_dataset=chats["train"], processing_class=tokenizer, peft_config=peft_config)
    result = trainer.train()
    method = "full" if peft_config is None else "lora"
    return {"run": f"non-private SFT of public model ({method})", "epsilon": math.inf,
            "steps": trainer.state.global_step, "runtime": result.metrics["train_runtime"],
            "trainable": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
            "perplexity": completion_perplexity(trainer.model, tokenizer, chats["test"], args.max_length)}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    start = time.perf_counter()
    script_args, args = parse_args(argv)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", datefmt="%H:%M:%S",
                        handlers=[logging.StreamHandler(sys.stdout)])
    logger.setLevel(logging.INFO if args.should_log else args.get_process_log_level())
    logging.getLogger("hf_dp").setLevel(logging.INFO if args.should_log else args.get_process_log_level())
    transformers.utils.logging.set_verbosity(args.get_process_log_level())
    datasets.utils.logging.set_verbosity(logging.WARNING)
    datasets.disable_progress_bars()

    tokenizer = load_tokenizer(script_args)
    if script_args.model_name_or_path is not None:
        public = Path(script_args.model_name_or_path)
    else:
        with args.main_process_first(desc="public pre-training"):
            public = public_model_path(script_args, tokenizer, args.seed)
    chats = load_chats(script_args, args.seed)
    logger.info("chatterbot: %d training / %d held-out conversations", len(chats["train"]), len(chats["test"]))

    rows: list[dict[str, Any]] = []
    if script_args.baselines:
        rows.append({"run": "public model alone (no private data)", "epsilon": 0.0, "steps": 0,
                     "perplexity": completion_perplexity(AutoModelForCausalLM.from_pretrained(public), tokenizer,
                                                         chats["test"], args.max_length)})
    for method in script_args.methods:
        rows.append(dp_run(method, public, script_args, args, tokenizer, chats))
    if script_args.baselines:
        steps = max(r["steps"] for r in rows if r.get("delta") is not None)
        rows.append(non_private_run(public, args, steps, tokenizer, chats))

    results = {"runs": rows, "public_model": str(public), "train": len(chats["train"]), "test": len(chats["test"]),
               "wall_time": time.perf_counter() - start}
    if args.process_index == 0:
        print("\n" + "=" * 100)
        print(f"DP chat SFT on chatterbot ({len(chats['train'])} train / {len(chats['test'])} held-out "
              f"conversations, <= {args.max_length} tokens, packing={args.packing}, assistant-only loss, "
              f"C={args.per_sample_max_grad_norm}); public model: {public.name}")
        print(f"{'run':<42}{'ε':>8}{'steps':>7}{'σ':>8}{'trainable':>11}{'completion ppl':>16}{'train s':>9}")
        for r in rows:
            eps = r.get("epsilon")
            eps = "inf" if eps is not None and math.isinf(eps) else f"{eps:.3f}"
            sigma = "-" if r.get("noise_multiplier") is None else f"{r['noise_multiplier']:.3f}"
            trainable = "-" if r.get("trainable") is None else f"{r['trainable']:,}"
            runtime = "-" if r.get("runtime") is None else f"{r['runtime']:.0f}"
            print(f"{r['run']:<42}{eps:>8}{r['steps']:>7}{sigma:>8}{trainable:>11}{r['perplexity']:>16.2f}"
                  f"{runtime:>9}")
        dp = next((r for r in rows if r.get("delta") is not None), None)
        if dp is not None:
            print(f"privacy: ({dp['epsilon']:.3f}, {dp['delta']:.3g})-DP per conversation, {dp['accountant']} "
                  f"accountant, q={dp['sample_rate']:.4f}, guarantee: {dp['dp_guarantee']}")
        print(f"total wall time: {time.perf_counter() - start:.1f} s")
        print("=" * 100)
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=2, default=str)
    return results


if __name__ == "__main__":
    main()
