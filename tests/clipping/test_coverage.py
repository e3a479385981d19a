"""Coverage of the clipping engine (issues 12 and 13): every trainable parameter is clipped exactly, or refused with
a message that names the real cause — and coverage never depends on ``dp_self_check``.

Each exact case is checked against the float64 oracle: σ = 0, q = 1, SGD with lr = 1, so the update is
``(1/B) Σ_i min(1, C/‖g_i‖) g_i`` with ``g_i`` the gradient of **the model's own loss on a batch of one**
(``model(**example, labels=...).loss``), not a re-implementation of ours.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import (
    VOCAB,
    LossOut,
    Out,
    Rows,
    Toy,
    check_exact,
    dp_args,
    per_example_grads,
    toy_loss,
    toy_rows,
    train_toy,
)
from torch import nn

from hf_dp import DPTrainer, DPTrainingArguments, UnsupportedLayerError
from hf_dp.clipping.engine import ClippingEngine


def engine_norms_and_loop(model: nn.Module, x: torch.Tensor):
    """The engine's per-example squared norms (after the first-step check) on ``x``, and a per-example loop of
    autograd gradients (one example at a time): ``(norms_by_param, [ {param name: grad} per example ])``."""
    engine = ClippingEngine(model)
    b = x.shape[0]

    def run(sl):
        return model(x[sl]).pow(2).sum((1, 2))

    engine.first_step_check(run, b)
    with engine.record(b):
        run(slice(0, b)).sum().backward()
    norms = engine.per_example_norms_sq()
    loop = []
    for i in range(b):
        model.zero_grad()
        run(slice(i, i + 1)).sum().backward()
        loop.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return norms, loop


# ---------------------------------------------------------------------------------------------- tiny models and data
def token_rows(n: int, seq_len: int = 6, seed: int = 0, num_labels: int | None = None) -> Rows:
    """Token ids; labels are the ids (LM / seq2seq targets) or a class per example."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(2, VOCAB, (seq_len,), generator=g)
        labels = ids.clone() if num_labels is None else torch.tensor(i % num_labels)
        rows.append({"input_ids": ids, "attention_mask": torch.ones(seq_len, dtype=torch.long), "labels": labels})
    return Rows(rows)


def image_rows(n: int, size: int = 8, num_labels: int = 3) -> Rows:
    g = torch.Generator().manual_seed(0)
    return Rows([{"pixel_values": torch.randn(3, size, size, generator=g, dtype=torch.float64),
                  "labels": torch.tensor(i % num_labels)} for i in range(n)])


def image_loss(outputs, labels):
    return torch.nn.functional.cross_entropy(outputs.logits, labels, reduction="none")


def tiny_gemma():
    from transformers import GemmaConfig, GemmaForCausalLM

    cfg = GemmaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=32,
                      tie_word_embeddings=True, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return GemmaForCausalLM(cfg)


def tiny_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=24, num_layers=1, num_decoder_layers=1, num_heads=2,
                   relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
                   decoder_start_token_id=0)
    return T5ForConditionalGeneration(cfg)


# ---------------------------------------------------------------------------------------------- exact cases
def test_tied_scaled_embedding_is_exact_without_self_check(tmp_path):
    """Hole 7: Gemma's scaled word embedding (an nn.Embedding subclass with its own forward) tied to the LM head.
    Before, it counted as "covered" by the LM head and its input-side use was silently lost with dp_self_check=False;
    now each owner's forward is its own use (the embedding through the generic fallback) and the update is exact."""
    torch.manual_seed(0)
    model = tiny_gemma()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert type(model.model.embed_tokens).forward is not nn.Embedding.forward
    check_exact(model, token_rows(4), tmp_path, ga=2, dp_self_check=False, rtol=1e-5)  # RMSNorm: x.float()


def test_vit_cls_token_and_position_embeddings_are_exact(tmp_path):
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(1)
    cfg = ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
                    num_attention_heads=2, intermediate_size=24, num_labels=3)
    model = ViTForImageClassification(cfg)
    model.vit.embeddings.patch_embeddings.requires_grad_(False)  # the patch Conv2d rule is another helper's
    trainer = check_exact(model, image_rows(4), tmp_path, ga=2, per_example_loss=image_loss)
    assert {"vit.embeddings.cls_token", "vit.embeddings.position_embeddings"} <= set(trainer.clipping_engine.params)


