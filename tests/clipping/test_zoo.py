"""Full fine-tuning across a zoo of transformers architectures, exact against the per-example oracle.

Each model is tiny and random-init (float64, dropout off). The oracle runs the model on ONE example at a time and
takes the model's own ``.loss`` (what the plain ``Trainer`` trains), clips it (flat: one threshold; per-layer: the
trainer's groups and thresholds set to the per-group medians), and sums. With σ = 0, q = 1, SGD lr = 1 and a constant
schedule, the DP update times the expected batch size must equal that sum (DESIGN invariants 1 and 9).

Parameters frozen below are those no rule of ``layers.py`` covers yet; each freeze names its reason.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from datasets import Dataset
from helpers import (
    RTOL,
    VOCAB,
    Seq,
    check_engine,
    check_exact,
    cls_dataset,
    decoder_data,
    dp_args,
    image_cls,
    seq2seq_dataset,
)

from hf_dp import DPTrainer

N = 4  # examples; q = 1: all of them in the one step, two micro-batches of two
SMALL = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def freeze(model: torch.nn.Module, *fragments: str) -> torch.nn.Module:
    for name, p in model.named_parameters():
        if any(f in name for f in fragments):
            p.requires_grad_(False)
    return model


# ------------------------------------------------------------------------------------------------------- the zoo
def dec(cfg_cls, model_cls, **kw):
    """A tiny decoder: hidden 16, 1 layer, vocab 61, untied head unless the family ties it."""
    base = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    base.update(kw)
    return lambda: model_cls(cfg_cls(**base))


def enc(cfg_cls, model_cls, **kw):
    base = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
                max_position_embeddings=32, pad_token_id=0, num_labels=3, **SMALL)
    base.update(kw)
    return lambda: model_cls(cfg_cls(**base))


def bart_like(cfg_cls, model_cls, **kw):
    base = dict(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=32,
                dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=0,
                eos_token_id=1, decoder_start_token_id=0, forced_eos_token_id=None, scale_embedding=True)
    base.update(kw)
    return lambda: model_cls(cfg_cls(**base))


DECODERS = {
    "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=32,
                                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "llama": dec(tf.LlamaConfig, tf.LlamaForCausalLM),
    "qwen2": dec(tf.Qwen2Config, tf.Qwen2ForCausalLM),
    "gemma": dec(tf.GemmaConfig, tf.GemmaForCausalLM, head_dim=8),  # scaled, tied embedding; (1 + w) RMSNorm
    "gemma2": dec(tf.Gemma2Config, tf.Gemma2ForCausalLM, head_dim=8),
    "gemma3": dec(tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, head_dim=8),
    "cohere": dec(tf.CohereConfig, tf.CohereForCausalLM),  # LayerNorm without bias
    "nemotron": dec(tf.NemotronConfig, tf.NemotronForCausalLM, head_dim=8),  # LayerNorm1P: (1 + w)
    "olmo": dec(tf.OlmoConfig, tf.OlmoForCausalLM),
    "olmo2": dec(tf.Olmo2Config, tf.Olmo2ForCausalLM),
    "phi": dec(tf.PhiConfig, tf.PhiForCausalLM, resid_pdrop=0.0, embd_pdrop=0.0),
    "falcon": dec(tf.FalconConfig, tf.FalconForCausalLM, num_kv_heads=1, new_decoder_architecture=False,
                  hidden_dropout=0.0, attention_dropout=0.0),  # FalconLinear: x @ W.T + b
    # Learned positions with an offset, computed from the attention mask; fc1/fc2 and the layer's final LayerNorm
    # see flattened (B·T, d) tokens (proven example-major at the first step and regrouped per example).
    "opt": dec(tf.OPTConfig, tf.OPTForCausalLM, ffn_dim=24, word_embed_proj_dim=16, dropout=0.0,
               attention_dropout=0.0),
    "biogpt": dec(tf.BioGptConfig, tf.BioGptForCausalLM, scale_embedding=True, **SMALL),
    # Mixture of experts (3-D expert parameters + a router on flattened tokens). "eager" experts: the grouped_mm
    # kernels take no float64; the rule does not depend on the implementation (it is checked against its output).
    "mixtral": dec(tf.MixtralConfig, tf.MixtralForCausalLM, num_local_experts=4, num_experts_per_tok=2,
                   experts_implementation="eager"),
    "olmoe": dec(tf.OlmoeConfig, tf.OlmoeForCausalLM, num_experts=4, num_experts_per_tok=2,
                 experts_implementation="eager"),
    # The shared expert and its gate are Linear layers on flattened (B·T, d) tokens (as OPT's fc1/fc2).
    "qwen2_moe": dec(tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=8, shared_expert_intermediate_size=8, experts_implementation="eager"),
    # Transposed expert storage with biases and a clamped, interleaved GLU. Attention sinks are a parameter used
    # directly in the attention function (no layer rule): frozen.
    "gpt_oss": lambda: freeze(dec(tf.GptOssConfig, tf.GptOssForCausalLM, head_dim=8, num_local_experts=4,
                                  num_experts_per_tok=2, experts_implementation="eager",
                                  layer_types=["full_attention"])(), "sinks"),
    # Sigmoid, group-limited routing; the router casts its weight to float32 (so this oracle is float32 there).
    "deepseek_v3": dec(tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM, num_key_value_heads=2, n_routed_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=8, n_shared_experts=1, first_k_dense_replace=0,
                       n_group=1, topk_group=1, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                       v_head_dim=8, experts_implementation="eager"),
    "xglm": dec(tf.XGLMConfig, tf.XGLMForCausalLM, d_model=16, ffn_dim=24, num_layers=1, dropout=0.0,
                attention_dropout=0.0, activation_dropout=0.0),  # scaled embedding, sinusoidal positions
    # State space: the mixer reads conv1d.weight/.bias and dt_proj.weight/.bias directly (no layer hook sees those
    # uses); the first-step check names them and they are computed by re-running the mixer per example (the
    # enclosing-module fallback, with its own A_log and D).
    "mamba": lambda: tf.MambaForCausalLM(tf.MambaConfig(
        vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=1, expand=2, conv_kernel=3, time_step_rank=4,
        pad_token_id=0, bos_token_id=0, eos_token_id=0)),
}

ENCODERS = {
    "bert": enc(tf.BertConfig, tf.BertForSequenceClassification),
    "roberta": enc(tf.RobertaConfig, tf.RobertaForSequenceClassification, pad_token_id=1, max_position_embeddings=40),
    "electra": enc(tf.ElectraConfig, tf.ElectraForSequenceClassification, embedding_size=8),
    "distilbert": lambda: tf.DistilBertForSequenceClassification(tf.DistilBertConfig(
        vocab_size=VOCAB, dim=16, n_layers=1, n_heads=2, hidden_dim=24, max_position_embeddings=32, dropout=0.0,
        attention_dropout=0.0, seq_classif_dropout=0.0, num_labels=3, pad_token_id=0)),
    # DeBERTa-v2/v3 with its convolution layer (Conv1d + LayerNorm). Relative attention is off: its position
    # projections see the relative embeddings once per batch (no batch axis), the engine's broadcast work.
    "deberta_v2": enc(tf.DebertaV2Config, tf.DebertaV2ForSequenceClassification, relative_attention=False,
                      position_biased_input=True, conv_kernel_size=3, pooler_dropout=0.0),
    # DeBERTa-v3 (its configs' defaults): relative attention with log buckets, the relative embeddings read directly
    # (rel_embeddings.weight) then a LayerNorm, computed once per batch, and projected batch-less by each layer's
    # shared query/key projections (share_att_key); two layers share them. A wide init (0.5) so that the attention
    # (and the relative embeddings' gradient) is not negligible next to the classifier's.
    "deberta_v3": enc(tf.DebertaV2Config, tf.DebertaV2ForSequenceClassification, num_hidden_layers=2,
                      relative_attention=True, position_buckets=4, max_relative_positions=8, share_att_key=True,
                      pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm", position_biased_input=False,
                      pooler_dropout=0.0, initializer_range=0.5),
    # DeBERTa-v2 style: separate position projections (pos_key_proj with bias, pos_query_proj), no buckets, no norm.
    "deberta_v2_rel": enc(tf.DebertaV2Config, tf.DebertaV2ForSequenceClassification, relative_attention=True,
                          max_relative_positions=4, share_att_key=False, pos_att_type=["p2c", "c2p"],
                          pooler_dropout=0.0, initializer_range=0.5),
    # MPNet: a relative position bias looked up with (T, T) bucket ids and expanded to the batch in
    # compute_position_bias (a mixing point). Wide init so the bias's gradient is not negligible.
    "mpnet": enc(tf.MPNetConfig, tf.MPNetForSequenceClassification, pad_token_id=1, max_position_embeddings=40,
                 initializer_range=0.5),
    # Longformer's global attention: query_global's output is a view (F.linear on a 3-D, sequence-first input) that
    # the model divides in place; the engine hooks the base the layer computed, so the gradient reaches its rule.
    "longformer": enc(tf.LongformerConfig, tf.LongformerForSequenceClassification, attention_window=4,
                      max_position_embeddings=40, pad_token_id=1),
    # DeBERTa v1 with relative attention: pos_proj / pos_q_proj project the relative embeddings once per batch inside
    # disentangled_att_bias (a mixing point, as v2's disentangled_attention_bias); q_bias / v_bias by the fallback.
    "deberta": enc(tf.DebertaConfig, tf.DebertaForSequenceClassification, relative_attention=True,
                   max_relative_positions=4, pos_att_type=["p2c", "c2p"], pooler_dropout=0.0, initializer_range=0.5),
    # Reversible layers (Kitaev et al. 2020, §3): the backward recomputes each layer's activations in a custom
    # autograd.Function that asserts `self.training`, so the eval-mode half of dp_self_check is skipped (a warning);
    # the hooks fire inside that recomputation. Local + LSH attention, axial position embeddings (the fallback).
    "reformer": lambda: tf.ReformerForSequenceClassification(tf.ReformerConfig(
        vocab_size=VOCAB, hidden_size=16, num_attention_heads=2, attention_head_size=8, feed_forward_size=24,
        attn_layers=["local", "lsh"], axial_pos_embds_dim=[8, 8], axial_pos_shape=[2, 3], max_position_embeddings=6,
        local_attn_chunk_length=2, lsh_attn_chunk_length=2, num_buckets=2, num_hashes=1, hash_seed=0, pad_token_id=0,
        num_labels=3, hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0, classifier_dropout=0.0)),
    "squeezebert": lambda: tf.SqueezeBertForSequenceClassification(tf.SqueezeBertConfig(  # Conv1d, grouped
        vocab_size=VOCAB, hidden_size=16, embedding_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=24, max_position_embeddings=32, q_groups=2, k_groups=2, v_groups=2, post_attention_groups=2,
        intermediate_groups=2, output_groups=2, num_labels=3, pad_token_id=0, **SMALL)),
}

SEQ2SEQ = {
    "bart": bart_like(tf.BartConfig, tf.BartForConditionalGeneration),  # scaled + offset positions, tied
    "mbart": bart_like(tf.MBartConfig, tf.MBartForConditionalGeneration),
    "blenderbot_small": bart_like(tf.BlenderbotSmallConfig, tf.BlenderbotSmallForConditionalGeneration),  # (T,) ids
    "t5": lambda: tf.T5ForConditionalGeneration(tf.T5Config(  # relative bias: expanded per example where broadcast
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=24, num_layers=1, num_decoder_layers=1, num_heads=2,
        dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)),
}


VISION = {
    # Conv2d patch embedding; cls_token / position_embeddings are used directly in ViTEmbeddings.forward: the
    # generic torch.func fallback (clipping/fallback.py).
    "vit": lambda: tf.ViTForImageClassification(tf.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=24, num_labels=3, **SMALL)),
    # Conv-only: patchify Conv2d, depthwise 7x7 Conv2d (groups = C), channels-first LayerNorm, strided downsampling.
    "convnext": lambda: tf.ConvNextForImageClassification(tf.ConvNextConfig(
        num_channels=3, patch_size=2, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, layer_scale_init_value=0.0,
        image_size=8, num_labels=3, drop_path_rate=0.0)),
    # relative_position_bias_table is looked up with no batch axis (its module's output (1, H, T, T) is shared by the
    # batch): the first step finds it, and it is computed by re-running the enclosing attention per example.
    "swin": lambda: tf.SwinForImageClassification(tf.SwinConfig(
        image_size=8, patch_size=2, num_channels=3, embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=2,
        num_labels=3, drop_path_rate=0.0, **SMALL)),
    # SigLIP's attention-pooling head: nn.MultiheadAttention applies out_proj.weight functionally, so out_proj goes
    # (statically) to the fallback of the MultiheadAttention with in_proj; a linear classifier on pooler_output.
    "siglip_pool": lambda: SiglipPooled(),
}


class SiglipPooled(torch.nn.Module):
    """``SiglipVisionModel`` (its pooling head: ``nn.MultiheadAttention``) and a linear classifier on ``pooler_output``;
    the loss is the mean cross-entropy (on a batch of one: the example's)."""

    def __init__(self):
        super().__init__()
        self.config = tf.SiglipVisionConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16,
                                            num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
                                            attention_dropout=0.0)
        self.vision = tf.SiglipVisionModel(self.config)
        self.classifier = torch.nn.Linear(16, 3)

    def forward(self, pixel_values, labels=None):
        logits = self.classifier(self.vision(pixel_values=pixel_values).pooler_output)
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
        return tf.modeling_outputs.SequenceClassifierOutput(loss=loss, logits=logits)


