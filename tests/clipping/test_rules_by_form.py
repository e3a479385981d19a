"""Rules chosen by a layer's form, checked on the first batch (findings of the transformers sweep, tests/scripts).

Minimal modules reproduce each pattern against a per-example loop (``check_engine``, float64); tiny random-init
transformers models are checked with the oracle harness of ``tests/clipping/test_zoo.py`` (``helpers.check_exact``: the
model's own loss on a batch of one, σ = 0, q = 1).
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from helpers import VOCAB, Seq, check_engine, check_exact, decoder_data, image_cls, seq2seq_dataset
from torch import nn

from hf_dp import UnsupportedLayerError
from hf_dp.clipping.engine import ClippingEngine

N = 4  # examples of the exact checks (helpers.check_exact: q = 1, two micro-batches of two)


@pytest.fixture(autouse=True)
def _default_dtype():
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)


def first_step(model: nn.Module, x: torch.Tensor) -> ClippingEngine:
    engine = ClippingEngine(model)
    engine.first_step_check(lambda sl: model(x[sl]).pow(2).flatten(1).sum(1), x.shape[0])
    return engine


# ------------------------------------------------------------------------- nn.Linear subclasses returning tuples
class TupleRouter(nn.Linear):
    """PhiMoE / Llama 4 style: an nn.Linear subclass that returns (scores, logits), not one tensor."""

    def __init__(self, d, n_exp, router=True):
        super().__init__(d, n_exp, bias=False)
        if router:
            self.top_k, self.num_experts = 1, n_exp

    def forward(self, x):
        logits = super().forward(x)
        return torch.softmax(logits, -1), logits


class RoutedBlock(nn.Module):
    """Tokens flattened to (B·T, d) as MoE blocks do; the router's scores weight an expert mix."""

    def __init__(self, d=4, n_exp=3, router=True):
        super().__init__()
        self.router = TupleRouter(d, n_exp, router)
        self.experts = nn.Linear(d, n_exp * d)

    def forward(self, x):
        b, t, d = x.shape
        scores, _ = self.router(x.reshape(-1, d))
        return (self.experts(x).view(b, t, -1, d) * scores.view(b, t, -1, 1)).sum(2)


def test_tuple_returning_router_subclass_is_exact():
    torch.manual_seed(0)
    check_engine(RoutedBlock(), torch.randn(3, 5, 4))


def test_tuple_returning_linear_subclass_is_refused_not_skipped():
    model = RoutedBlock(router=False)  # not a router: the linear_subclass rule, whose call must return one tensor
    engine = ClippingEngine(model)
    with pytest.raises(UnsupportedLayerError, match=r"router \(TupleRouter\) returned a tuple"), engine.record(3):
        model(torch.randn(3, 5, 4)).sum().backward()


def phimoe():
    cfg = tf.PhimoeConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, num_local_experts=3, num_experts_per_tok=2,
                          max_position_embeddings=32, pad_token_id=0, bos_token_id=0, eos_token_id=0,
                          experts_implementation="eager")
    return tf.PhimoeForCausalLM(cfg)


def test_phimoe_router_is_exact(tmp_path, monkeypatch):
    """PhiMoE's router (an nn.Linear subclass returning a tuple) was silently not clipped. Its training-mode routing
    samples (Gumbel), so the oracle (one example at a time) could not see the same draws: routing made deterministic
    here; the rule is per token whatever the routing."""
    import transformers.models.phimoe.modeling_phimoe as pm

    mixer = pm.sparsemixer
    monkeypatch.setattr(pm, "sparsemixer", lambda s, jitter_eps, training, top_k=2: mixer(s, jitter_eps, False, top_k))
    torch.manual_seed(0)
    check_exact(phimoe(), decoder_data(), tmp_path)


class Noisy(nn.Module):
    """A stochastic layer in train mode (random routing / noise): both runs of the first-step check must see the
    same draws to be compared."""

    def forward(self, x):
        return x * (torch.rand_like(x) + 0.5)


def test_first_step_check_compares_stochastic_layers_like_for_like():
    torch.manual_seed(0)
    first_step(Seq(nn.Linear(3, 4), Noisy(), nn.Linear(4, 2)).double(), torch.randn(4, 5, 3, dtype=torch.float64))