def test_dinov2_layer_scale_is_exact(tmp_path):
    from transformers import Dinov2Config, Dinov2ForImageClassification

    torch.manual_seed(2)
    cfg = Dinov2Config(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
                       num_attention_heads=2, mlp_ratio=2, num_labels=3)
    model = Dinov2ForImageClassification(cfg)
    model.dinov2.embeddings.requires_grad_(False)  # (patch Conv2d: another helper's rule)
    with torch.no_grad():
        for layer in model.dinov2.encoder.layer:  # away from the initial 1.0 so that the test sees the scale
            layer.layer_scale1.lambda1.normal_()
    check_exact(model, image_rows(4), tmp_path, ga=2, per_example_loss=image_loss)


def test_doge_residual_scales_and_dynamic_mask_are_exact(tmp_path):
    """Doge's `input_residual` (decoder layer) and `A` (attention) are read in forward: generic fallback. Its eager
    attention returns the attention weights, an intermediate of its other output (not counted twice)."""
    from transformers import DogeConfig, DogeForCausalLM

    torch.manual_seed(3)
    cfg = DogeConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, pad_token_id=0,
                     bos_token_id=0, eos_token_id=0, tie_word_embeddings=False, use_cache=False)
    cfg._attn_implementation = "eager"  # (sdpa on CPU refuses a mask that requires grad, in plain training too)
    model = DogeForCausalLM(cfg)
    with torch.no_grad():
        model.model.layers[0].self_attn.A.normal_()
    check_exact(model, token_rows(4), tmp_path, ga=2)


@pytest.mark.parametrize("ga", [1, 2])
def test_t5_relative_attention_bias_is_exact(tmp_path, ga):
    """T5's relative bias is computed once per batch and broadcast; exact per example where it is broadcast.
    With ga=1 the micro-batch has 4 examples and the sequences 4 tokens: T == B, where a size check would be fooled."""
    torch.manual_seed(4)
    model = tiny_t5()
    trainer = check_exact(model, token_rows(4, seq_len=4), tmp_path, ga=ga, dp_self_check=(ga == 1))
    assert any("relative_attention_bias" in n for n in trainer.clipping_engine.params)


def test_qwen2_moe_router_and_shared_expert_gate_on_flattened_tokens_are_exact(tmp_path):
    """Qwen2-MoE flattens the tokens to (B·T, d) before its router and `shared_expert_gate`: the Linear is reshaped
    per example, the router (no rule) is re-run on each example's T rows. (Experts: another helper's rule.)"""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(6)
    cfg = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
                         shared_expert_intermediate_size=12, num_experts=4, num_experts_per_tok=2, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, pad_token_id=0,
                         bos_token_id=0, eos_token_id=0, tie_word_embeddings=False, use_cache=False)
    cfg._experts_implementation = "eager"  # (grouped_mm has no float64 kernel)
    model = Qwen2MoeForCausalLM(cfg)
    for name, p in model.named_parameters():
        if ".experts." in name:
            p.requires_grad_(False)
    trainer = check_exact(model, token_rows(4), tmp_path, ga=2)
    assert {"model.layers.0.mlp.gate.weight", "model.layers.0.mlp.shared_expert_gate.weight"} <= set(
        trainer.clipping_engine.params)


def test_flattened_tokens_are_reshaped_per_example():
    """A Linear fed the micro-batch's tokens flattened to (B·T, d) (MoE style), example-major: exact per example."""

    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(3, 4)
            self.gate = nn.Linear(4, 2)

        def forward(self, x):
            h = self.inp(x)
            b, t, d = h.shape
            return self.gate(h.reshape(b * t, d)).reshape(b, t, 2)

    torch.manual_seed(5)
    model = Flat().double()
    norms, loop = engine_norms_and_loop(model, torch.randn(3, 5, 3, dtype=torch.float64))
    total = sum(norms.values())
    for i, grads in enumerate(loop):
        torch.testing.assert_close(total[i], sum(g.pow(2).sum() for g in grads.values()))