def audio_cls(n: int = N, length: int = 64, labels: int = 3) -> list[dict[str, torch.Tensor]]:
    """Random float64 waveforms (a list dataset, as image_cls)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, length, generator=g, dtype=torch.float64)
    y = torch.randint(0, labels, (n,), generator=g)
    return [{"input_values": x[i], "labels": y[i]} for i in range(n)]


AUDIO = {
    # The positional convolution is weight-normed (parametrization original0 / original1, read through conv.weight):
    # its tensors go (statically) to the fallback of the enclosing Wav2Vec2PositionalConvEmbedding. Default loss.
    "wav2vec2": lambda: tf.Wav2Vec2ForSequenceClassification(tf.Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24, conv_dim=(8, 8),
        conv_stride=(4, 2), conv_kernel=(8, 4), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
        num_labels=3, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
        final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, feat_extract_norm="layer")),
}
# The image classifiers' own loss is single-label cross-entropy; hf_dp has no default per-example loss for them yet.
IMAGE_LOSS = {"per_example_loss": lambda out, y: torch.nn.functional.cross_entropy(out.logits, y, reduction="none")}


def encoder_data():
    return cls_dataset(N, num_labels=3, seq_len=6)


def seq2seq_data():
    return seq2seq_dataset(N)


CASES = ([(k, f, decoder_data) for k, f in DECODERS.items()] + [(k, f, encoder_data) for k, f in ENCODERS.items()]
         + [(k, f, seq2seq_data) for k, f in SEQ2SEQ.items()] + [(k, f, image_cls) for k, f in VISION.items()]
         + [(k, f, audio_cls) for k, f in AUDIO.items()])


def float64_defaults(make):
    """XGLM's attention builds ``torch.full((), finfo(dtype).min)`` in the default dtype: float64 needs it float64."""
    def build():
        torch.set_default_dtype(torch.float64)
        return make()
    return build


