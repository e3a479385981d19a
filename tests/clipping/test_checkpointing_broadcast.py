"""Broadcast points under activation checkpointing (issue #24, item 4).

A broadcast point (``hf_dp/clipping/broadcast.py``) computes a tensor once per batch, with no batch axis, that every
example uses: T5's relative position bias (computed in the first block and returned to the others), DeBERTa-v2's
relative embeddings (computed outside the layers, projected inside each). Under reentrant checkpointing a checkpointed
block's first forward runs without gradients and is re-run in the backward, where a backward pass of its own
differentiates it. Oracle: the model's own loss on a batch of one, float64, autograd, no checkpointing (σ = 0, q = 1,
SGD with lr = 1: the update is minus the released gradient), via ``helpers.check_exact``.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    VOCAB,
    CheckpointedBlocks,
    FallbackGate,
    check_exact,
    cls_dataset,
    dp_args,
    loop_grads,
    seq2seq_dataset,
)

from hf_dp import DPTrainer
from hf_dp.clipping.engine import ClippingEngine, UnsupportedLayerError
from hf_dp.clipping.modes import build_groups

CKPT = ["nonreentrant", "reentrant"]


def _ckpt(reentrant: str) -> dict:
    return dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": reentrant == "reentrant"})


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=24, num_layers=2, num_decoder_layers=2, num_heads=2,
                   dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return T5ForConditionalGeneration(cfg)


class _Calls:
    """Forwards of the model and of a block's attention (transformers checkpoints the block's ``forward``, so the
    attention's hooks run again in the re-run): more attention calls than model calls means the blocks were re-run."""

    def __init__(self, model, inner):
        self.model = self.inner = 0
        model.register_forward_pre_hook(lambda *_: setattr(self, "model", self.model + 1))
        inner.register_forward_pre_hook(lambda *_: setattr(self, "inner", self.inner + 1))


@pytest.mark.parametrize("ckpt", CKPT)
@pytest.mark.parametrize("clipping", ["flat", "flat_two_pass", "per_layer"])
def test_t5_relative_bias_exact_under_checkpointing(tmp_path, clipping, ckpt):
    """T5's bias is computed in block 0 and returned to the next blocks. With reentrant checkpointing, block 0's first
    forward (no gradients) returned the (1, H, T, T) bias and its re-run the bias expanded per example, (B, H, T, T):
    torch's checkpoint failed on the shapes at the first step. The point now returns the expanded bias in both."""
    torch.manual_seed(0)
    model = _t5()
    calls = _Calls(model, model.encoder.block[1].layer[0].SelfAttention)
    # flat: book-keeping (exact to round-off) or two passes (pass 2 is T5's own backward: its layer norms compute
    # their variance in float32 inside the float64 model, hence 1e-5)
    passes = {"flat": dict(flat_clipping_passes="one"), "flat_two_pass": dict(flat_clipping_passes="two", rtol=1e-5)}
    check_exact(model, seq2seq_dataset(4, seed=0), tmp_path, clipping=clipping.removesuffix("_two_pass"),
                **passes.get(clipping, {}), **_ckpt(ckpt))
    assert calls.inner > calls.model  # the blocks were re-run in the backward


@pytest.mark.parametrize("ckpt", CKPT)
def test_t5_bias_group_is_clipped_once_inside_the_backward(ckpt):
    """Per-layer clipping fused into the backward: every call inside a broadcast point is expected once, in the first
    forward (a re-run's call is not expected again), so the bias's group is clipped as soon as its one use arrives,
    inside the backward, not deferred to the end of the step by a use that never comes (both checkpointing kinds
    expected it twice before)."""
    torch.manual_seed(1)
    model = _t5().double()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ckpt == "reentrant"})
    model.train()
    ids = torch.randint(2, VOCAB, (3, 5), generator=torch.Generator().manual_seed(0))
    engine = ClippingEngine(model)
    groups = [g.params for g in build_groups(engine, "per_layer")]
    clipped, after = [], []

    def handler(k, _norms):
        (after if done else clipped).append(k)
        return torch.ones(3, dtype=torch.float64)

    engine.set_fused_groups(groups, handler)
    done = False
    with engine.record(3):
        model(input_ids=ids, labels=ids).logits.sum().backward()
        done = True
        engine.finish_fused()
    bias = [k for k, names in enumerate(groups) if any("relative_attention_bias" in n for n in names)]
    assert len(bias) == 2  # encoder and decoder
    for k in bias:
        assert clipped.count(k) == 1 and k not in after, (k, clipped, after)


def _deberta(**kw):
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    cfg = DebertaV2Config(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=24, max_position_embeddings=32, pad_token_id=0, num_labels=3,
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pooler_dropout=0.0,
                          relative_attention=True, pos_att_type=["p2c", "c2p"], initializer_range=0.5, **kw)
    return DebertaV2ForSequenceClassification(cfg)


