#!/usr/bin/env python
# /// script
# requires-python = ">=3.10"
# dependencies = ["hf_dp"]
# ///
"""Empirical privacy audit: canary exposure and membership inference, with and without DP (Li et al. 2022, Table 9).

The same small causal LM is fine-tuned twice on the same real text with the same inserted canaries:

* **non-private**: plain ``transformers.Trainer`` (AdamW), i.e. ordinary fine-tuning;
* **DP**: ``hf_dp.DPTrainer`` with ``target_epsilon`` (DP-Adam, per-example clipping, Poisson sampling, PRV ε).

Then it prints the secret-sharer exposure of the canaries per repetition count ``r`` (Carlini et al. 2019; the protocol
of Li et al. 2022, App. M: a sub-vocabulary of ``V = 10`` random words, secrets of ``l = 5`` of them, so
``|R| = 10^5`` and the largest exposure is ``log2 |R| = 16.6`` bits; prefixes whose ``<word>`` slots are drawn from
the sub-vocabulary), estimated by the distribution model (skew-normal fit to the non-inserted candidates) and by the
exact rank over all ``10^5`` candidates, and a membership-inference table (loss-threshold, initial-model-calibrated and
zlib-calibrated attacks on held-in training examples vs a real held-out split: AUC, TPR at 1% / 0.1% FPR, and the
empirical ε lower bound with 95% Clopper–Pearson confidence). Both audits run as ``TrainerCallback``s at the end of
training (their results are logged next to ε) and are also written to ``<output_dir>/audit_results.json``
(``hf_dp.audit.audit_report``: the dict the model card embeds).

Setup, all offline:

* text: the Debian ``fortunes`` epigrams (``examples/data.py``, ``load_fortunes``; fetched once into the cache, or run
  ``bash examples/setup_data.sh``), entries of 8–47 tokens; 2,000 train / 1,000 held out (a random split);
* tokenizer: a byte-level BPE with 1,024 tokens trained here on Jane Austen's novels (public domain, ``load_austen``),
  so that no private text shapes the vocabulary;
* model: a random-init GPT-2 (2 layers, width 64), first pre-trained briefly on Austen (public data; non-private),
  so that fine-tuning starts from a language model as in Li et al. and the calibrated attack has a reference.

Run::

    python examples/dp_audit.py                         # ≈ 4–6 minutes on 2 CPU cores
    python examples/dp_audit.py --quick                 # ≈ 1 minute: fewer examples and steps, a smoke test
    python examples/dp_audit.py --target_epsilon 8 --epochs 4 --output_dir /tmp/audit

Under DP every copy of a canary is one privacy unit: a canary repeated ``r`` times is protected only at the
group-privacy level ``r`` (ε grows roughly like ``r·ε`` for small ``ε``), so exposure at ``r = 100`` measures how much
the noise hides a heavily repeated secret in practice, not what the guarantee promises. The audit numbers are computed
on private training data: they are not covered by the DP guarantee.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)
from transformers.utils import logging as hf_logging

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data import load_austen, load_fortunes  # noqa: E402

from hf_dp import DPTrainer, DPTrainingArguments  # noqa: E402
from hf_dp.audit import CanaryExposureCallback, MembershipInferenceCallback, audit_report, make_canaries  # noqa: E402

EOS = "<|endoftext|>"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--output_dir", default="dp_audit_output")
    p.add_argument("--target_epsilon", type=float, default=3.0, help="ε of the DP run (Li et al. Table 9: 3)")
    p.add_argument("--noise_multiplier", type=float, default=None, help="σ of the DP run instead of target_epsilon")
    p.add_argument("--target_delta", type=float, default=None, help="δ (default 1/N^1.1)")
    p.add_argument("--per_sample_max_grad_norm", type=float, default=0.1, help="C of the DP run")
    p.add_argument("--batch_size", type=int, default=64, help="(expected) batch size of both runs")
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--lr", type=float, default=5e-3, help="non-private learning rate (AdamW)")
    p.add_argument("--dp_lr", type=float, default=3e-3, help="DP learning rate (DP-Adam)")
    p.add_argument("--num_train", type=int, default=2000, help="fortunes in the training set (before canaries)")
    p.add_argument("--num_heldout", type=int, default=1000, help="held-out fortunes (MIA non-members)")
    p.add_argument("--num_members", type=int, default=1000, help="training fortunes scored as MIA members")
    p.add_argument("--repetitions", type=int, nargs="+", default=[0, 1, 10, 100])
    p.add_argument("--canaries_per_repetition", type=int, default=3)
    p.add_argument("--subvocab", type=int, default=10, help="V")
    p.add_argument("--secret_length", type=int, default=5, help="l; |R| = V^l")
    p.add_argument("--prefix", default="my secret {} {} is", help="canary format; {} = a sub-vocabulary word")
    p.add_argument("--max_len", type=int, default=48)
    p.add_argument("--width", type=int, default=64, help="GPT-2 n_embd (2 layers, 4 heads)")
    p.add_argument("--pretrain_steps", type=int, default=200, help="public pre-training steps on Austen (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (1 is fastest for this tiny model on a shared 2-core machine)")
    p.add_argument("--quick", action="store_true", help="a fast smoke test: fewer examples, steps and candidates")
    args = p.parse_args(argv)
    if args.quick:
        args.num_train, args.num_heldout, args.num_members = 600, 300, 300
        args.repetitions, args.canaries_per_repetition = [0, 1, 10, 50], 2
        args.secret_length, args.pretrain_steps, args.epochs = 4, 100, 2.0
    return args


# ----------------------------------------------------------------------------------------------------------------------
# Data, tokenizer, model
# ----------------------------------------------------------------------------------------------------------------------
def build_tokenizer(vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on Jane Austen's novels (public data)."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(load_austen(chunk_chars=None)["text"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=EOS, bos_token=EOS, pad_token=EOS)


def encode(tok: PreTrainedTokenizerFast, texts: list[str], max_len: int) -> Dataset:
    """Rows of ``text + EOS`` (at most ``max_len`` tokens, unpadded: :class:`PadCollator` pads each batch)."""
    rows: dict[str, list[Any]] = {"input_ids": [], "attention_mask": [], "labels": [], "text": []}
    for text, ids in zip(texts, tok(texts, add_special_tokens=False)["input_ids"]):
        ids = ids[: max_len - 1] + [tok.eos_token_id]
        rows["input_ids"].append(ids)
        rows["attention_mask"].append([1] * len(ids))
        rows["labels"].append(ids)
        rows["text"].append(text)
    return Dataset.from_dict(rows)


class PadCollator:
    """Right-pads a batch to its longest row: ``pad_id`` in ``input_ids``, 0 in the mask, -100 in ``labels``."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        length = max(len(r["input_ids"]) for r in rows)
        fill = {"input_ids": self.pad_id, "attention_mask": 0, "labels": -100}
        return {k: torch.tensor([list(r[k]) + [v] * (length - len(r[k])) for r in rows]) for k, v in fill.items()}