def test_sequence_first_input_is_exact_per_example():
    """A Linear applied to (T, B, d) (Longformer's sequence-first projections): the batch axis is proven at the first
    step and moved first for the rule, whatever T and B."""

    class SeqFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            return self.lin(x.transpose(0, 1)).transpose(0, 1)

    torch.manual_seed(8)
    model = SeqFirst().double()
    # T == B: a size check could not tell the axes apart
    norms, loop = engine_norms_and_loop(model, torch.randn(3, 3, 3, dtype=torch.float64))
    total = sum(norms.values())
    for i, grads in enumerate(loop):
        torch.testing.assert_close(total[i], sum(g.pow(2).sum() for g in grads.values()))


def test_fallback_output_with_a_later_example_axis_is_exact():
    """A module without a rule whose output holds the examples on axis 1 (like an LSTM's h_n)."""

    class ScaleSeqFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))

        def forward(self, x):
            return (x * self.w).transpose(0, 1)  # (T, B, d)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = ScaleSeqFirst()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            return self.lin(self.scale(x).transpose(0, 1).tanh())

    torch.manual_seed(9)
    model = Model().double()
    norms, loop = engine_norms_and_loop(model, torch.randn(3, 4, 3, dtype=torch.float64))
    for i, grads in enumerate(loop):
        torch.testing.assert_close(norms["scale.w"][i], grads["scale.w"].pow(2).sum())


def test_tiny_index_table_is_instantiated_not_ghost_normed():
    from hf_dp.clipping.engine import use_ghost_norm
    from hf_dp.clipping.layers import Use

    table = nn.Parameter(torch.zeros(8, 2))  # 8 buckets × 2 heads, looked up at T² = 256 positions
    small = Use(table, torch.zeros(2, 256, dtype=torch.long), torch.zeros(2, 256, 2), 8, "bias")
    assert not use_ghost_norm([small])
    vocab = nn.Parameter(torch.zeros(50000, 64))
    big = Use(vocab, torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, 64), 50000, "wte")
    assert use_ghost_norm([big])


# ---------------------------------------------------------------------------------------------- refusals
class ReadsChildWeight(nn.Module):
    """Uses ``lin.weight`` a second time outside ``lin``'s forward (as DeBERTa-v2 reads ``rel_embeddings.weight``)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x) + torch.nn.functional.linear(x.tanh(), self.lin.weight)


class LossToy(Toy):
    """``Toy`` with the model's own loss (mean cross-entropy over the batch: on a batch of one, the example's)."""

    def forward(self, x, labels=None):
        logits = self.head(self.body(x)).mean(1)
        return LossOut(logits, None if labels is None else torch.nn.functional.cross_entropy(logits, labels))


def test_use_outside_the_owning_forward_is_exact_by_the_enclosing_module(tmp_path, caplog):
    """``lin.weight`` used a second time by the parent's forward: the first-step check finds the escaped use, and the
    weight's per-example gradient is then computed by re-running the parent per example (the enclosing-module
    fallback), which the check then accepts; exact against the oracle, and said once in the log with its cost."""
    with caplog.at_level("WARNING", logger="hf_dp.clipping.engine"):
        check_exact(LossToy(ReadsChildWeight()), toy_rows(4), tmp_path, ga=1, per_example_loss=toy_loss,
                    dp_self_check=False)
    said = [r.getMessage() for r in caplog.records if "enclosing module of lin.weight" in r.getMessage()]
    assert len(said) == 1 and "body (ReadsChildWeight" in said[0] and "one extra forward and backward" in said[0]


class ReadsChildWeightAndMixes(ReadsChildWeight):
    """The same escaped use, in a forward that also mixes examples (a batch mean): no enclosing module can be re-run
    per example, so the use stays refused."""

    def forward(self, x):
        return super().forward(x) + self.lin.weight.sum() * x.mean(0, keepdim=True)


def test_use_outside_the_owning_forward_is_refused_when_no_enclosing_module_works(tmp_path):
    """The hooks-vs-autograd comparison is always on (dp_self_check=False does not turn it off); the enclosing module
    is tried, refused by its verification (it mixes examples), and the refusal names both causes."""
    with pytest.raises(UnsupportedLayerError, match=r"(?s)body\.lin\.weight \(owned by body\.lin \(Linear\)\).*"
                                                    r"a use outside the forward of the module that owns them.*"
                                                    r"re-running an enclosing module per example.*body "
                                                    r"\(ReadsChildWeightAndMixes\).*differs from its output on each "
                                                    r"example alone: it mixes examples"):
        train_toy(ReadsChildWeightAndMixes(), tmp_path, dp_self_check=False)


class RootReadsToo(Toy):
    """``lin.weight`` used by its parent's forward (enclosable) and again by the model's own forward (not: the model is
    never re-run per example)."""

    def forward(self, x, labels=None):
        return Out(self.head(self.body(x)).mean(1) * self.body.lin.weight.sum())


def test_enclosing_module_that_misses_a_use_is_refused(tmp_path):
    """After re-planning, the first-step check runs again on the new plan: the parent's fallback covers the parent's
    uses only, the model's own use of the weight still escapes, and there is no enclosing module left: refused
    (without the re-check, that use would be silently dropped)."""
    model = RootReadsToo(ReadsChildWeight()).double()
    trainer = DPTrainer(model=model, args=dp_args(tmp_path, 4, dp_self_check=False), train_dataset=toy_rows(4),
                        per_example_loss=toy_loss)
    with pytest.raises(UnsupportedLayerError, match=r"(?s)body\.lin\.weight \(owned by body\.lin \(Linear\)\).*"
                                                    r"a use outside the forward of the module that owns them"):
        trainer.train()


class DoubledLinear(nn.Linear):
    """A Linear subclass whose forward is not the parent's (the Linear rule's first-batch form check refuses it)."""

    def forward(self, x):
        return super().forward(x) * 2.0


def test_layer_that_fails_its_rules_form_check_is_exact_by_the_enclosing_module(tmp_path):
    trainer = check_exact(LossToy(nn.Sequential(DoubledLinear(3, 3), nn.Tanh())), toy_rows(4), tmp_path,
                          ga=1, per_example_loss=toy_loss, dp_self_check=False)
    assert set(trainer.clipping_engine._enclosure.values()) == {"body"}


class TableBias(nn.Module):
    """Swin's pattern: a table read with no input (its output has no per-example axis), added by the parent."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(3))

    def forward(self):
        return self.table


class TableBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = TableBias()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return torch.tanh(self.lin(x) * self.bias())


def test_batchless_module_output_in_repeated_blocks_is_exact_by_the_enclosing_blocks(tmp_path, monkeypatch):
    """The table's own fallback is refused (no per-example axis) at the first block; the re-plan moves every block's
    table to its block's fallback at once (one extra round of first-step checks, not one per block); exact."""
    rounds = []
    replan = ClippingEngine.replan
    monkeypatch.setattr(ClippingEngine, "replan", lambda self, names: rounds.append(names) or replan(self, names))
    trainer = check_exact(LossToy(nn.Sequential(TableBlock(), TableBlock())), toy_rows(4), tmp_path,
                          ga=1, per_example_loss=toy_loss, dp_self_check=False)
    assert sorted(trainer.clipping_engine._enclosure.values()) == ["body.0", "body.1"]
    assert len(rounds) == 1


class AttentionLike(nn.Module):
    """A module that reads its child's weight directly and applies dropout, as attention does."""

    def __init__(self, p: float = 0.0, attention_dropout: float = 0.0):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.drop = nn.Dropout(p)
        self.attention_dropout = attention_dropout

    def forward(self, x):
        h = torch.nn.functional.linear(x, self.lin.weight) + self.lin.bias
        h = torch.nn.functional.dropout(h, p=self.attention_dropout, training=self.training)
        return self.drop(h)


@pytest.mark.parametrize("kw,match", [(dict(p=0.5), r"body\.0\.drop \(p=0\.5\)"),
                                      (dict(attention_dropout=0.5), r"body\.0\.attention_dropout=0\.5")],
                         ids=["module", "functional"])
def test_enclosing_module_with_dropout_is_refused_in_training(tmp_path, kw, match):
    """The first-step checks run with dropout off, so the enclosing module's verification passes; in training its
    dropout is on, and a per-example re-run cannot reproduce the mask: refused at the first training forward (every
    fallback call checks), naming the dropout and what to set to 0."""
    body = AttentionLike(**kw)
    body.drop = nn.Identity() if "p" not in kw else body.drop
    with pytest.raises(UnsupportedLayerError, match=r"(?s)body\.0 \(AttentionLike\) is re-run per example.*"
                                                    rf"lin\.weight.*applies dropout \({match}.*"
                                                    r"Set that dropout probability to 0"):
        train_toy(nn.Sequential(body), tmp_path, dp_self_check=False)