def test_deberta_shared_relative_embeddings_refused_under_reentrant_checkpointing(tmp_path):
    """DeBERTa-v3's relative embeddings (``rel_embeddings.weight``, then a LayerNorm) are computed once per batch by
    the encoder, outside the checkpointed layers, and passed to each layer by keyword. Reentrant checkpointing re-runs
    each layer in the backward under a backward pass of its own, so their gradient arrives in one part per layer
    (hf_dp's hook fired twice, a RuntimeError in the backward). Refused in the first forward, naming the cause and
    ``use_reentrant=False``; nothing is released."""
    torch.manual_seed(2)
    model = _deberta(position_buckets=4, max_relative_positions=8, share_att_key=True, norm_rel_ebd="layer_norm",
                     position_biased_input=False).double()
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    trainer = DPTrainer(model=model, args=dp_args(tmp_path, 2, 2, 1.0, **_ckpt("reentrant")),
                        train_dataset=cls_dataset(4, num_labels=3, seq_len=6))
    with pytest.raises(UnsupportedLayerError, match=r"get_rel_embedding.*use_reentrant=True.*rel_embeddings\.weight"
                       r".*'use_reentrant': False"):
        trainer.train()
    assert trainer.accountant.steps == 0
    for k, p in model.named_parameters():
        assert torch.equal(p.detach(), before[k]), k


@pytest.mark.parametrize("ckpt", CKPT)
def test_deberta_position_projections_exact_under_checkpointing(tmp_path, ckpt):
    """With the relative embeddings frozen, the layers' position projections (``pos_key_proj``, ``pos_query_proj``:
    mixing points, batch-less inside each layer) are recorded by each layer's own re-run: exact under both kinds. The
    classification loss is computed in float32 (``.float()``), hence the tolerance."""
    torch.manual_seed(3)
    model = _deberta(max_relative_positions=4, share_att_key=False)
    model.deberta.encoder.rel_embeddings.requires_grad_(False)
    calls = _Calls(model, model.deberta.encoder.layer[1].attention.self)
    check_exact(model, cls_dataset(4, num_labels=3, seq_len=6), tmp_path, clipping="per_layer", rtol=2e-4,
                **_ckpt(ckpt))
    assert calls.inner > calls.model


class _ScaledBlocks(CheckpointedBlocks):
    """Two blocks under the user's own ``torch.utils.checkpoint`` (``reentrant``: ``None`` for none), each with a
    fallback module whose input is a fresh activation of the block."""

    def __init__(self, reentrant: bool | None):
        super().__init__(torch.nn.ModuleList(torch.nn.ModuleDict(
            {"a": torch.nn.Linear(8, 8), "scale": FallbackGate()}) for _ in range(2)), reentrant)

    def block(self, k: int, h: torch.Tensor) -> torch.Tensor:
        m = self.blocks[k]
        return h + m["scale"](m["a"](h))


@pytest.mark.parametrize("checkpointing", ["off", "nonreentrant", "reentrant"])
def test_fallback_inputs_are_the_recomputed_ones(checkpointing):
    """Memory regression (a spy, not a measurement): the generic fallback's re-run per example needs the module's
    inputs in the backward. They are saved tensors of the graph (``checkpointing.keep_inputs``), so with checkpointing
    none of the first forward's survives the forward (they were kept in a closure, which undid the checkpoint), while
    without it autograd keeps them, as it keeps every activation. Counted by the storages of the fallback module's
    inputs (finalizers: alive while any tensor on them is). The step stays exact against the per-example loop."""
    import weakref

    torch.manual_seed(12)
    model = _ScaledBlocks(None).double()
    x = torch.randn(4, 5, 3, dtype=torch.float64)
    grads = loop_grads(model, list(x), lambda y: y)  # each example alone, no checkpointing
    model.reentrant = None if checkpointing == "off" else checkpointing == "reentrant"
    engine = ClippingEngine(model)
    engine.first_step_check(lambda sl: model(x[sl]), 4)
    live: set = set()

    def track(_mod, args):
        if not torch.is_grad_enabled() or torch._C._functorch.is_functorch_wrapped_tensor(args[0]):
            return  # the first forward of reentrant checkpointing; the fallback's own re-run under vmap
        key = object()
        live.add(key)
        weakref.finalize(args[0].untyped_storage(), live.discard, key)

    for block in model.blocks:
        block["scale"].register_forward_pre_hook(track)
    with engine.record(4):
        losses = model(x)
        after_forward = len(live)
        losses.sum().backward()
    assert after_forward == (2 if checkpointing == "off" else 0)
    norms_sq = engine.per_example_norms_sq()
    for n in engine.params:
        expected = torch.stack([g[n].pow(2).sum() for g in grads])
        torch.testing.assert_close(norms_sq[n], expected, rtol=1e-10, atol=1e-12, msg=n)
    factors = torch.tensor([0.3, 1.0, 0.7, 0.5], dtype=torch.float64)
    engine.accumulate_clipped(factors)
    for n in engine.params:
        expected = sum(float(c) * g[n] for c, g in zip(factors, grads))
        torch.testing.assert_close(engine.summed_grads[n], expected, rtol=1e-10, atol=1e-12, msg=n)