CASES = [(k, float64_defaults(f) if k == "xglm" else f, d) for k, f, d in CASES]
NEEDS: dict[str, str] = {}


# Models that compute in float32 by design even when cast to float64: their oracle is float32-rounded there.
FLOAT32_INSIDE = {"gemma": "RMSNorm upcasts with x.float()", "gemma2": "same", "gemma3": "same",
                  "deberta_v2": "its classification loss calls .float()",
                  "deberta_v3": "same", "deberta_v2_rel": "same",
                  "deepseek_v3": "its router casts to float32",
                  "deberta": "DebertaLayerNorm normalises in float32 (.float()) inside every layer"}
#: float32 inside every layer: the engine's batched run and the oracle's single examples round differently, by
#: ~1e-7 of the largest update (float32's epsilon), so elementwise agreement is to 2e-4
RTOL_OF = {"deberta": 2e-4}


def rtol_of(name: str) -> float:
    return RTOL_OF.get(name, max(RTOL, 1e-5) if name in FLOAT32_INSIDE else RTOL)


@pytest.fixture(autouse=True)
def _default_dtype():
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)


@pytest.mark.parametrize("name,make,data", [
    pytest.param(*c, marks=pytest.mark.xfail(reason=NEEDS[c[0]], strict=False)) if c[0] in NEEDS else c
    for c in CASES], ids=[c[0] for c in CASES])
