"""Tiny random-init transformers models (a few thousand parameters, dropout off): no Hub download."""

from __future__ import annotations

import torch
from torch import nn
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


def lora_llama(model: nn.Module, targets: tuple[str, ...] = ("q_proj", "v_proj", "up_proj", "down_proj")):
    """``model`` (a tiny Llama) with LoRA r = 4, α = 8, no dropout, on ``targets``; LoRA's B drawn from N(0, 0.5²)
    (it starts at 0, so A would get no gradient). Seed before calling."""
    from peft import LoraConfig, TaskType, get_peft_model

    model = get_peft_model(model, LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, lora_alpha=8, lora_dropout=0.0,
                                             target_modules=list(targets)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    return model


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


class Seq(nn.Module):
    """``nn.Sequential`` that hands each module's output to the next (a plain stack for ``check_engine``)."""

    def __init__(self, *mods):
        super().__init__()
        self.mods = nn.ModuleList(mods)

    def forward(self, x):
        for m in self.mods:
            x = m(x)
        return x


class Out:
    """A model output with ``logits`` only (a plain module's ``ModelOutput``)."""

    def __init__(self, logits):
        self.logits = logits


class LossOut(Out):
    """A model output with ``logits`` and the model's own ``loss``."""

    def __init__(self, logits, loss):
        super().__init__(logits)
        self.loss = loss


class CheckpointedBlocks(nn.Module):
    """A model of the user's own, ``(B, T, 3)`` → per-example losses ``(B,)``: a linear embedding to width 8, the
    ``blocks`` (a subclass's ``block(k, h)`` runs block ``k``), each under ``torch.utils.checkpoint`` with
    ``use_reentrant=reentrant`` (``None``: no checkpointing), and a linear head; loss ``mean(head(h)²)``."""

    def __init__(self, blocks: nn.ModuleList, reentrant: bool | None):
        super().__init__()
        self.reentrant = reentrant
        self.embed = nn.Linear(3, 8)
        self.blocks = blocks
        self.head = nn.Linear(8, 1)

    def block(self, k: int, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for k in range(len(self.blocks)):
            h = self.block(k, h) if self.reentrant is None else torch.utils.checkpoint.checkpoint(
                self.block, k, h, use_reentrant=self.reentrant)
        return self.head(h).pow(2).mean((1, 2))


class FallbackGate(nn.Module):
    """``h ⊙ tanh(s) + sin(h ⊙ s)`` with ``s`` of size 8: no rule covers ``s`` (not a weight/bias pair), so the
    generic fallback re-runs it per example."""

    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.randn(8))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * torch.tanh(self.s) + torch.sin(h * self.s)


class Toy(nn.Module):
    """x (B, T, 3) -> logits (B, 2) through ``body``; loss: cross-entropy per example (``toy_loss``)."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body
        self.head = nn.Linear(3, 2)

    def forward(self, x, labels=None):
        return Out(self.head(self.body(x)).mean(1))


class ReadsChildWeight(nn.Module):
    """A ``Toy`` body that uses ``lin.weight`` a second time outside ``lin``'s forward (a use the per-layer hooks do
    not see); with ``mixes``, also a batch mean (examples mixed)."""

    def __init__(self, mixes: bool = False):
        super().__init__()
        self.lin, self.mixes = nn.Linear(3, 3), mixes

    def forward(self, x):
        out = self.lin(x) + nn.functional.linear(x.tanh(), self.lin.weight)
        return out + self.lin.weight.sum() * x.mean(0, keepdim=True) if self.mixes else out


def toy_loss(outputs, labels):
    """The per-example loss of ``Toy``: cross-entropy, one value per example."""
    return nn.functional.cross_entropy(outputs.logits, labels, reduction="none")


def t5_frozen_bias():
    """``tiny_t5`` whose relative attention bias is frozen."""
    model = tiny_t5()
    for name, p in model.named_parameters():
        if "relative_attention_bias" in name:
            p.requires_grad_(False)
    return model


def p_tuning(base, task_type, reparam="MLP"):
    """PEFT P-tuning (3 virtual tokens, encoder width 8, ``reparam``: "MLP" or "LSTM", dropout 0) on ``base``."""
    from peft import PromptEncoderConfig, get_peft_model

    cfg = PromptEncoderConfig(task_type=task_type, num_virtual_tokens=3, encoder_hidden_size=8,
                              encoder_reparameterization_type=reparam, encoder_dropout=0.0)
    return get_peft_model(base, cfg)
