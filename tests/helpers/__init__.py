"""Shared test fixtures: tiny random-init models, small datasets, and the per-example oracle.

The oracle is deliberately independent of hf_dp: it runs the model on ONE example at a time (so nothing can merge
examples), takes the model's own HF loss for that example, and clips by the rule written out here.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch
from datasets import Dataset
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    RobertaConfig,
    RobertaForSequenceClassification,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 61


def tiny_gpt2(tied: bool = True) -> GPT2LMHeadModel:
    cfg = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0,
                     pad_token_id=0)
    return GPT2LMHeadModel(cfg)


def tiny_bert(num_labels: int = 3) -> BertForSequenceClassification:
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=24, max_position_embeddings=32, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, num_labels=num_labels, pad_token_id=0)
    return BertForSequenceClassification(cfg)


def tiny_roberta(num_labels: int = 2) -> RobertaForSequenceClassification:
    cfg = RobertaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=24, max_position_embeddings=40, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, num_labels=num_labels, pad_token_id=1, bos_token_id=0,
                        eos_token_id=2)
    return RobertaForSequenceClassification(cfg)


def tiny_llama() -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def tiny_bert_mlm():
    from transformers import BertForMaskedLM

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=24, max_position_embeddings=32, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, pad_token_id=0)
    return BertForMaskedLM(cfg)


def tiny_bert_token_classification(num_labels: int = 4):
    from transformers import BertForTokenClassification

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=24, max_position_embeddings=32, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, pad_token_id=0, num_labels=num_labels)
    return BertForTokenClassification(cfg)


def tiny_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=24, num_layers=1, num_decoder_layers=1, num_heads=2,
                   dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return T5ForConditionalGeneration(cfg)


def token_dataset(n: int, num_labels: int, seq_len: int = 8, seed: int = 0) -> Dataset:
    """Token-level labels (-100 on padding and on a random half of tokens, like MLM masking)."""
    g = torch.Generator().manual_seed(seed)
    rows = {"input_ids": [], "attention_mask": [], "labels": []}
    for _ in range(n):
        length = int(torch.randint(3, seq_len + 1, (1,), generator=g))
        ids = torch.randint(2, VOCAB, (length,), generator=g).tolist()
        labels = [int(torch.randint(0, num_labels, (1,), generator=g)) if torch.rand(1, generator=g) < 0.5 else -100
                  for _ in ids]
        labels[0] = int(torch.randint(0, num_labels, (1,), generator=g))  # at least one labelled token
        pad = seq_len - length
        rows["input_ids"].append(ids + [0] * pad)
        rows["attention_mask"].append([1] * length + [0] * pad)
        rows["labels"].append(labels + [-100] * pad)
    return Dataset.from_dict(rows)


def seq2seq_dataset(n: int, seed: int = 0) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    rows = {"input_ids": [], "attention_mask": [], "labels": []}
    for _ in range(n):
        src = torch.randint(2, VOCAB, (6,), generator=g).tolist()
        length = int(torch.randint(2, 6, (1,), generator=g))
        tgt = torch.randint(2, VOCAB, (length,), generator=g).tolist() + [1]
        rows["input_ids"].append(src)
        rows["attention_mask"].append([1] * 6)
        rows["labels"].append(tgt + [-100] * (6 - len(tgt)))
    return Dataset.from_dict(rows)


def lm_dataset(n: int, seq_len: int = 10, seed: int = 0, pad_id: int = 0) -> Dataset:
    """Causal-LM examples of varying length, right-padded, labels -100 on padding."""
    g = torch.Generator().manual_seed(seed)
    rows = {"input_ids": [], "attention_mask": [], "labels": []}
    for _ in range(n):
        length = int(torch.randint(3, seq_len + 1, (1,), generator=g))
        ids = torch.randint(2, VOCAB, (length,), generator=g).tolist()
        pad = seq_len - length
        rows["input_ids"].append(ids + [pad_id] * pad)
        rows["attention_mask"].append([1] * length + [0] * pad)
        rows["labels"].append(ids + [-100] * pad)
    return Dataset.from_dict(rows)


def cls_dataset(n: int, num_labels: int, seq_len: int = 8, seed: int = 0, pad_id: int = 0) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    rows = {"input_ids": [], "attention_mask": [], "labels": []}
    for _ in range(n):
        length = int(torch.randint(3, seq_len + 1, (1,), generator=g))
        ids = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        pad = seq_len - length
        rows["input_ids"].append(ids + [pad_id] * pad)
        rows["attention_mask"].append([1] * length + [0] * pad)
        rows["labels"].append(int(torch.randint(0, num_labels, (1,), generator=g)))
    return Dataset.from_dict(rows)


@contextlib.contextmanager
def _loss_keeps_float64():
    """While a model's own HF loss function runs, ``logits.float()`` leaves float64 tensors in float64.

    transformers' loss functions (``loss_utils.ForCausalLMLoss`` ...) upcast logits with ``.float()``, which would
    *downcast* a float64 oracle to float32. Only the loss function's call is affected (``loss_function`` of every
    ``PreTrainedModel``), not the model's forward: the loss is still the model's own code, just not rounded.
    """
    from transformers import PreTrainedModel

    prop = PreTrainedModel.__dict__["loss_function"]
    plain_float = torch.Tensor.float

    def keep64(self, *args, **kwargs):
        return self if self.dtype == torch.float64 and not args and not kwargs else plain_float(self, *args, **kwargs)

    def wrapped_getter(model):
        fn = prop.fget(model)

        def loss_fn(*args, **kwargs):
            torch.Tensor.float = keep64
            try:
                return fn(*args, **kwargs)
            finally:
                torch.Tensor.float = plain_float

        return loss_fn

    PreTrainedModel.loss_function = property(wrapped_getter, prop.fset)
    try:
        yield
    finally:
        PreTrainedModel.loss_function = prop
        torch.Tensor.float = plain_float


def single_example_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The model's own loss on a batch of ONE example: ``model(**batch).loss`` with ``labels`` in ``batch``.

    This is what the plain ``Trainer`` (or PEFT, for a ``PeftModel``) optimises for that example: the model builds
    its decoder inputs from ``labels`` (seq2seq), pads the labels of virtual tokens (prompt learning), shifts
    (causal LM) and picks its loss by ``config.problem_type`` (classification). Nothing here re-implements hf_dp's
    losses. In float64, HF's ``.float()`` upcast inside the loss is kept from rounding to float32.
    """
    assert next(iter(batch.values())).shape[0] == 1, "a batch of one"
    with _loss_keeps_float64():
        out = model(**batch)
    assert out.loss is not None, f"{type(model).__name__} returned no loss for {sorted(batch)}"
    return out.loss