def test_full_fine_tuning_is_exact(tmp_path, name, make, data):
    torch.manual_seed(0)
    check_exact(make(), data(), tmp_path, rtol=rtol_of(name), **(IMAGE_LOSS if name in VISION else {}))


# Per-layer clipping (one threshold per layer, clipped inside the backward pass) on one model per new rule: scaled
# tied embeddings + (1 + w) norms, offset positions, FalconLinear, grouped Conv1d + channels-first norm, depthwise
# Conv2d, transposed MoE experts with biases and their router; DeBERTa's relative embeddings (shared and mixing
# points), MPNet's position bias (a mixing point).
PER_LAYER = ["gemma", "bart", "falcon", "nemotron", "squeezebert", "convnext", "gpt_oss", "deberta_v3",
             "deberta_v2_rel", "mpnet",
             # the enclosing-module fallback (re-planned at the first step: Mamba's direct reads, Swin's batch-less
             # table; static: weight norm, nn.MultiheadAttention), an in-place op on a layer's output (Longformer),
             # DeBERTa v1's mixing point
             "mamba", "swin", "wav2vec2", "siglip_pool", "longformer", "deberta"]


@pytest.mark.parametrize("name", PER_LAYER)
def test_per_layer_clipping_is_exact(tmp_path, name):
    _, make, data = next(c for c in CASES if c[0] == name)
    torch.manual_seed(0)
    check_exact(make(), data(), tmp_path, clipping="per_layer", rtol=rtol_of(name),
                **(IMAGE_LOSS if name in VISION else {}))