class WithEmpty(nn.Module):
    """MobileBERT's LM head with embedding_size == hidden_size: a (0, V) trainable parameter."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.empty = nn.Linear(3, 0)

    def forward(self, x):
        return torch.cat([self.lin(x), self.empty(x)], -1)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_empty_parameter_is_harmless():
    torch.manual_seed(0)
    model = WithEmpty().double()
    first_step(model, torch.randn(4, 5, 3, dtype=torch.float64))
    check_engine(model, torch.randn(4, 5, 3))


# ------------------------------------------------------------------------------------------- affine layers
class GatedRMSNorm(nn.Module):
    """Qwen3-Next / Qwen3.5 / Mamba2 style: w ⊙ rms_norm(x) ⊙ silu(gate)."""

    def __init__(self, d, default_gate=False):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)
        self.default_gate = default_gate

    def forward(self, x, gate=None):
        y = self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        return y if gate is None else y * torch.nn.functional.silu(gate)


class GatedBlock(nn.Module):
    def __init__(self, d=4, flat=True):
        super().__init__()
        self.inp, self.gate, self.norm, self.out = nn.Linear(3, d), nn.Linear(3, d), GatedRMSNorm(d), nn.Linear(d, 2)
        self.flat = flat

    def forward(self, x):
        h, z = self.inp(x), self.gate(x)
        if self.flat:  # Qwen3-Next: core_attn_out.reshape(-1, head_dim), z likewise
            return self.out(self.norm(h.reshape(-1, h.shape[-1]), z.reshape(-1, z.shape[-1])).view(h.shape))
        return self.out(self.norm(h, gate=z))


@pytest.mark.parametrize("flat", [True, False], ids=["flat_rows", "gate_kwarg"])
def test_gated_rms_norm_is_exact(flat):
    torch.manual_seed(0)
    check_engine(GatedBlock(flat=flat), torch.randn(3, 5, 3))


class GRN(nn.Module):
    """ConvNeXt V2: γ ⊙ (x · N(x)) + β + x, parameters of shape (1, 1, 1, d)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(1, 1, 1, d))
        self.bias = nn.Parameter(torch.randn(1, 1, 1, d))

    def forward(self, x):
        gx = torch.linalg.vector_norm(x, ord=2, dim=(1, 2), keepdim=True)
        return self.weight * (x * gx / (gx.mean(-1, keepdim=True) + 1e-6)) + self.bias + x


class NotAffine(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        return self.weight.pow(2) * x + x  # quadratic in the weight: not the affine form


def test_affine_with_parameter_free_term_is_exact_and_non_affine_refused():
    torch.manual_seed(0)
    check_engine(Seq(nn.Linear(3, 4), GRN(4), nn.Linear(4, 2)), torch.randn(3, 2, 2, 3))
    model = Seq(nn.Linear(3, 4), NotAffine(4))
    engine = ClippingEngine(model)
    with pytest.raises(UnsupportedLayerError, match="does not compute.*not affine"), engine.record(3):
        model(torch.randn(3, 5, 3)).sum().backward()


def qwen3_next(cls=tf.Qwen3NextForCausalLM, cfg_cls=tf.Qwen3NextConfig, **kw):
    base = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8, linear_num_value_heads=2, linear_num_key_heads=1,
                linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=2,
                layer_types=["linear_attention", "full_attention"], max_position_embeddings=32, pad_token_id=0,
                bos_token_id=0, eos_token_id=0)
    base.update(kw)
    return cls(cfg_cls(**base))


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_qwen3_next_is_exact(tmp_path, clipping):
    """Gated RMSNorm on (B·T·H, d) rows with its gate; the gated delta-net's conv1d (read directly by the mixer) by
    the enclosing-module fallback; MoE experts and router."""
    torch.manual_seed(0)
    model = qwen3_next(num_experts=3, num_experts_per_tok=2, moe_intermediate_size=8,
                       shared_expert_intermediate_size=8, experts_implementation="eager")
    check_exact(model, decoder_data(), tmp_path, clipping=clipping, rtol=1e-5)  # (1 + w) norm in float32


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_qwen3_5_is_exact(tmp_path, clipping):
    torch.manual_seed(0)
    model = qwen3_next(tf.Qwen3_5ForCausalLM, tf.Qwen3_5TextConfig)
    check_exact(model, decoder_data(), tmp_path, clipping=clipping, rtol=1e-5)


def test_convnext_v2_is_exact(tmp_path):
    torch.manual_seed(0)
    model = tf.ConvNextV2ForImageClassification(tf.ConvNextV2Config(
        num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], patch_size=2, image_size=8, num_labels=3,
        drop_path_rate=0.0))
    check_exact(model, image_cls(), tmp_path)


# --------------------------------------------------------------------------------- embedding lookups by indexing
class IndexedPositions(nn.Embedding):
    """Whisper's decoder positions: ``self.weight[a:b]`` or ``self.weight[position_ids]``."""

    def forward(self, ids, position_ids=None):
        return self.weight[: ids.shape[1]] if position_ids is None else self.weight[position_ids]


class PosLM(nn.Module):
    def __init__(self, ids_shape="slice"):
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(11, 4), IndexedPositions(8, 4), nn.Linear(4, 3)
        self.ids_shape = ids_shape

    def forward(self, ids):
        t = ids.shape[1]
        position_ids = {"slice": None, "T": torch.arange(t), "1T": torch.arange(t)[None],
                        "BT": torch.arange(t).expand(ids.shape[0], t) + ids[:, :1] % 2}[self.ids_shape]
        return self.head(torch.tanh(self.tok(ids) + self.pos(ids, position_ids)))


