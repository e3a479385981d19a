"""Chat data for the trl trainers (SFT, DPO, reward): a tiny word-level tokenizer with a chat template, the SFT
datasets in each of trl's formats, and the DP-SFT run against its oracle (each row's own loss with trl's labels).

trl and hf_dp's trl trainers are imported inside the functions: importing ``helpers`` never needs trl.
"""

from __future__ import annotations

import warnings

import torch
from datasets import Dataset

from .runs import one_step_against_oracle

WORDS = ["<pad>", "<eos>", "<|user|>", "<|assistant|>", "<|end|>", "<unk>"] + (
    "hello hi how are you fine thanks what is your name my bot good day the cat sat on mat a dog ran").split()
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|> {% generation %}{{ m['content'] }} "
    "<|end|>{% endgeneration %} {% else %}<|user|> {{ m['content'] }} <|end|> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def chat_tokenizer():
    """A tiny word-level tokenizer with a chat template that marks assistant turns ({% generation %})."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                  additional_special_tokens=["<|user|>", "<|assistant|>", "<|end|>"])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def turns(*texts: str) -> list[dict]:
    """Alternating user / assistant messages."""
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]


PAIRS = [("hello how are you", "fine thanks"), ("what is your name", "my name is bot"),
         ("hi", "good day the cat sat on a mat"), ("a dog ran", "the dog ran on the mat")]


def sft_dataset(kind: str) -> Dataset:
    """``PAIRS`` in one of trl's dataset formats (``messages``: one row with two assistant turns)."""
    if kind == "text":
        return Dataset.from_list([{"text": f"{p} {c}"} for p, c in PAIRS])
    if kind == "messages":
        rows = [{"messages": turns(p, c)} for p, c in PAIRS]
        rows[2] = {"messages": turns("hi", "good day", "the cat", "sat on a mat")}  # two assistant turns
        return Dataset.from_list(rows)
    if kind == "prompt_completion":
        return Dataset.from_list([{"prompt": p, "completion": " " + c} for p, c in PAIRS])
    if kind == "conversational_prompt_completion":
        return Dataset.from_list([{"prompt": turns(p), "completion": [{"role": "assistant", "content": c}]}
                                  for p, c in PAIRS])
    raise ValueError(kind)


def sft_distributed_dataset() -> Dataset:
    """8 conversations (one with two assistant turns): per_device 2 × GA 2 × 2 processes = N, so q = 1."""
    pairs = PAIRS + [("how is the cat", "the cat is fine"), ("good day", "hi how are you"),
                     ("is the dog on the mat", "the dog sat on a mat"), ("what ran", "a cat ran on the mat thanks")]
    rows = [{"messages": turns(p, c)} for p, c in pairs]
    rows[2] = {"messages": turns("hi", "good day", "the cat", "sat on a mat")}
    return Dataset.from_list(rows)


def sft_args(tmp_path, per_device: int = 2, ga: int = 2, seed: int = 0, **kw):
    """``DPSFTConfig`` for one exact step: σ = 0, SGD lr 1, constant schedule, C = 1, ``max_length`` 64.

    trl's default checkpointing stays on; flat clipping is book-keeping (``flat_clipping_passes="one"``; "auto" would
    take two passes under checkpointing) unless a test asks otherwise: the two-pass DP-SFT cases pass "auto" (one
    process: tests/clipping/test_two_pass.py; two processes: tests/scripts/sft_worker.py)."""
    from hf_dp import DPSFTConfig

    if kw.get("clipping", "flat") == "flat":
        kw.setdefault("flat_clipping_passes", "one")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DPSFTConfig(**{
            "output_dir": str(tmp_path), "noise_multiplier": 0.0, "per_sample_max_grad_norm": 1.0,
            "per_device_train_batch_size": per_device, "gradient_accumulation_steps": ga, "max_steps": 1,
            "learning_rate": 1.0, "optim": "sgd", "lr_scheduler_type": "constant", "weight_decay": 0.0,
            "use_cpu": True, "report_to": "none", "save_strategy": "no", "dp_seed": seed, "disable_tqdm": True,
            "max_length": 64, **kw,
        })


def make_sft_trainer(model, data, args, **kw):
    """A ``DPSFTTrainer`` with ``chat_tokenizer`` (trl's warnings about the tiny setup silenced)."""
    from hf_dp import DPSFTTrainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DPSFTTrainer(model=model, args=args, train_dataset=data, processing_class=chat_tokenizer(), **kw)


def sft_row_grads(trainer, indices: list[int]) -> list[dict[str, torch.Tensor]]:
    """Each row's gradient from the model's own loss on a batch of one, with trl's labels for that row."""
    model = trainer.model
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out = []
    for i in indices:
        row = trainer.train_dataset[i]
        model.zero_grad(set_to_none=True)
        model(input_ids=torch.tensor([row["input_ids"]]), labels=torch.tensor([row["labels"]]),
              use_cache=False).loss.backward()
        out.append({n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in params.items()})
    model.zero_grad(set_to_none=True)
    return out


def sft_dp_update(trainer, indices: list[int], expected_batch: int, quantile: float = 0.5):
    """Train one step with C at a quantile of the oracle's norms; return (update, oracle update)."""
    return one_step_against_oracle(trainer, sft_row_grads(trainer, indices), expected_batch, quantile)