# Activation checkpointing (both kinds) on one model per mechanism that runs inside a checkpointed block and that
# tests/clipping/test_checkpointing*.py does not cover: the enclosing-module fallback re-planned at the first step
# (Mamba's mixer, Swin's batch-less table), MoE experts and router (Mixtral), flattened (B·T, d) tokens regrouped (OPT),
# the static fallback of a weight-normed convolution (Wav2Vec2). Flat clipping takes two passes here ("auto"): pass 2
# is the model's own batched backward, so models that compute in float32 inside (Mamba's scan) agree to 1e-5.
# The whole zoo × {reentrant, non-reentrant} × {flat, per-layer} (× lm_loss_chunk_size): benchmarks/zoo_sweep.py.
CHECKPOINTED = [("mamba", "per_layer", True), ("swin", "flat", True), ("mixtral", "flat", False),
                ("opt", "per_layer", False), ("wav2vec2", "per_layer", True)]


@pytest.mark.parametrize("name,clipping,reentrant", CHECKPOINTED,
                         ids=[f"{n}-{c}-{'reentrant' if r else 'nonreentrant'}" for n, c, r in CHECKPOINTED])
def test_exact_under_activation_checkpointing(tmp_path, name, clipping, reentrant):
    """...and the blocks were re-run inside the backward (module forwards while a backward pass runs)."""
    _, make, data = next(c for c in CASES if c[0] == name)
    recomputed = []
    hook = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda *_: recomputed.append(1) if torch._C._current_graph_task_id() != -1 else None)
    try:
        torch.manual_seed(0)
        check_exact(make(), data(), tmp_path, clipping=clipping, rtol=max(rtol_of(name), 1e-5),
                    gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": reentrant},
                    **(IMAGE_LOSS if name in VISION else {}))
    finally:
        hook.remove()
    assert recomputed


# ------------------------------------------------------------------------------- the new rules, layer by layer
# Each against a loop over single examples (``helpers.check_engine``), then each run-time check refusing
# the case it exists for.

from hf_dp import ClippingEngine, UnsupportedLayerError  # noqa: E402


@pytest.mark.parametrize("conv", [
    lambda: torch.nn.Conv1d(3, 4, 3),
    lambda: torch.nn.Conv1d(3, 6, 3, stride=2, padding=2, dilation=2, bias=False),
    lambda: torch.nn.Conv1d(4, 4, 3, padding="same", groups=4),  # depthwise (Mamba)
    lambda: torch.nn.Conv1d(3, 2, 4, padding="same", dilation=3),  # asymmetric 'same' padding
    lambda: torch.nn.Conv1d(4, 6, 2, groups=2, padding_mode="circular", padding=1),
    lambda: torch.nn.Conv2d(3, 4, 2, stride=2),  # patch embedding (ViT)
    lambda: torch.nn.Conv2d(4, 4, 3, padding=1, groups=4),  # depthwise (ConvNeXt)
    lambda: torch.nn.Conv2d(2, 4, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2), padding_mode="reflect"),
], ids=["plain1d", "stride_pad_dil", "depthwise_same", "even_same", "grouped_circular", "patch2d", "depthwise2d",
        "reflect2d"])
@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")  # torch's own, from the layer itself
def test_conv_rule(conv):
    torch.manual_seed(0)
    layer = conv()
    x = torch.randn(5, layer.in_channels, *([7, 6] if isinstance(layer, torch.nn.Conv2d) else [9]))
    check_engine(Seq(layer, torch.nn.Tanh()), x)


class ScaledEmbedding(torch.nn.Embedding):
    """BART / Gemma style: the parent's lookup times a scale."""

    def forward(self, ids):
        return super().forward(ids) * 3.0


class Positions(torch.nn.Embedding):
    """BlenderbotSmall / BART style: looks up positions it computes itself, with no batch axis, plus an offset."""

    def forward(self, ids, offset: int = 1):
        return super().forward(torch.arange(ids.shape[1]) + offset)  # (T, d), broadcast over the batch