class OwnParamDropout(nn.Module):
    """A parameter used directly (own: generic fallback), then dropout: ViT-embeddings style."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.dropout = nn.Dropout(0.5)

    def forward(self, x):
        return self.dropout(x * self.scale)


def test_fallback_module_with_dropout_is_refused_in_training(tmp_path):
    """Before dropout was checked on every call, the check ran once, in the first-step checks (dropout off), and
    training then re-ran the module with a different dropout mask: a silently wrong per-example gradient."""
    with pytest.raises(UnsupportedLayerError, match=r"body\.0 \(OwnParamDropout\) is re-run per example.*scale.*"
                                                    r"applies dropout \(body\.0\.dropout \(p=0\.5\)\)"):
        train_toy(nn.Sequential(OwnParamDropout(), nn.Linear(3, 3)), tmp_path, dp_self_check=False)


class ConfigDropout(ReadsChildWeight):
    """Dropout with a probability hf_dp cannot see or switch off (not a ``*dropout*`` attribute: read from a config
    object at forward time)."""

    def __init__(self):
        super().__init__()
        self.cfg = type("Cfg", (), {"p_drop": 0.5})()

    def forward(self, x):
        return torch.nn.functional.dropout(super().forward(x), p=self.cfg.p_drop, training=self.training)


def test_hidden_functional_dropout_is_refused_with_its_cause(tmp_path):
    """Caught by the comparison (both runs see the same random draws, but the hooked run re-runs the module under
    the fallback with other draws, so the re-run parameter differs) and by the enclosing module's verification: the
    refusal names randomness hf_dp cannot switch off (dropout read from the config) among its causes."""
    with pytest.raises(UnsupportedLayerError, match=r"(?s)body\.lin\.weight.*random operations hf_dp "
                                                    r"cannot switch off for this check \(dropout applied functionally"):
        train_toy(ConfigDropout(), tmp_path, dp_self_check=False)


class BatchlessBias(nn.Module):
    """A T5-style bias looked up with (T, T) ids (no batch axis) and broadcast over the batch, outside any
    broadcast point hf_dp knows. With T == B the rule's batch axis has the right size."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Embedding(7, 3)

    def forward(self, x):
        t = x.shape[1]
        rel = (torch.arange(t)[None, :] - torch.arange(t)[:, None]).clamp(0, 6)
        return x + self.bias(rel).mean(0)  # (T, 3), broadcast over the batch


def test_batchless_input_is_found_even_when_seq_len_equals_batch_size(tmp_path):
    """The first step proves batch axes: the (T, T) lookup has none although T == B, so the embedding's rule would
    split its gradient by position, not by example (their sum is the same: the hooks-vs-autograd check alone would not
    see it). Found, the table's per-example gradient comes from re-running its enclosing module per example: exact."""
    trainer = check_exact(LossToy(BatchlessBias()), toy_rows(4, seq_len=2), tmp_path, ga=2, per_example_loss=toy_loss,
                          dp_self_check=False)  # micro-batches of 2 examples of 2 positions
    engine = trainer.clipping_engine
    assert engine._enclosure == {id(trainer.model.body.bias.weight): "body"}


def test_deberta_v2_shared_relative_embeddings_pass_both_checks(tmp_path):
    """The relative embeddings (read directly, then a LayerNorm, once per batch) and the position projections applied
    to them get per-example gradients (engine: shared and mixing points); both run-time checks agree. Exactness against
    the oracle: tests/clipping/test_zoo.py (deberta_v3, deberta_v2_rel)."""
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    cfg = DebertaV2Config(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                          intermediate_size=24, max_position_embeddings=32, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, relative_attention=True, position_buckets=4,
                          pos_att_type=["p2c", "c2p"], num_labels=3, norm_rel_ebd="layer_norm")
    model = DebertaV2ForSequenceClassification(cfg).double()
    before = model.deberta.encoder.rel_embeddings.weight.detach().clone()
    trainer = DPTrainer(model=model, args=dp_args(tmp_path, 4, dp_self_check=True),
                        train_dataset=token_rows(4, num_labels=3))
    trainer.train()
    assert not torch.equal(before, model.deberta.encoder.rel_embeddings.weight.detach())