def fortune_splits(tok: PreTrainedTokenizerFast, args: argparse.Namespace) -> tuple[Dataset, Dataset]:
    """A random train / held-out split of the fortunes that fit in ``max_len`` tokens (with EOS), at least 8 tokens."""
    texts = list(load_fortunes()["text"])
    lengths = [len(x) for x in tok(texts, add_special_tokens=False)["input_ids"]]
    pool = sorted({t for t, n in zip(texts, lengths) if 8 <= n <= args.max_len - 1})  # dedup: a real held-out split
    order = np.random.default_rng(args.seed).permutation(len(pool))
    need = args.num_train + args.num_heldout
    if need > len(pool):
        raise ValueError(f"only {len(pool)} fortunes fit; asked for {need}")
    train = [pool[i] for i in order[: args.num_train]]
    heldout = [pool[i] for i in order[args.num_train: need]]
    return encode(tok, train, args.max_len), encode(tok, heldout, args.max_len)


def new_model(tok: PreTrainedTokenizerFast, args: argparse.Namespace) -> GPT2LMHeadModel:
    torch.manual_seed(args.seed)
    cfg = GPT2Config(n_layer=2, n_embd=args.width, n_head=4, n_positions=args.max_len, vocab_size=len(tok),
                     bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return GPT2LMHeadModel(cfg)


def pretrain(model: GPT2LMHeadModel, tok: PreTrainedTokenizerFast, args: argparse.Namespace) -> None:
    """Non-private pre-training on Austen (public): a stand-in for starting from a pre-trained LM."""
    if args.pretrain_steps <= 0:
        return
    paras = [p for p in list(load_austen(chunk_chars=None)["text"]) if len(p) > 40]
    paras = paras[: args.pretrain_steps * args.batch_size]  # at most one pass
    data = encode(tok, paras, args.max_len).remove_columns("text")
    targs = TrainingArguments(output_dir=os.path.join(args.output_dir, "pretrain"), max_steps=args.pretrain_steps,
                              per_device_train_batch_size=args.batch_size, learning_rate=3e-3, warmup_steps=20,
                              use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
                              logging_steps=max(1, args.pretrain_steps // 3), seed=args.seed)
    Trainer(model=model, args=targs, train_dataset=data, data_collator=PadCollator(tok.pad_token_id)).train()


# ----------------------------------------------------------------------------------------------------------------------
# One audited fine-tuning run
# ----------------------------------------------------------------------------------------------------------------------
def run(private: bool, init_state: dict[str, torch.Tensor], tok: PreTrainedTokenizerFast, train: Dataset,
        members: Dataset, heldout: Dataset, canaries: Any, args: argparse.Namespace) -> dict[str, Any]:
    model = new_model(tok, args)
    model.load_state_dict(init_state)
    out_dir = os.path.join(args.output_dir, "dp" if private else "non_private")
    common = dict(output_dir=out_dir, per_device_train_batch_size=args.batch_size, num_train_epochs=args.epochs,
                  use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=25,
                  seed=args.seed, remove_unused_columns=True)
    train = train.remove_columns("text")
    collator = PadCollator(tok.pad_token_id)
    if private:
        budget = ({"noise_multiplier": args.noise_multiplier} if args.noise_multiplier is not None
                  else {"target_epsilon": args.target_epsilon})
        targs = DPTrainingArguments(**budget, target_delta=args.target_delta,
                                    per_sample_max_grad_norm=args.per_sample_max_grad_norm, learning_rate=args.dp_lr,
                                    **common)
        trainer: Trainer = DPTrainer(model=model, args=targs, train_dataset=train, data_collator=collator)
        delta = trainer.target_delta
    else:
        targs = TrainingArguments(learning_rate=args.lr, **common)
        trainer = Trainer(model=model, args=targs, train_dataset=train, data_collator=collator)
        delta = args.target_delta if args.target_delta is not None else 1.0 / len(train) ** 1.1  # the DP run's δ
    exposure = CanaryExposureCallback(canaries, exact=True, num_reference=5000).attach(trainer)
    mia = MembershipInferenceCallback(members, heldout, text_column="text", delta=delta,
                                      run_on_evaluate=False).attach(trainer)
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    eval_loss = trainer.evaluate(eval_dataset=heldout.remove_columns("text"))["eval_loss"]
    privacy = trainer.privacy_spent() if private else {"epsilon": math.inf, "delta": delta}
    return {"private": private, "epsilon": privacy["epsilon"], "delta": privacy["delta"],
            "noise_multiplier": privacy.get("noise_multiplier"), "steps": trainer.state.global_step,
            "train_seconds": seconds, "heldout_loss": eval_loss, "exposure": exposure.latest, "mia": mia.latest,
            "audit_report": audit_report(trainer)}


# ----------------------------------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------------------------------
def _label(res: dict[str, Any]) -> str:
    return f"ε = {res['epsilon']:.2f} (DP)" if res["private"] else "non-private"


def exposure_table(results: list[dict[str, Any]], key: str) -> str:
    reps = sorted(results[0]["exposure"]["by_repetitions"], key=int)
    head = "| Guarantee | " + " | ".join(f"r = {r}" + (" (not inserted)" if r == "0" else "") for r in reps) + " |"
    lines = [head, "|" + "---|" * (len(reps) + 1)]
    for res in results:
        cells = []
        for r in reps:
            e = res["exposure"]["by_repetitions"][r]
            mean, std = (e["mean"], e["std"]) if key == "fit" else (e["mean_exact"], e["std_exact"])
            cells.append(f"{mean:.2f} ± {std:.2f}")
        lines.append(f"| {_label(res)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mia_table(results: list[dict[str, Any]]) -> str:
    lines = ["| Guarantee | attack | AUC | TPR @ 1% FPR | TPR @ 0.1% FPR | ε lower bound (95%) |",
             "|---|---|---|---|---|---|"]

    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    for res in results:
        for name, m in res["mia"]["attacks"].items():
            lb = (m.get("epsilon_lower_bound") or {}).get("epsilon_lower_bound")
            lines.append(f"| {_label(res)} | {name} | {m['auc']:.3f} | {fmt(m['tpr_at_fpr'].get('0.01'))} | "
                         f"{fmt(m['tpr_at_fpr'].get('0.001'))} | {fmt(lb)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*loss_type=None.*")
    t_start = time.perf_counter()
    os.makedirs(args.output_dir, exist_ok=True)

    tok = build_tokenizer()
    train, heldout = fortune_splits(tok, args)
    members = train.select(range(min(args.num_members, len(train))))  # the split is random: any subset is fair
    canaries = make_canaries(tok, repetitions=args.repetitions, canaries_per_repetition=args.canaries_per_repetition,
                             subvocab=args.subvocab, secret_length=args.secret_length, prefix=args.prefix,
                             eos_ids=[tok.eos_token_id], seed=args.seed)
    train_c = canaries.insert_into(train)
    print(f"data: {len(train)} training fortunes + {canaries.num_inserted_rows} canary rows = {len(train_c)}; "
          f"{len(heldout)} held out; {len(members)} scored as members")
    print(f"canaries: V = {len(canaries.subvocab_ids)} words {list(canaries.subvocab_words or [])}, l = "
          f"{canaries.secret_length}, |R| = {canaries.space_size:,}; e.g. {canaries.canaries[-1].text!r}")

    model = new_model(tok, args)
    t0 = time.perf_counter()
    pretrain(model, tok, args)
    print(f"public pre-training on Austen: {args.pretrain_steps} steps, {time.perf_counter() - t0:.0f} s")
    init_state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    results = []
    for private in (True, False):
        res = run(private, init_state, tok, train_c, members, heldout, canaries, args)
        print(f"{_label(res)}: {res['steps']} steps in {res['train_seconds']:.0f} s, held-out loss "
              f"{res['heldout_loss']:.3f}" + (f", σ = {res['noise_multiplier']:.3f}, δ = {res['delta']:.2e}"
                                               if private else ""))
        results.append(res)

    max_e = math.log2(canaries.space_size)
    print(f"\nCanary exposure in bits, mean ± std over {args.canaries_per_repetition} canaries per r "
          f"(max log2|R| = {max_e:.2f}); distribution model (skew-normal fit to non-inserted candidates):")
    print(exposure_table(results, "fit"))
    print(f"\nExact rank over all |R| = {canaries.space_size:,} candidates (exposure = log2|R| − log2 rank):")
    print(exposure_table(results, "exact"))
    n_in, n_out = results[0]["mia"]["num_members"], results[0]["mia"]["num_nonmembers"]
    print(f"\nMembership inference: {n_in} training fortunes vs {n_out} held-out fortunes. ε lower bound: "
          "Clopper–Pearson, 95% joint confidence, threshold chosen on a disjoint half, δ of the DP run:")
    print(mia_table(results))
    notes = sorted({n for res in results for m in res["mia"]["attacks"].values() for n in m["notes"]})
    for note in notes:
        print(f"  note: {note}")

    path = Path(args.output_dir) / "audit_results.json"
    path.write_text(json.dumps({"args": vars(args), "results": results}, indent=2, default=str))
    print(f"\nresults: {path}  (total {time.perf_counter() - t_start:.0f} s)")
    return {"args": vars(args), "results": results}


if __name__ == "__main__":
    main()