class TinyLM(torch.nn.Module):
    def __init__(self, lin=torch.nn.Linear, positions=True):
        super().__init__()
        self.tok = ScaledEmbedding(11, 4, padding_idx=0)
        self.pos = Positions(12, 4) if positions else None
        self.proj = lin(4, 4)
        self.head = torch.nn.Linear(4, 11, bias=False)
        self.head.weight = self.tok.weight  # tied: the scaled lookup and the head are one parameter

    def forward(self, ids):
        h = self.tok(ids) + (self.pos(ids) if self.pos is not None else 0)
        return self.head(torch.tanh(self.proj(h)))


def test_embedding_subclasses_scaled_tied_and_broadcast_positions():
    torch.manual_seed(1)
    check_engine(TinyLM(), torch.randint(0, 11, (5, 6)))


class FalconLike(torch.nn.Linear):
    def forward(self, x):
        y = x @ self.weight.T
        return y if self.bias is None else y + self.bias


class NotLinear(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2.0  # a scale the linear rule would miss


def test_linear_subclass_verified_by_behaviour():
    torch.manual_seed(2)
    check_engine(TinyLM(lin=FalconLike, positions=False), torch.randint(0, 11, (4, 5)))
    model = TinyLM(lin=NotLinear, positions=False)
    engine = ClippingEngine(model)
    with pytest.raises(UnsupportedLayerError, match="proj.*does not compute"), engine.record(4):
        model(torch.randint(0, 11, (4, 5))).sum().backward()


class WeightReadDirectly(torch.nn.Embedding):
    def forward(self, ids):
        return super().forward(ids) + self.weight.mean(0)  # a second use of the weight, outside F.embedding


def test_embedding_subclass_other_use_of_weight_is_refused():
    model = Seq(WeightReadDirectly(11, 4), torch.nn.Linear(4, 2))
    engine = ClippingEngine(model)
    with pytest.raises(UnsupportedLayerError, match="other than through F.embedding.*tied"), engine.record(3):
        model(torch.randint(0, 11, (3, 5))).sum().backward()


class GemmaLikeNorm(torch.nn.Module):
    """(1 + w) ⊙ x / rms(x), as Gemma."""

    def __init__(self, d):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d) * 0.1)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + self.weight)


class ChannelsFirstNorm(torch.nn.LayerNorm):
    """SqueezeBERT / ConvNeXt: normalises (B, C, T) over C."""

    def forward(self, x):
        return super().forward(x.transpose(1, 2)).transpose(1, 2)


class BatchStatNorm(torch.nn.Module):
    """Normalises with statistics over the whole batch: mixes examples."""

    def __init__(self, d):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))
        self.bias = torch.nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return self.weight * (x - x.mean((0, 1))) / (x.std((0, 1)) + 1e-5) + self.bias


class ChannelScale(torch.nn.Module):
    """Weight of the right size, applied along the wrong axis for its claimed form unless the rule finds the axis."""

    def __init__(self, d):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        return torch.tanh(x) * self.weight[:, None]  # (B, C, T) scaled along C


def test_affine_norm_rule_offsets_axes_and_layer_scale():
    torch.manual_seed(3)
    check_engine(Seq(torch.nn.Linear(4, 6), GemmaLikeNorm(6), torch.nn.Linear(6, 2)), torch.randn(4, 3, 4))
    lnorm = ChannelsFirstNorm(5)
    with torch.no_grad():
        lnorm.weight.uniform_(0.5, 1.5)
        lnorm.bias.uniform_(-1, 1)
    check_engine(Seq(torch.nn.Conv1d(3, 5, 2), lnorm, torch.nn.Conv1d(5, 2, 1)), torch.randn(4, 3, 6))
    check_engine(Seq(torch.nn.Conv1d(3, 5, 1), ChannelScale(5), torch.nn.Conv1d(5, 2, 1)), torch.randn(4, 3, 6))


def test_affine_norm_that_mixes_examples_is_refused():
    model = Seq(torch.nn.Linear(3, 4), BatchStatNorm(4))
    engine = ClippingEngine(model)
    with pytest.raises(UnsupportedLayerError, match="other examples"), engine.record(4):
        model(torch.randn(4, 5, 3)).sum().backward()


def test_batch_norm_is_refused_before_training():
    with pytest.raises(UnsupportedLayerError, match=r"mods\.1 \(BatchNorm1d\)"):
        ClippingEngine(Seq(torch.nn.Conv1d(2, 3, 1), torch.nn.BatchNorm1d(3)))


