"""A behaviour snapshot of short fixed-seed runs: model cards, ``dp_state.json``, logged metrics, plans, parameters.

Written to check that a refactoring changes no behaviour: run it on the commit before and after, then ``diff -r``::

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/behaviour_snapshot.py /tmp/snap_before
    ... change the code ...
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/behaviour_snapshot.py /tmp/snap_after
    diff -r /tmp/snap_before /tmp/snap_after

Runs (tiny random-init models, CPU, ``dp_seed`` fixed, ``report_to=[]``):

* ``flat_eps``: DPTrainer, GPT-2, flat clipping, σ calibrated to ``target_epsilon`` (DP-Adam), checkpoints; then a
  second DPTrainer on the trained model with ``noise_multiplier`` (its privacy history composes);
* ``adaptive``: DPTrainer, BERT classifier, ``adaptive_per_layer`` clipping with DP-AdamBC (group noise, quantile
  noise, the released noise std);
* ``per_layer_user``: DPTrainer, GPT-2, ``per_layer`` clipping at the user level;
* ``sft``: DPSFTTrainer (trl) with packing, σ > 0.

Masked (genuinely time-dependent): the run ids (``uuid4``, made deterministic here), and in the logs the runtimes
and throughputs (``*_runtime``, ``*_per_second``) and ``total_flos`` (absent on CPU-only runs anyway).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys
import uuid
import warnings

import torch
from datasets import Dataset
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

os.environ.setdefault("HF_HUB_OFFLINE", "1")
_ids = itertools.count()
uuid.uuid4 = lambda: uuid.UUID(int=next(_ids))  # deterministic run ids (hf_dp/history.py)

from hf_dp import DPTrainer, DPTrainingArguments  # noqa: E402

VOCAB = 61
TIME_KEYS = ("_runtime", "_per_second", "total_flos")


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0, pad_token_id=0))


def bert() -> BertForSequenceClassification:
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
        pad_token_id=0))


def lm_data(n: int, users: bool = False) -> Dataset:
    g = torch.Generator().manual_seed(0)
    rows = {"input_ids": [], "attention_mask": [], "labels": []}
    for _ in range(n):
        length = int(torch.randint(3, 11, (1,), generator=g))
        ids = torch.randint(2, VOCAB, (length,), generator=g).tolist()
        rows["input_ids"].append(ids + [0] * (10 - length))
        rows["attention_mask"].append([1] * length + [0] * (10 - length))
        rows["labels"].append(ids + [-100] * (10 - length))
    if users:
        rows["user"] = [i % 7 for i in range(n)]
    return Dataset.from_dict(rows)


def cls_data(n: int) -> Dataset:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (n, 8), generator=g)
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * 8] * n,
                              "labels": torch.randint(0, 3, (n,), generator=g).tolist()})


def args(out: str, **kw) -> DPTrainingArguments:
    base = dict(output_dir=out, per_sample_max_grad_norm=1.0, per_device_train_batch_size=4,
                gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-2, use_cpu=True, report_to=[],
                dp_seed=3, disable_tqdm=True, logging_steps=1, save_strategy="steps", save_steps=2, seed=1)
    base.update(kw)
    return DPTrainingArguments(**base)


def params_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().double().cpu().numpy().tobytes())
    return h.hexdigest()


def masked_logs(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not any(t in k for t in TIME_KEYS)} for row in history]


def dump(trainer: DPTrainer, out: str, name: str, plan: dict | None) -> None:
    dest = os.path.join(SNAP, name)
    os.makedirs(dest, exist_ok=True)
    trainer.save_model(out)
    for root, _, files in os.walk(out):
        for f in sorted(files):
            if f in ("README.md", "dp_state.json"):
                rel = os.path.relpath(os.path.join(root, f), out).replace(os.sep, "__")
                with open(os.path.join(root, f)) as src, open(os.path.join(dest, rel), "w") as dst:
                    dst.write(src.read())
    extra = {"logs": masked_logs(trainer.state.log_history), "plan_before_train": plan,
             "privacy_spent": trainer.privacy_spent(), "params": params_digest(trainer.model),
             "dp_guarantee": trainer.dp_guarantee, "budget_exhausted": trainer.budget_exhausted}
    with open(os.path.join(dest, "run.json"), "w") as f:
        json.dump(extra, f, indent=1, sort_keys=True, default=str)


def run_flat_eps(tmp: str) -> None:
    out = os.path.join(tmp, "flat_eps")
    trainer = DPTrainer(model=gpt2(), args=args(out, target_epsilon=3.0, optim="adamw_torch"),
                        train_dataset=lm_data(40))
    plan = trainer.privacy_plan()
    trainer.train()
    dump(trainer, out, "flat_eps", plan)
    out2 = os.path.join(tmp, "flat_eps_again")
    again = DPTrainer(model=trainer.model, args=args(out2, noise_multiplier=1.3, max_steps=2, save_strategy="no"),
                      train_dataset=lm_data(40))
    plan = again.privacy_plan()
    again.train()
    dump(again, out2, "flat_eps_again", plan)


def run_adaptive(tmp: str) -> None:
    out = os.path.join(tmp, "adaptive")
    trainer = DPTrainer(model=bert(), args=args(out, noise_multiplier=1.1, clipping="adaptive_per_layer",
                                                optim="adamw_torch", dp_adam_bias_correction=True,
                                                noise_allocation="equal_budget"),
                        train_dataset=cls_data(40))
    plan = trainer.privacy_plan()
    trainer.train()
    dump(trainer, out, "adaptive", plan)


def run_per_layer_user(tmp: str) -> None:
    out = os.path.join(tmp, "per_layer_user")
    trainer = DPTrainer(model=gpt2(), args=args(out, target_epsilon=5.0, clipping="per_layer", privacy_unit="user",
                                                user_id_column="user", per_device_train_batch_size=2,
                                                optim="sgd"),
                        train_dataset=lm_data(42, users=True))
    plan = trainer.privacy_plan()
    trainer.train()
    dump(trainer, out, "per_layer_user", plan)


def run_sft(tmp: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_dp import DPSFTConfig, DPSFTTrainer

    words = ["<pad>", "<eos>", "<unk>"] + "hello hi how are you fine thanks what is your name my bot good day".split()
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    texts = ["hello how are you fine thanks", "what is your name my name is bot", "hi good day", "hello bot",
             "how are you", "fine thanks good day hello", "my name is hi", "what day is good"] * 3
    out = os.path.join(tmp, "sft")
    config = DPSFTConfig(output_dir=out, noise_multiplier=0.9, per_sample_max_grad_norm=1.0,
                         per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
                         learning_rate=1e-2, use_cpu=True, report_to=[], dp_seed=5, disable_tqdm=True,
                         logging_steps=1, save_strategy="no", max_length=32, packing=True, seed=1)
    trainer = DPSFTTrainer(model=gpt2(), args=config, train_dataset=Dataset.from_list([{"text": t} for t in texts]),
                           processing_class=tok)
    plan = trainer.privacy_plan()
    trainer.train()
    dump(trainer, out, "sft", plan)


if __name__ == "__main__":
    import tempfile

    SNAP = sys.argv[1]
    os.makedirs(SNAP, exist_ok=True)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for run in (run_flat_eps, run_adaptive, run_per_layer_user, run_sft):
            run(tmp)
    print("snapshot written to", SNAP)