def per_example_grads(model: torch.nn.Module, dataset: Dataset, indices: list[int]) -> list[dict[str, torch.Tensor]]:
    """Gradients of each example's own loss, one example per forward (batch of 1)."""
    model.train()
    out = []
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    for i in indices:
        row = dataset[i]
        batch = {k: torch.tensor([v]) for k, v in row.items() if not isinstance(v, str)}
        model.zero_grad(set_to_none=True)
        single_example_loss(model, batch).backward()
        out.append({n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in params.items()})
    model.zero_grad(set_to_none=True)
    return out


def flat_clipped_sum(grads: list[dict[str, torch.Tensor]], max_norm: float) -> dict[str, torch.Tensor]:
    """Σ_i min(1, C / (‖g_i‖ + 1e-6)) g_i with one norm over all parameters."""
    total = {n: torch.zeros_like(t) for n, t in grads[0].items()}
    for g in grads:
        norm = torch.sqrt(sum(t.pow(2).sum() for t in g.values()))
        c = min(1.0, max_norm / (float(norm) + 1e-6))
        for n in total:
            total[n] += c * g[n]
    return total


def example_norms(grads: list[dict[str, torch.Tensor]]) -> list[float]:
    return [float(torch.sqrt(sum(t.pow(2).sum() for t in g.values()))) for g in grads]


def quick_dp_args(out, **overrides):
    """``DPTrainingArguments`` for a short CPU run with σ = 1 and C = 1, logging every step, saving nothing unless
    asked (``dp_self_check`` off: the run is about what the trainer reports, not coverage); the warning that a
    fixed or missing setting is not private is silenced. ``overrides`` replace any of these."""
    from hf_dp import DPTrainingArguments, NotPrivateWarning

    base = dict(output_dir=str(out), per_device_train_batch_size=4, noise_multiplier=1.0, max_steps=3, use_cpu=True,
                report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1, learning_rate=1e-3,
                per_sample_max_grad_norm=1.0, dp_self_check=False)
    base.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        return DPTrainingArguments(**base)


def load_example(filename: str, name: str | None = None):
    """``examples/<filename>`` imported as a module (registered in ``sys.modules`` first: dataclasses resolve the
    module's annotations through it). The same module object on later calls."""
    import importlib.util
    import sys
    from pathlib import Path

    name = name or "hf_dp_example_" + filename.removesuffix(".py")
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parent.parent / "examples" / filename
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def close_distributed() -> None:
    """End a launched worker cleanly: every rank waits for the others, then the process group is destroyed.

    A gloo process group left alive at interpreter exit can abort one rank ("terminate called without an active
    exception", SIGABRT) after all the work is done; CI saw this once in the two-process SFT test.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