class Router(torch.nn.Module):
    """A top-k router as transformers 5 writes them: F.linear on flattened tokens."""

    def __init__(self, d, n_exp, scale=1.0):
        super().__init__()
        self.top_k, self.num_experts, self.scale = 2, n_exp, scale
        self.weight = torch.nn.Parameter(torch.randn(n_exp, d))

    def forward(self, x):
        weight = self.weight.to(x.dtype, copy=True)  # a cast on the way to F.linear, as DeepSeek-V3's
        weight = weight if self.scale == 1.0 else weight * self.scale  # another use: refused
        logits = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), weight)
        w, idx = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        return w, idx


class Experts(torch.nn.Module):
    """The transformers 5 expert-block layout (``@use_experts_implementation`` attributes); ``scale`` != 1 makes it
    compute something the expert rule does not factor."""

    def __init__(self, d, n_exp, inter, scale=1.0):
        super().__init__()
        self.num_experts, self.scale = n_exp, scale
        self.has_gate, self.has_bias, self.is_transposed = True, False, False
        self.gate_up_proj = torch.nn.Parameter(torch.randn(n_exp, 2 * inter, d) * 0.3)
        self.down_proj = torch.nn.Parameter(torch.randn(n_exp, d, inter) * 0.3)
        self.act_fn = torch.nn.SiLU()

    def _apply_gate(self, u):
        gate, up = u.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def forward(self, x, idx, w):
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok, slot = torch.where(idx == e)
            h = self._apply_gate(torch.nn.functional.linear(x[tok], self.gate_up_proj[e]))
            y = torch.nn.functional.linear(h, self.down_proj[e]) * w[tok, slot, None]
            out.index_add_(0, tok, y)
        return out * self.scale


class MoE(torch.nn.Module):
    def __init__(self, router_scale=1.0, experts_scale=1.0):
        super().__init__()
        self.inp = torch.nn.Linear(3, 6)
        self.gate = Router(6, 4, router_scale)
        self.experts = Experts(6, 4, 5, experts_scale)

    def forward(self, x):
        h = self.inp(x)
        w, idx = self.gate(h)
        return self.experts(h.reshape(-1, 6), idx, w).reshape(h.shape)


def test_moe_experts_and_router():
    torch.manual_seed(4)
    check_engine(MoE(), torch.randn(5, 4, 3))


@pytest.mark.parametrize("which,match", [("experts", "does not compute the routed gated MLP"),
                                          ("router", "other than through F.linear")])
def test_moe_lookalikes_are_refused(which, match):
    model = MoE(**{f"{which}_scale": 2.0})
    engine = ClippingEngine(model)
    with pytest.raises(UnsupportedLayerError, match=match), engine.record(3):
        model(torch.randn(3, 4, 3)).sum().backward()


def test_fsdp_engine_refuses_rules_it_cannot_hook():
    """The FSDP engine keys hooks by attribute and keeps no parameters: call-capturing and all-input rules would lose
    their uses there, so it refuses them by name instead."""
    from hf_dp.clipping.fsdp import FSDPClippingEngine

    with pytest.raises(UnsupportedLayerError, match=r"Under FSDP.*tok \(ScaledEmbedding\)"):
        FSDPClippingEngine(TinyLM(positions=False))
    with pytest.raises(UnsupportedLayerError, match=r"Under FSDP.*gate \(Router\), experts \(Experts\)"):
        FSDPClippingEngine(MoE())


class DividedInPlace(torch.nn.Module):
    """Longformer's pattern: a Linear on a 3-D input (its output a view of a 2-D matmul) divided in place by the
    caller; a hook on that view would be dropped by the in-place op (the view is rebased), losing the layer's use."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        y /= 2.0
        return y.tanh()


def test_layer_output_modified_in_place_keeps_its_gradient():
    torch.manual_seed(5)
    check_engine(Seq(torch.nn.Linear(4, 4), DividedInPlace(), torch.nn.Linear(4, 2)), torch.randn(5, 3, 4))
    check_engine(Seq(DividedInPlace(), torch.nn.Linear(4, 2)), torch.randn(5, 3, 4))  # first layer: no graph before


# ------------------------------------------------------------------- shared + mixing points (DeBERTa-v2's pattern)
class RelMix(torch.nn.Module):
    """One layer of the DeBERTa pattern: the shared table projected batch-less, the projection divided in place
    through a view (DeBERTa v1 does), repeated over the examples and combined with each example's queries."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.q = torch.nn.Linear(d, d)
        self.pos = torch.nn.Linear(d, d)
        self.out = torch.nn.Linear(5, d)

    def disentangled_attention_bias(self, query, rel):
        p = self.pos(rel.unsqueeze(0))
        view = p.view(1, -1, 2, 2)
        view /= 2.0  # in place, on a view of the captured output
        p = p.repeat(query.shape[0], 1, 1)  # (B, R, d)
        return torch.bmm(query, p.transpose(1, 2))  # (B, T, R)

    def forward(self, x, rel):
        return x + self.out(self.disentangled_attention_bias(self.q(x), rel).tanh())