class MixesAcrossTheBatch(nn.Module):
    """A shared table projected inside a mixing method (DeBERTa's method names) whose result sums over the batch:
    its rows are not the examples'."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(5, 3)
        self.proj = nn.Linear(3, 3)

    def get_rel_embedding(self):
        return self.table.weight

    def disentangled_attention_bias(self, x, rel):
        return (x.sum(0, keepdim=True) @ self.proj(rel).t()).expand(x.shape[0], -1, -1)  # (B, T, 5), the same rows

    def forward(self, x):
        return x + self.disentangled_attention_bias(x, self.get_rel_embedding())[..., :3]


class MixingPooled(MixesAcrossTheBatch):
    def disentangled_attention_bias(self, x, rel):
        return x.sum(0) @ self.proj(rel).t()  # (T, 5): no example axis at all

    def forward(self, x):
        return x + self.disentangled_attention_bias(x, self.get_rel_embedding())[..., :3]


def test_mixing_point_without_an_example_axis_is_refused_at_run_time():
    """The run-time check behind the first-step proof: a result whose first axis is not a multiple of the micro-batch
    size is refused when recording (here without the first-step check)."""
    model = Toy(MixingPooled()).double()
    engine = ClippingEngine(model)
    x = torch.randn(2, 3, 3, dtype=torch.float64)
    with pytest.raises(UnsupportedLayerError, match=r"MixingPooled\.disentangled_attention_bias returned shape \(3, "):
        with engine.record(2):
            model.body(x).sum().backward()


class SharedUsedElsewhere(MixesAcrossTheBatch):
    """The shared table also reaches the output outside the mixing method (broadcast over the batch)."""

    def disentangled_attention_bias(self, x, rel):
        return x @ self.proj(rel).t()  # (B, T, 5): per example

    def forward(self, x):
        rel = self.get_rel_embedding()
        return x + self.disentangled_attention_bias(x, rel)[..., :3] + rel[:3].tanh().sum(0)


def test_shared_tensor_used_outside_the_mixing_methods_is_refused(tmp_path):
    with pytest.raises(UnsupportedLayerError, match=r"get_rel_embedding: its result reaches the loss other than"):
        train_toy(SharedUsedElsewhere(), tmp_path, dp_self_check=False)


def test_mixing_point_whose_rows_are_not_the_examples_is_refused(tmp_path):
    with pytest.raises(UnsupportedLayerError, match=r"body\.disentangled_attention_bias .*does not hold the examples"):
        train_toy(MixesAcrossTheBatch(), tmp_path, dp_self_check=False)


class CentreInTraining(nn.Module):
    """Subtracts the batch mean in train mode only (a batch-statistics layer without parameters or buffers)."""

    def forward(self, x):
        return x - x.mean(0, keepdim=True) if self.training else x


def test_mixing_in_train_mode_is_caught_with_one_example_micro_batches(tmp_path):
    """Hole 6: micro-batches of one example prove nothing; the check collates two training examples, and runs in
    train mode too (the model mixes examples only there)."""
    body = nn.Sequential(nn.Linear(3, 3), CentreInTraining())
    with pytest.raises(UnsupportedLayerError, match=r"micro-batch of 2 .*\(train mode, dropout off\)"):
        train_toy(body, tmp_path, n=2, ga=2)


def test_frozen_batch_norm_is_refused_with_a_true_message(tmp_path):
    class Norm(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x):
            return self.bn(x.transpose(1, 2)).transpose(1, 2)

    body = nn.Sequential(nn.Linear(3, 4), Norm(), nn.Linear(4, 3))
    body[1].requires_grad_(False)  # freezing does not stop batch statistics
    with pytest.raises(UnsupportedLayerError, match=r"statistics over the batch: body\.1\.bn \(BatchNorm1d\).*"
                                                    r"freezing its parameters changes neither"):
        ClippingEngine(Toy(body))


class CountsCalls(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen += x.detach().sum()  # a statistic of the private data, saved in the checkpoint
        return x


def test_buffer_written_during_a_step_is_refused(tmp_path):
    with pytest.raises(UnsupportedLayerError, match=r"buffers changed during a DP step: body\.1\.seen"):
        train_toy(nn.Sequential(nn.Linear(3, 3), CountsCalls()), tmp_path, dp_self_check=False)


class MixingScale(nn.Module):
    """A trainable parameter (no rule: generic fallback) in a forward that mixes examples."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x + self.w * x.mean(0, keepdim=True)