class _GatedNorm(torch.nn.Module):
    """A gated normalisation ``w ⊙ x/‖x‖ ⊙ silu(gate)`` called with ``gate=None``: its affine rule records every
    input of the call (``Rule.all_inputs``), ``None`` among them."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        y = x / x.norm(dim=-1, keepdim=True) * self.weight
        return y if gate is None else y * torch.nn.functional.silu(gate)


def test_a_none_input_of_a_recorded_call_stays_none():
    """A ruled call's inputs are saved in the graph (``checkpointing.keep_input``): a ``None`` among them was taken
    for a saved tensor in the backward (StopIteration). Exact against the per-example loop."""
    from helpers import check_engine

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.norm, self.b = torch.nn.Linear(3, 4), _GatedNorm(), torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.b(self.norm(self.a(x), None))

    torch.manual_seed(13)
    check_engine(Net(), torch.randn(3, 5, 3))


@pytest.mark.parametrize("checkpointing", ["off", "nonreentrant", "reentrant"])
def test_mixing_point_results_are_not_held_from_the_forward(checkpointing):
    """Memory regression (a spy): a mixing point's result (DeBERTa's position scores, ``B·H × T × 2P`` per layer) is
    where its batched product starts in the backward; the point's hook holds the result's gradient edge, not the
    tensor, so no result of the forward is alive after it (the hook's closure kept one per layer, with or without
    checkpointing, where the model itself frees them). Counted by the storages of ``disentangled_attention_bias``'s
    results; per-example norms exact against the loop over single examples."""
    import weakref

    torch.manual_seed(14)
    model = _deberta(max_relative_positions=4, share_att_key=False).double()
    model.deberta.encoder.rel_embeddings.requires_grad_(False)
    ids = torch.randint(2, VOCAB, (4, 6), generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 1, 2, 1])

    def losses(sl=slice(None)):
        logits = model(input_ids=ids[sl]).logits
        return torch.nn.functional.cross_entropy(logits, labels[sl], reduction="none")

    model.train()
    grads = []
    for i in range(4):
        model.zero_grad()
        losses(slice(i, i + 1)).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    model.zero_grad()
    if checkpointing != "off":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing ==
                                                                           "reentrant"})
    live: set = set()
    for layer in model.deberta.encoder.layer:
        attn = layer.attention.self
        orig = attn.disentangled_attention_bias

        def spy(*args, orig=orig, **kwargs):
            out = orig(*args, **kwargs)
            if torch.is_grad_enabled():
                key = object()
                live.add(key)
                weakref.finalize(out.untyped_storage(), live.discard, key)
            return out

        attn.disentangled_attention_bias = spy
    engine = ClippingEngine(model)
    engine.first_step_check(losses, 4)
    live.clear()
    with engine.record(4):
        out = losses()
        after_forward = len(live)
        out.sum().backward()
    assert after_forward == 0
    norms_sq = engine.per_example_norms_sq()
    for n in engine.params:
        expected = torch.stack([g[n].pow(2).sum() if n in g else torch.zeros((), dtype=torch.float64) for g in grads])
        torch.testing.assert_close(norms_sq.get(n, torch.zeros_like(expected)), expected, rtol=1e-8, atol=1e-12,
                                   msg=n)


class _Weighted(torch.nn.Module):
    """A layer without a rule (the generic fallback computes its per-example gradient by re-running it)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=torch.float64))

    def forward(self, h):
        return h * self.weight


class _InPlaceAfter(torch.nn.Module):
    """``h`` goes into a layer, then is modified in place: the layer's recorded input is no longer what it saw."""

    def __init__(self, fallback: bool):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3).double()
        self.inner = _Weighted() if fallback else torch.nn.Linear(3, 3).double()

    def forward(self, x):
        h = self.lin(x)
        y = self.inner(h)
        h.mul_(2.0)
        return y + h


@pytest.mark.parametrize("fallback", [True, False], ids=["fallback", "ruled"])
def test_an_input_modified_in_place_after_the_call_is_refused_by_name(tmp_path, fallback):
    """The recorded input is a saved tensor of the graph: autograd's version check sees the in-place change, and hf_dp
    refuses with the layer's name and the way out (not autograd's message), before anything is released."""
    from helpers import train_toy

    with pytest.raises(UnsupportedLayerError, match="inner.*modified in place after the call"):
        train_toy(_InPlaceAfter(fallback), tmp_path)