class RelModel(torch.nn.Module):
    def __init__(self, d: int = 4, r: int = 5):
        super().__init__()
        self.rel = torch.nn.Embedding(r, d)
        self.norm = torch.nn.LayerNorm(d)
        self.layers = torch.nn.ModuleList([RelMix(d), RelMix(d)])

    def get_rel_embedding(self):
        return self.norm(self.rel.weight)  # read directly, then a norm

    def forward(self, x):
        rel = self.get_rel_embedding()
        for layer in self.layers:
            x = layer(x, rel)
        return x


def test_shared_and_mixing_points_against_the_loop():
    """rel.weight (read directly), the norm on it, and the position projections applied batch-less in two layers
    (the second layer's queries depend on the table through the first: counted once)."""
    torch.manual_seed(0)
    check_engine(RelModel(), torch.randn(3, 6, 4))


def test_lora_on_deberta_v3_position_projections_is_exact(tmp_path):
    """LoRA on query/key, which DeBERTa-v3 also applies to the batch-less relative embeddings (share_att_key):
    lora_A and lora_B are both captured inside the mixing point."""
    from peft import LoraConfig, get_peft_model

    _, make, data = next(c for c in CASES if c[0] == "deberta_v3")
    torch.manual_seed(0)
    model = get_peft_model(make().double(), LoraConfig(r=2, target_modules=["query_proj", "key_proj"],
                                                       task_type="SEQ_CLS", init_lora_weights=False))
    check_exact(model, data(), tmp_path, rtol=rtol_of("deberta_v3"))


def test_longformer_batch_dependent_global_rows_are_refused_without_self_check(tmp_path):
    """query_global's input holds one row per global token, padded to the largest count in the batch, with the
    examples on axis 1. With 1 and 2 global tokens in the first micro-batch, (2, 2, d) for 2 examples and (1, 1, d)
    for the first alone: both axes grow with the examples, so the batch axis cannot be proven (taking the first would
    split the gradient by global slot, silently: the micro-batches here always have 2 rows). Refused at the first
    step, also with dp_self_check=False (the enclosing attention cannot be re-run under vmap either)."""
    data = encoder_data()
    rows = [dict(data[i]) for i in range(N)]
    for i, r in enumerate(rows):
        r["global_attention_mask"] = [1] * (1 + (i in (1, 2))) + [0] * (len(r["input_ids"]) - 1 - (i in (1, 2)))
    model = ENCODERS["longformer"]()
    args = dp_args(tmp_path, 2, 2, 1.0, poisson_sampling=True, dp_self_check=False)
    trainer = DPTrainer(model=model.double(), args=args, train_dataset=Dataset.from_list(rows))
    with pytest.raises(UnsupportedLayerError, match=r"(?s)query_global \(Linear, call 1 in the forward\): both the "
                                                    r"first axis and axis 1.*cannot tell which axis holds"):
        trainer.train()


def test_lora_all_linear_on_moe_refusal_names_the_adapter_layers(tmp_path):
    """target_modules="all-linear" on an MoE model: PEFT also adapts the router and the 3-D experts (ParamWrapper,
    a weight delta no layer hook sees per example). The refusal must not advise "use LoRA" alone: it names the adapter
    layers and says to list the layers to adapt; LoRA on the attention projections is exact."""
    from peft import LoraConfig, get_peft_model

    from hf_dp import UnsupportedLayerError

    _, make, data = next(c for c in CASES if c[0] == "mixtral")
    torch.manual_seed(0)
    model = get_peft_model(make().double(), LoraConfig(r=2, target_modules="all-linear", init_lora_weights=False))
    with pytest.raises(UnsupportedLayerError, match=r"belong to PEFT adapter layers \(.*mlp\.(experts|gate)") as err:
        check_exact(model, data(), tmp_path)
    assert "`target_modules`" in str(err.value)
    torch.manual_seed(0)
    model = get_peft_model(make().double(), LoraConfig(r=2, target_modules=["q_proj", "v_proj"],
                                                       init_lora_weights=False))
    check_exact(model, data(), tmp_path)
