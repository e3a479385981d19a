#!/usr/bin/env python
# /// script
# requires-python = ">=3.10"
# dependencies = ["hf_dp", "pyyaml"]
# ///
"""DP synthetic text end to end, at small scale: Yu et al. 2024's pipeline on real, offline data.

Yu et al. 2024, "Training Private and Efficient Language Models with Synthetic Data from LLMs"
(``/work/shared/papers/003_06dc38a508f7695a.txt``, Fig. 1): a *large* causal LM is fine-tuned with DP on the private
data; it generates synthetic text (unconditional top-k sampling); *small* models are trained on the synthetic text
with ordinary optimizers (post-processing: no extra privacy cost); this is compared with training the small model
directly with DP on the private data, by next-token accuracy on held-out real text (their Table 1).

Here, at a scale that runs on 2 CPU cores in a few minutes:

* public data (not private; used for the tokenizer and for "pre-training"): Jane Austen's novels (public domain);
* private data: N epigrams of Debian ``fortunes`` (``examples/data.py``), plus a held-out real test split;
* tokenizer: bytes (256 byte values + ``<|endoftext|>``; nothing is fitted, so nothing leaks; ``--vocab_size`` > 257
  fits BPE merges, on the *public* text only: a tokenizer fitted on the private data would leak it);
* "large" generator: a GPT-2 (2 layers, width 64) pre-trained on the public text, then DP-fine-tuned (DP-Adam,
  Poisson sampling, PRV accounting) on the private data to ε = 8; its model card (``generator/README.md``) carries
  the ``differential_privacy`` metadata;
* synthetic data: ``hf_dp.synthetic.generate_synthetic_dataset`` (top-k = 50), saved with a dataset card carrying the
  generator's record (``synthetic/README.md``);
* small model: a GPT-2 (1 layer, width 32) pre-trained on the public text, then trained (a) with DP on the real
  private data, same ε, or (b) without DP on the synthetic data; (c) as a floor, no private data at all.

The public pre-trained models and the tokenizer are cached (``--cache_dir``), so a second run skips them.

Ready-to-run commands::

    python examples/dp_synthetic_data.py                       # defaults: ε = 8, N = 2000; ~4-6 min on 2 cores
    python examples/dp_synthetic_data.py --non_private_baseline  # also: the small model trained on real data, no DP
    python examples/dp_synthetic_data.py --target_epsilon 3 --num_synthetic 8000 --top_k 200
    python examples/dp_synthetic_data.py --generator_lora_r 8   # DP LoRA on the generator, as the paper does
    python examples/dp_synthetic_data.py --public_generator_control  # + synthetic text of the public-only generator
    python examples/dp_synthetic_data.py --generator_layers 4 --generator_dim 128 --generator_pretrain_steps 2000

What to expect. Yu et al.'s gain comes from a generator far stronger than the small model (Llama 2 7B vs 4.4M
parameters). Here the generator has ~5x the small model's parameters and little pre-training, so the synthetic route
lands close to direct DP training of the small model (two runs at the defaults: DP on real 24.6 / 24.2 %, synthetic
24.2 / 24.4 %; synthetic from the public-only generator 23.9 %, non-private on real 25.4 %, public pre-training only
17.4 %), and most of what the synthetic data teaches the small model is distillation of the larger public model, not
private information (``--public_generator_control`` measures that). Scale the generator up to see the paper's
effect. The numbers move with the settings and with the DP noise (the DP seed is secret, so runs differ); every setting
tried on the private data is itself a use of the private data that the reported ε does not count (see the generator's
card). The first run also pre-trains the two public models (a few more minutes; cached afterwards).

Every field of :class:`SyntheticDataArguments` is a command-line option (``--help``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import datasets  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
    set_seed,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import load_austen, load_fortunes  # noqa: E402

from hf_dp import DPTrainer, DPTrainingArguments  # noqa: E402
from hf_dp.synthetic import generate_synthetic_dataset, save_synthetic_dataset  # noqa: E402

logger = logging.getLogger("dp_synthetic_data")
EOS = "<|endoftext|>"


@dataclass
class SyntheticDataArguments:
    """Settings of the pipeline (defaults: a few minutes on 2 CPU cores)."""

    output_dir: str = field(default="dp_synthetic_output", metadata={"help": "Cards, synthetic data, results."})
    cache_dir: str = field(
        default=str(Path.home() / ".cache" / "hf_dp" / "synthetic_example"),
        metadata={"help": "Cache of the public tokenizer and the public pre-trained models."},
    )
    seed: int = field(default=0, metadata={"help": "Seed of data splits, initialisation and generation."})
    # data
    num_private: int = field(default=2000, metadata={"help": "N: private training examples (fortunes)."})
    num_test: int = field(default=500, metadata={"help": "Held-out real examples for next-token accuracy."})
    max_length: int = field(default=64, metadata={"help": "Tokens per example (with the start/end tokens)."})
    vocab_size: int = field(
        default=257,
        metadata={"help": "257: the 256 bytes + <|endoftext|>, nothing fitted. More: BPE merges fitted on the public "
                          "text only."},
    )
    # privacy
    target_epsilon: float = field(default=8.0, metadata={"help": "ε of both DP runs (generator and small model)."})
    target_delta: float = field(default=1e-5, metadata={"help": "δ of both DP runs."})
    per_sample_max_grad_norm: float = field(default=1.0, metadata={"help": "C of both DP runs."})
    dp_batch_size: int = field(default=64, metadata={"help": "Expected DP batch size (Poisson)."})
    dp_epochs: float = field(default=3.0, metadata={"help": "Epochs of both DP runs."})
    # generator ("large")
    generator_layers: int = field(default=2, metadata={"help": "Generator GPT-2 layers."})
    generator_dim: int = field(default=64, metadata={"help": "Generator GPT-2 width."})
    generator_pretrain_steps: int = field(default=250, metadata={"help": "Public pre-training steps (batch 32)."})
    generator_lr: float = field(default=1e-2, metadata={"help": "DP fine-tuning learning rate of the generator."})
    generator_lora_r: int = field(default=0, metadata={"help": "0: full DP fine-tuning; > 0: DP LoRA of this rank."})
    # synthetic data
    num_synthetic: int = field(default=2000, metadata={"help": "Synthetic texts to generate (Yu et al.: ~10 N)."})
    top_k: int = field(default=50, metadata={"help": "Top-k sampling (Yu et al. use 50 or 200; 0 = ∞)."})
    # small model
    small_layers: int = field(default=1, metadata={"help": "Small GPT-2 layers."})
    small_dim: int = field(default=32, metadata={"help": "Small GPT-2 width."})
    small_pretrain_steps: int = field(default=250, metadata={"help": "Public pre-training steps (batch 32)."})
    small_dp_lr: float = field(default=1e-2, metadata={"help": "Learning rate of the small model's DP run."})
    small_lr: float = field(default=3e-3, metadata={"help": "Learning rate of the small model without DP."})
    small_epochs: float = field(default=2.0, metadata={"help": "Epochs on the synthetic data (batch 32)."})
    non_private_baseline: bool = field(
        default=False, metadata={"help": "Also train the small model on the real data without DP (ε = ∞)."}
    )
    public_generator_control: bool = field(
        default=False,
        metadata={"help": "Also train the small model on synthetic text from the public-only generator (no private "
                          "data): separates what the private data adds from distillation of the larger model."},
    )


# ---------------------------------------------------------------------------------------------------- data
def _clean(text: str) -> str:
    return " ".join(text.split())


def public_tokenizer(args: SyntheticDataArguments, public_texts: list[str]) -> PreTrainedTokenizerFast:
    """Byte-level BPE fitted on the public text only; ``<|endoftext|>`` is bos = eos = pad (as GPT-2's)."""
    path = Path(args.cache_dir) / f"tokenizer-austen-{args.vocab_size}"
    if (path / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(public_texts, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=EOS, eos_token=EOS, pad_token=EOS)
    tok.save_pretrained(str(path))
    return tok


def encode(tok: PreTrainedTokenizerFast, texts: list[str], max_length: int) -> datasets.Dataset:
    """``<eos> text <eos>``, truncated and right-padded to ``max_length``; labels -100 on the padding only."""
    eos = tok.eos_token_id
    rows: dict[str, list[list[int]]] = {"input_ids": [], "attention_mask": [], "labels": []}
    for ids in tok(texts, add_special_tokens=False)["input_ids"]:
        ids = ([eos] + ids + [eos])[:max_length]
        pad = max_length - len(ids)
        rows["input_ids"].append(ids + [eos] * pad)
        rows["attention_mask"].append([1] * len(ids) + [0] * pad)
        rows["labels"].append(ids + [-100] * pad)
    return datasets.Dataset.from_dict(rows)


def public_chunks(tok: PreTrainedTokenizerFast, texts: list[str], max_length: int) -> datasets.Dataset:
    """The public text cut into windows of ``max_length`` tokens (for pre-training)."""
    stream: list[int] = []
    for ids in tok(texts, add_special_tokens=False)["input_ids"]:
        stream += ids + [tok.eos_token_id]
    n = len(stream) // max_length
    chunks = [stream[i * max_length:(i + 1) * max_length] for i in range(n)]
    return datasets.Dataset.from_dict({"input_ids": chunks, "attention_mask": [[1] * max_length] * n,
                                       "labels": chunks})


# -------------------------------------------------------------------------------------------------- models
def gpt2(tok: PreTrainedTokenizerFast, layers: int, dim: int, max_length: int) -> GPT2LMHeadModel:
    cfg = GPT2Config(vocab_size=len(tok), n_positions=max_length, n_embd=dim, n_layer=layers, n_head=max(1, dim // 32),
                     bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")  # faster on CPU
    return GPT2LMHeadModel(cfg)


def _quiet_args(cls, **kw: Any):
    base = dict(use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True, logging_strategy="no",
                dataloader_num_workers=0)
    base.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(**base)


def train_non_private(model: GPT2LMHeadModel, data: datasets.Dataset, out: Path, lr: float, *, steps: int = -1,
                      epochs: float = 1.0, seed: int = 0) -> GPT2LMHeadModel:
    """Ordinary training (AdamW, batch 32, linear decay): public pre-training, and the small model on synthetic data."""
    args = _quiet_args(TrainingArguments, output_dir=str(out), per_device_train_batch_size=32, learning_rate=lr,
                       max_steps=steps, num_train_epochs=epochs, warmup_steps=20, weight_decay=0.01, seed=seed)
    Trainer(model=model, args=args, train_dataset=data).train()
    return model


def pretrained(args: SyntheticDataArguments, tok: PreTrainedTokenizerFast, public: datasets.Dataset,
               name: str) -> GPT2LMHeadModel:
    """A GPT-2 (``name``: "generator" or "small") pre-trained on the public text; cached by its settings."""
    path = _cached_path(args, name)
    if (path / "config.json").is_file():
        return GPT2LMHeadModel.from_pretrained(str(path))
    layers, dim, steps = _model_settings(args, name)
    set_seed(args.seed)
    model = gpt2(tok, layers, dim, args.max_length)
    t0 = time.time()
    train_non_private(model, public, Path(args.output_dir) / "tmp", 3e-3, steps=steps, seed=args.seed)
    logger.info("pre-trained the %s on public text in %.0f s", name, time.time() - t0)
    model.save_pretrained(str(path))
    return model


def _model_settings(args: SyntheticDataArguments, name: str) -> tuple[int, int, int]:
    if name == "generator":
        return args.generator_layers, args.generator_dim, args.generator_pretrain_steps
    return args.small_layers, args.small_dim, args.small_pretrain_steps


def _cached_path(args: SyntheticDataArguments, name: str) -> Path:
    settings = [*_model_settings(args, name), args.vocab_size, args.max_length, args.seed]
    return Path(args.cache_dir) / f"{name}-{hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:10]}"


def _load(args: SyntheticDataArguments, name: str) -> GPT2LMHeadModel:
    return GPT2LMHeadModel.from_pretrained(str(_cached_path(args, name)))


def train_dp(args: SyntheticDataArguments, model: torch.nn.Module, data: datasets.Dataset, out: Path,
             lr: float) -> DPTrainer:
    """DP-Adam with Poisson sampling and PRV accounting to (target_epsilon, target_delta)."""
    micro = 64
    dp_args = _quiet_args(
        DPTrainingArguments, output_dir=str(out), per_device_train_batch_size=micro,
        gradient_accumulation_steps=max(1, args.dp_batch_size // micro), num_train_epochs=args.dp_epochs,
        learning_rate=lr, warmup_steps=0, target_epsilon=args.target_epsilon, target_delta=args.target_delta,
        per_sample_max_grad_norm=args.per_sample_max_grad_norm, seed=args.seed,
    )
    trainer = DPTrainer(model=model, args=dp_args, train_dataset=data)
    trainer.train()
    return trainer


@torch.no_grad()
def next_token_accuracy(model: torch.nn.Module, data: datasets.Dataset, batch_size: int = 128) -> float:
    """Fraction of real held-out tokens (after the start token, end token included) predicted by argmax."""
    model.eval()
    correct = total = 0
    for i in range(0, len(data), batch_size):
        batch = data[i:i + batch_size]
        ids = torch.tensor(batch["input_ids"])
        labels = torch.tensor(batch["labels"])[:, 1:]
        logits = model(input_ids=ids, attention_mask=torch.tensor(batch["attention_mask"])).logits[:, :-1]
        keep = labels != -100
        correct += int((logits.argmax(-1)[keep] == labels[keep]).sum())
        total += int(keep.sum())
    return correct / total


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------------- main
def main(args: SyntheticDataArguments) -> dict[str, Any]:
    t_start = time.time()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(min(2, os.cpu_count() or 1))

    # Public data: tokenizer and pre-training. Private data: fortunes, split into train (N) and a held-out test.
    public_texts = [_clean(t) for t in load_austen()["text"]]
    tok = public_tokenizer(args, public_texts)
    public = public_chunks(tok, public_texts, args.max_length)
    fortunes = load_fortunes().shuffle(seed=args.seed)
    if args.num_private + args.num_test > len(fortunes):
        raise ValueError(f"only {len(fortunes)} fortunes: lower num_private or num_test")
    private_texts = [_clean(t) for t in fortunes.select(range(args.num_private))["text"]]
    test_texts = [_clean(t) for t in fortunes.select(range(args.num_private, args.num_private + args.num_test))["text"]]
    private, test = encode(tok, private_texts, args.max_length), encode(tok, test_texts, args.max_length)

    gen_base = pretrained(args, tok, public, "generator")
    small_base = pretrained(args, tok, public, "small")
    rows: list[dict[str, Any]] = []

    def record(name: str, model: torch.nn.Module, data: str, privacy: str, seconds: float) -> None:
        acc = next_token_accuracy(model, test)
        rows.append({"model": name, "params": n_params(model), "trained on": data, "privacy": privacy,
                     "accuracy": acc, "seconds": round(seconds)})
        logger.info("%s: next-token accuracy %.4f", name, acc)

    record("generator", gen_base, "public text only", "no private data", 0)

    # 1. DP fine-tuning of the generator on the private data.
    t0 = time.time()
    generator = _load(args, "generator")
    if args.generator_lora_r > 0:
        from peft import LoraConfig, get_peft_model

        generator = get_peft_model(generator, LoraConfig(r=args.generator_lora_r, lora_alpha=2 * args.generator_lora_r,
                                                         target_modules=["c_attn", "c_proj", "c_fc"],
                                                         task_type="CAUSAL_LM"))
    gen_trainer = train_dp(args, generator, private, out / "generator", args.generator_lr)
    eps = gen_trainer.privacy_spent()["epsilon"]
    gen_trainer.save_model()
    gen_trainer.create_model_card(model_name="dp-fortunes-generator", dataset_name="fortunes (private split)")
    record("generator", gen_trainer.model, "real private data", f"DP, ε={eps:.2f}", time.time() - t0)
    record("small", small_base, "public text only", "no private data", 0)

    # 2. Synthetic data from the DP generator: post-processing. `privacy=gen_trainer` reads its accountant only.
    t0 = time.time()
    synthetic = generate_synthetic_dataset(gen_trainer.model, tok, args.num_synthetic,
                                           max_new_tokens=args.max_length - 2, top_k=args.top_k or None,
                                           batch_size=128, seed=args.seed, privacy=gen_trainer)
    t_gen = time.time() - t0
    save_synthetic_dataset(synthetic, out / "synthetic", pretty_name="DP synthetic fortunes")
    synthetic_texts = [t for t in synthetic["text"] if t]  # a public rule (drop empty texts): post-processing
    logger.info("generated %d synthetic texts in %.0f s, e.g. %r", len(synthetic), t_gen, list(synthetic["text"][:3]))

    # 3a. The small model, directly with DP on the real private data (same ε).
    t0 = time.time()
    small_dp = train_dp(args, _load(args, "small"), private, out / "small_dp_real", args.small_dp_lr)
    record("small", small_dp.model, "real private data",
           f"DP, ε={small_dp.privacy_spent()['epsilon']:.2f}", time.time() - t0)

    # 3b. The small model, without DP, on the synthetic data (the privacy is the generator's).
    t0 = time.time()
    small_syn = train_non_private(_load(args, "small"), encode(tok, synthetic_texts, args.max_length),
                                  out / "small_synthetic", args.small_lr, epochs=args.small_epochs, seed=args.seed)
    record("small", small_syn, "synthetic data (non-private training)",
           f"DP via generator, ε={eps:.2f}", time.time() - t0 + t_gen)

    if args.public_generator_control:
        t0 = time.time()
        control = generate_synthetic_dataset(gen_base, tok, args.num_synthetic, max_new_tokens=args.max_length - 2,
                                             top_k=args.top_k or None, batch_size=128, seed=args.seed)
        small_ctl = train_non_private(_load(args, "small"), encode(tok, [t for t in control["text"] if t],
                                                                   args.max_length),
                                      out / "small_control", args.small_lr, epochs=args.small_epochs, seed=args.seed)
        record("small", small_ctl, "synthetic data of the public-only generator", "no private data",
               time.time() - t0)

    if args.non_private_baseline:
        t0 = time.time()
        small_np = train_non_private(_load(args, "small"), private, out / "small_real", args.small_lr,
                                     epochs=args.small_epochs, seed=args.seed)
        record("small", small_np, "real private data", "none (ε = ∞)", time.time() - t0)

    print_table(rows, args, eps)
    results = {"args": asdict(args), "rows": rows, "epsilon": eps, "delta": args.target_delta,
               "synthetic_examples": list(synthetic["text"][:5]), "total_seconds": round(time.time() - t_start)}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    return results


def print_table(rows: list[dict[str, Any]], args: SyntheticDataArguments, eps: float) -> None:
    print(f"\nNext-token accuracy on {args.num_test} held-out real fortunes (N = {args.num_private} private "
          f"examples, δ = {args.target_delta:g}, top-k = {args.top_k or '∞'}, {args.num_synthetic} synthetic texts)")
    header = f"{'model':<10} {'params':>9}  {'trained on':<44} {'privacy':<28} {'accuracy':>8} {'time':>6}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['model']:<10} {r['params']:>9,}  {r['trained on']:<44} {r['privacy']:<28} "
              f"{100 * r['accuracy']:>7.2f}% {r['seconds']:>5}s")
    print(f"\nCards: {args.output_dir}/generator/README.md (model), {args.output_dir}/synthetic/README.md (data set)")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("transformers", "hf_dp", "datasets", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    datasets.disable_progress_bars()
    (script_args,) = HfArgumentParser(SyntheticDataArguments).parse_args_into_dataclasses()
    if not math.isfinite(script_args.target_epsilon):
        raise SystemExit("target_epsilon must be finite")
    main(script_args)