def test_fallback_refuses_a_module_that_mixes_examples(tmp_path):
    with pytest.raises(UnsupportedLayerError, match=r"body\.1 \(MixingScale\).*differs from its output on each "
                                                    r"example alone: it mixes examples"):
        train_toy(nn.Sequential(nn.Linear(3, 3), MixingScale()), tmp_path, dp_self_check=False)


def test_statically_refused_parameters():
    class LinearWithTemperature(nn.Linear):  # the parent's forward, but a parameter no rule knows
        def __init__(self):
            super().__init__(3, 3)
            self.temperature = nn.Parameter(torch.ones(()))

    # enclose2: a parameter its rule does not cover is no longer refused statically: the layer gets a side fallback
    # for it (tests/clipping/test_enclosing_fallback.py), verified at the first step
    engine = ClippingEngine(Toy(LinearWithTemperature()))
    assert [fb.param_names for fb in engine._fallbacks.values()] == [("temperature",)]
    model = Toy(nn.Identity())
    model.register_parameter("scale", nn.Parameter(torch.ones(())))
    with pytest.raises(UnsupportedLayerError, match=r"scale \(Toy: parameters of the model itself"):
        ClippingEngine(model)


def test_per_layer_clipping_with_broadcast_bias(tmp_path):
    """Clipping fused into the backward pass (per layer): fallback modules and the T5 broadcast point keep the
    groups. pending counts right. Oracle: each group's slice of each example's gradient clipped to C_k."""
    torch.manual_seed(7)
    model = tiny_t5().double()
    model.shared.requires_grad_(False)  # keep the test small: the relative biases and the attention/FF layers
    rows = token_rows(4, seq_len=4)
    grads = per_example_grads(model, rows)
    args = dp_args(tmp_path, 2, ga=2, max_norm=0.05, clipping="per_layer")
    trainer = DPTrainer(model=model, args=args, train_dataset=rows)
    groups = trainer.group_clipper.groups
    thresholds = trainer.group_clipper.thresholds.tolist()
    expected = {n: torch.zeros_like(g) for n, g in grads[0].items()}
    for d in grads:
        for group, c_k in zip(groups, thresholds):
            norm = float(torch.sqrt(sum(d[n].pow(2).sum() for n in group.params)))
            for n in group.params:
                expected[n] += min(1.0, c_k / (norm + 1e-6)) * d[n]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    scale = max(float(t.abs().max()) for t in expected.values()) / 4
    for n, p in model.named_parameters():
        target = expected[n] / 4 if n in expected else torch.zeros_like(p)
        torch.testing.assert_close(before[n] - p.detach(), target, rtol=1e-5, atol=1e-6 * scale,
                                   msg=lambda m, n=n: f"{n}: {m}")


def test_first_step_checks_turn_dropout_off_inside_attention(tmp_path):
    """BERT's sdpa attention applies `self.dropout.p if self.training` itself: the first-step checks must run with
    every dropout probability at 0 (not only nn.Dropout modules in eval mode), or hooks-vs-autograd compares two
    different dropout draws and refuses an ordinary model (here: the classifier on a frozen encoder, dropout 0.1)."""

    from helpers import cls_dataset
    from transformers import BertConfig, BertForSequenceClassification

    from hf_dp import DPTrainer

    cfg = BertConfig(vocab_size=61, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
                     max_position_embeddings=32, num_labels=2, pad_token_id=0, hidden_dropout_prob=0.3,
                     attention_probs_dropout_prob=0.3)
    for seed in range(3):
        torch.manual_seed(seed)
        model = BertForSequenceClassification(cfg)
        for n, p in model.named_parameters():
            p.requires_grad_(n.startswith("classifier"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            args = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=0.0, per_device_train_batch_size=4,
                                       max_steps=1, use_cpu=True, report_to="none", save_strategy="no",
                                       disable_tqdm=True, dp_seed=seed)
            DPTrainer(model=model, args=args, train_dataset=cls_dataset(8, 2, seed=seed)).train()
        assert model.bert.encoder.layer[0].attention.self.dropout.p == 0.3  # restored