@pytest.mark.parametrize("ids_shape", ["slice", "T", "1T", "BT"])
def test_embedding_lookup_by_indexing_is_exact(ids_shape):
    torch.manual_seed(0)
    check_engine(PosLM(ids_shape), torch.randint(0, 11, (3, 5)))


class StridedRead(nn.Embedding):
    def forward(self, ids):
        return self.weight[1::2].sum(0) + super().forward(ids)  # every other row: not a lookup of ids


def test_other_indexing_of_embedding_weight_is_refused():
    """Only row lookups are embedding lookups; with a padding_idx even those are refused (indexing gives the padding
    row a gradient, F.embedding does not)."""
    for emb in (StridedRead(11, 4), IndexedPositions(8, 4, padding_idx=0)):
        model = Seq(emb, nn.Linear(4, 2))
        engine = ClippingEngine(model)
        with pytest.raises(UnsupportedLayerError, match="other than through F.embedding"), engine.record(3):
            model(torch.randint(0, 8, (3, 5))).sum().backward()


def test_whisper_seq2seq_is_exact(tmp_path):
    torch.manual_seed(0)
    cfg = tf.WhisperConfig(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16,
                           decoder_ffn_dim=16, num_mel_bins=8, max_source_positions=8, max_target_positions=16,
                           pad_token_id=0, bos_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                           suppress_tokens=None, begin_suppress_tokens=None)
    model = tf.WhisperForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(0)
    labels = seq2seq_dataset(N)["labels"]
    feats = torch.randn(N, 8, 16, generator=g, dtype=torch.float64)
    data = [{"input_features": f, "labels": torch.tensor(t)} for f, t in zip(feats, labels)]
    check_exact(model, data, tmp_path)


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # torch.func in the enclosing-module fallback
def test_llama4_router_is_exact(tmp_path):
    """Llama 4's router returns (scores, logits) from an nn.Linear subclass (the router rule); full fine-tuning exact
    (its ``Llama4TextExperts``, not the transformers-5 expert layout, by the enclosing-module fallback)."""
    torch.manual_seed(0)
    cfg = tf.Llama4TextConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=16, intermediate_size_mlp=16,
                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                              num_local_experts=3, num_experts_per_tok=1, max_position_embeddings=32,
                              pad_token_id=0, bos_token_id=0, eos_token_id=0)
    check_exact(tf.Llama4ForCausalLM(cfg), decoder_data(), tmp_path)


class BiasedRouter(nn.Module):
    def __init__(self, d=4, n_exp=3, bias_in_call=True):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(n_exp, d)), nn.Parameter(torch.randn(n_exp))
        self.top_k, self.num_experts, self.bias_in_call = 1, n_exp, bias_in_call

    def forward(self, x):
        if self.bias_in_call:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return torch.nn.functional.linear(x, self.weight) + 2 * self.bias  # the rule's Σ g would miss the 2


def test_router_bias_outside_its_call_is_refused():
    torch.manual_seed(0)
    check_engine(Seq(BiasedRouter(), nn.Tanh()), torch.randn(3, 5, 4))
    model = Seq(BiasedRouter(bias_in_call=False), nn.Tanh())
    engine = ClippingEngine(model)
    with pytest.raises(UnsupportedLayerError, match="without its bias"), engine.record(3):
        model(torch.randn(3, 5, 4)).sum().backward()


def test_tuple_returning_linear_subclass_is_exact_by_its_enclosing_module():
    """After the first-step check, the refusal above is resolved by re-running the enclosing block per example."""
    torch.manual_seed(0)
    model = Seq(RoutedBlock(router=False), nn.Tanh()).double()
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    engine = first_step(model, x)
    with engine.record(3):
        model(x).pow(2).flatten(1).sum(1).sum().backward()
    norms = engine.per_example_norms_sq()
    for i in range(3):
        model.zero_grad()
        model(x[i:i + 1]).pow(2).sum().backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(norms[n][i], p.grad.pow(2).sum(), rtol=1e-9, atol=1e-12, msg=n)


class KeywordNorm(GatedRMSNorm):
    def forward(self, x, groups: int = 1, gate=None):  # called with gate= only: a positional re-run puts it in groups
        return super().forward(x.view(*x.shape[:-1], groups, -1).flatten(-2), gate)


def test_affine_layer_that_cannot_be_re_run_is_refused_not_crashed():
    class Block(GatedBlock):
        def forward(self, x):
            return self.out(self.norm(self.inp(x), gate=self.gate(x)))

    model = Block()
    model.norm = KeywordNorm(4)
    engine = ClippingEngine(model)
    with pytest.raises(UnsupportedLayerError, match=r"norm \(KeywordNorm\).*re-running it on this call's inputs"), \
            engine.record(3):
        model(torch.randn(3, 5, 3)).sum().backward()
