"""Issue 13, the enclosing-module fallback at work where a rule sees part of a layer, or the examples are a number.

* A ruled layer with a trainable parameter its rule does not cover (T5Gemma2's ``eoi_embedding`` next to the embedding
  weight, Inkling's router ``global_scale`` next to the router weight): that parameter gets a *side fallback* (the
  layer itself re-run per example for it; the rule still records the others), or, if the layer cannot be re-run per
  example, an enclosing module's fallback; refused, with its true cause, when neither verifies.
* A module given the micro-batch size as a number (Perceiver's ``latents.expand(batch_size, -1, -1)``) and an
  embedding looked up with ``(T,)`` ids broadcast over a ``(B, T, d)`` input (Perceiver's text position embeddings).

Exact cases against the float64 oracle of ``helpers.check_exact`` (σ = 0, q = 1, the model's own loss on a batch
of one), flat and per-layer.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import VOCAB, LossOut, Rows, cls_dataset, dp_args, train_toy
from helpers import check_exact as exact
from torch import nn

from hf_dp import DPTrainer, UnsupportedLayerError

V, D, T = 11, 4, 5


def id_rows(n: int = 4, eoi: int | None = None) -> Rows:
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        ids = torch.randint(0, V, (T,), generator=g)
        if eoi is not None and i % 2 == 0:
            ids[-1] = eoi
        rows.append({"input_ids": ids, "labels": torch.tensor(i % 2)})
    return Rows(rows)


def ce_loss(outputs, labels):
    return F.cross_entropy(outputs.logits, labels, reduction="none")


def check_exact(model: nn.Module, rows: Rows, tmp_path, clipping: str = "flat") -> DPTrainer:
    """``helpers.check_exact`` for a plain module with ``ce_loss``, without the optional self-check (coverage must
    not depend on it): one DP step over the 4 rows (σ = 0, q = 1, two micro-batches of two) equals the oracle."""
    return exact(model, rows, tmp_path, clipping, per_example_loss=ce_loss, dp_self_check=False)


class IdModel(nn.Module):
    """ids (B, T) -> ``embed`` -> ``body`` (B, T, D) -> mean -> logits (B, 2); its own loss: mean cross-entropy."""

    def __init__(self, embed: nn.Module, body: nn.Module | None = None):
        super().__init__()
        self.embed = embed
        self.body = body if body is not None else nn.Identity()
        self.head = nn.Linear(D, 2)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.body(self.embed(input_ids))).mean(1)
        return LossOut(logits, None if labels is None else F.cross_entropy(logits, labels))


# ------------------------------------------------------------------------- parameters a layer's rule does not cover
class EmbeddingWithExtra(nn.Embedding):
    """An embedding subclass with an extra vector put at one token (T5Gemma2's ``eoi_embedding``), functionally."""

    def __init__(self, eoi: int = 3):
        super().__init__(V, D)
        self.eoi = eoi
        self.extra = nn.Parameter(torch.randn(D))
        self.scale = 2.0

    def forward(self, ids):
        return torch.where((ids == self.eoi).unsqueeze(-1), self.extra, super().forward(ids) * self.scale)


class EmbeddingWithMaskedWrite(EmbeddingWithExtra):
    """The same, written as T5Gemma2 does: an in-place write through a boolean mask (which torch.func.vmap cannot
    batch as such: the fallback's re-run writes it with torch.where)."""

    def forward(self, ids):
        out = super(EmbeddingWithExtra, self).forward(ids) * self.scale
        out[ids == self.eoi] = self.extra
        return out


class EmbeddingWithBranch(EmbeddingWithExtra):
    """The extra vector added under data-dependent control flow, which no per-example re-run under vmap can follow."""

    def forward(self, ids):
        out = super(EmbeddingWithExtra, self).forward(ids)
        if bool((ids == self.eoi).any()):
            out = out + self.extra
        return out


class ScaledRouter(nn.Module):
    """A top-k router with a trainable scale on the routing weights (Inkling's ``global_scale``); it flattens the
    examples' tokens to ``(B·T, D)`` inside its forward."""

    def __init__(self, num_experts: int = 3, top_k: int = 2):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.weight = nn.Parameter(torch.randn(num_experts, D))
        self.global_scale = nn.Parameter(torch.ones(1) * 1.5)

    def forward(self, hidden):
        logits = F.linear(hidden.reshape(-1, D), self.weight)
        top, idx = logits.topk(self.top_k, dim=-1)
        return logits, top.softmax(-1) * self.global_scale, idx


class RoutedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = ScaledRouter()
        self.up = nn.Linear(D, D)

    def forward(self, x):
        _, w, _ = self.router(x)
        return x + self.up(x) * w.sum(-1).view(*x.shape[:-1], 1)


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_embedding_subclass_with_an_extra_parameter_is_exact(tmp_path, clipping, caplog):
    """The embedding rule records ``weight``; ``extra`` (which the rule does not cover) gets the side fallback: the
    embedding re-run per example for it alone. Exact (was refused at construction); said once in the log."""
    model = IdModel(EmbeddingWithExtra(), nn.Linear(D, D))
    with caplog.at_level("WARNING", logger="hf_dp.clipping.engine"):
        trainer = check_exact(model, id_rows(eoi=3), tmp_path, clipping)
    said = [r.getMessage() for r in caplog.records if "embed (EmbeddingWithExtra: extra" in r.getMessage()]
    assert len(said) == 1 and "not covered by its 'embedding_calls' rule" in said[0]
    if clipping == "per_layer":  # one group for the layer: its rule's weight and its side fallback's extra
        assert ["embed.weight", "embed.extra"] in [g.params for g in trainer.group_clipper.groups]


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_router_scale_on_flattened_tokens_is_exact(tmp_path, clipping):
    """The router rule records ``weight``; ``global_scale`` gets the side fallback, whose outputs hold the examples'
    tokens flattened (``(B·T, k)`` rows, example-major: proven against the router run on the first example alone)."""
    check_exact(IdModel(nn.Embedding(V, D), RoutedBlock()), id_rows(), tmp_path, clipping)


def test_extra_parameter_written_through_a_boolean_mask_is_exact(tmp_path):
    """T5Gemma2's pattern (``out[ids == eoi] = eoi_embedding``): torch.func.vmap cannot batch a boolean-mask write
    (data-dependent shape); the fallback's re-run writes it as ``torch.where`` (same values and gradients)."""
    check_exact(IdModel(EmbeddingWithMaskedWrite(), nn.Linear(D, D)), id_rows(eoi=3), tmp_path)


def test_uncovered_parameter_whose_layer_cannot_be_rerun_is_refused_with_its_cause(tmp_path):
    """Data-dependent control flow: neither the layer nor an enclosing module can be re-run per example under vmap;
    the refusal names the parameter, the rule that does not cover it, and the failed re-run."""
    model = IdModel(EmbeddingWithBranch(), nn.Linear(D, D)).double()
    trainer = DPTrainer(model=model, args=dp_args(tmp_path, 4, dp_self_check=False), train_dataset=id_rows(eoi=3),
                        per_example_loss=ce_loss)
    with pytest.raises(UnsupportedLayerError, match=r"(?s)embed \(EmbeddingWithBranch\) owns trainable "
                                                    r"parameters \(extra\) that its 'embedding_calls' rule does not "
                                                    r"cover, and re-running it .* under torch\.func\.vmap failed.*"
                                                    r"data-dependent control flow"):
        trainer.train()


class MixingExtra(nn.Embedding):
    """An extra parameter used with a batch statistic: no module can be re-run per example."""

    def __init__(self):
        super().__init__(V, D)
        self.extra = nn.Parameter(torch.randn(D))

    def forward(self, ids):
        out = super().forward(ids)
        return out + self.extra * out.mean(0, keepdim=True)


def test_uncovered_parameter_of_a_mixing_layer_is_refused_after_trying_the_enclosing_module(tmp_path):
    """The side fallback's verification finds the layer mixes examples; the enclosing module (``embed``, a Sequential)
    is tried and mixes them too; the model itself is never re-run, so the refusal stands, naming both attempts."""
    model = IdModel(nn.Sequential(MixingExtra()), nn.Linear(D, D)).double()
    trainer = DPTrainer(model=model, args=dp_args(tmp_path, 4, dp_self_check=False), train_dataset=id_rows(),
                        per_example_loss=ce_loss)
    with pytest.raises(UnsupportedLayerError, match=r"(?s)embed\.0 \(MixingExtra\) owns trainable parameters "
                                                    r"\(extra\) that its 'embedding_calls' rule does not cover.*"
                                                    r"differs from its output on each example alone: it mixes.*"
                                                    r"re-running an enclosing module per example.*embed \(Sequential\)"
                                                    r".*\(0\.extra\).*differs from its output on each example alone"):
        trainer.train()


# ------------------------------------------------------------------ examples given as a number; batch-less position ids
class Latents(nn.Module):
    """Perceiver's ``PerceiverEmbeddings``: ``latents.expand(batch_size, -1, -1)``, called with the batch size."""

    def __init__(self, n: int = 2):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(n, D))

    def forward(self, batch_size: int):
        return self.latents.expand(batch_size, -1, -1)


class TextPreprocessor(nn.Module):
    """Perceiver's text preprocessor: ``embeddings(ids) + position_embeddings(arange(T))`` with ``(T,)`` ids."""

    def __init__(self):
        super().__init__()
        self.embeddings = nn.Embedding(V, D)
        self.position_embeddings = nn.Embedding(T, D)

    def forward(self, ids):
        return self.embeddings(ids) + self.position_embeddings(torch.arange(ids.shape[1], device=ids.device))


class PerceiverLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = TextPreprocessor()
        self.latents = Latents()
        self.cross = nn.Linear(D, D)
        self.head = nn.Linear(D, 2)

    def forward(self, input_ids, labels=None):
        x = self.pre(input_ids)
        lat = self.latents(x.shape[0])
        h = torch.cat([lat, self.cross(x)], 1).tanh()
        logits = self.head(h).mean(1)
        return LossOut(logits, None if labels is None else F.cross_entropy(logits, labels))


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_batch_size_number_and_batchless_position_ids_are_exact(tmp_path, clipping):
    """``latents`` is re-run per example with the number 1 (the probe proved the number is the micro-batch size: 2
    for two examples, 1 for one); the position embedding, looked up once with ``(T,)`` ids, is computed by its
    enclosing preprocessor re-run per example. Both were refused (the first made the re-plan climb to a module that
    cannot be re-run)."""
    check_exact(PerceiverLike(), id_rows(), tmp_path, clipping)


class CountArg(nn.Module):
    """Called with a number that is *not* the batch size (a fixed count that equals the micro-batch size of 2)."""

    def __init__(self):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(1, D))

    def forward(self, x, n: int):
        return x + self.latents.expand(n, -1, -1).sum(0, keepdim=True)


class CountModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.count = CountArg()
        self.head = nn.Linear(D, 2)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.count(self.embed(input_ids), 2)).mean(1)
        return LossOut(logits, None if labels is None else F.cross_entropy(logits, labels))


def test_a_number_equal_to_the_batch_size_is_not_taken_for_it_unless_proven(tmp_path):
    """The number 2 is the same for one example and for two, so it is not the batch size: the module keeps it, and
    stays exact (taking it for the batch size would re-run the module with 1, halving ``latents``' gradient)."""
    check_exact(CountModel(), id_rows(), tmp_path)


# ---------------------------------------------------------------------------------------- random layer skipping
class DropPathScale(nn.Module):
    """A parameter used directly (generic fallback) in a residual branch dropped at random per example in training
    (stochastic depth: HF's ``DropPath`` modules keep ``drop_prob``, a float attribute not named ``*dropout*``)."""

    def __init__(self, drop_prob: float = 0.5):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.drop_prob = drop_prob

    def forward(self, x):
        branch = x * self.scale
        if self.training and self.drop_prob > 0:
            keep = (torch.rand(x.shape[0], 1, 1, dtype=x.dtype) >= self.drop_prob).to(x.dtype)
            branch = branch * keep / (1 - self.drop_prob)
        return x + branch


def test_fallback_module_with_drop_path_is_refused_in_training(tmp_path):
    """The per-example re-run draws its own mask (vmap randomness="different"), not the batch's: its gradient would not
    be the example's. The first-step checks run with the drop probability at 0, like dropout (LayerDrop's
    ``layerdrop`` too), so the verification passes; every training call is checked, and refused naming the
    attribute (before, the verification ran with the drop on and refused with "it mixes examples, or it is random")."""
    with pytest.raises(UnsupportedLayerError, match=r"body\.0 \(DropPathScale\) is re-run per example.*scale.*"
                                                    r"applies dropout \(body\.0\.drop_prob=0\.5\)"):
        train_toy(nn.Sequential(DropPathScale(), nn.Linear(3, 3)), tmp_path, dp_self_check=False)


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_perceiver_text_classification_is_exact(tmp_path, clipping):
    """The HF model: text position embeddings looked up with ``(T,)`` ids (enclosed by the preprocessor), ``latents``
    expanded to the batch size given as a number, the decoder's trainable query (the same); was refused."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.PerceiverConfig(num_latents=4, d_latents=8, d_model=16, num_blocks=1, num_self_attends_per_block=1,
                             num_self_attention_heads=2, num_cross_attention_heads=2, vocab_size=VOCAB,
                             max_position_embeddings=8, attention_probs_dropout_prob=0.0, num_labels=3)
    exact(tf.PerceiverForSequenceClassification(cfg), cls_dataset(4, num_labels=3, seq_len=8), tmp_path,
                    clipping=clipping)


def test_fallback_log_says_repeated_blocks_once(tmp_path, caplog):
    """Three blocks each with an extra-parameter embedding: the log line names the pattern once with its count
    (``blocks.* ... × 3``), not three copies of the same description."""

    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(EmbeddingWithExtra() for _ in range(3))
            self.head = nn.Linear(D, 2)

        def forward(self, input_ids, labels=None):
            logits = self.head(sum(b(input_ids) for b in self.blocks)).mean(1)
            return LossOut(logits, None if labels is None else F.cross_entropy(logits, labels))

    with caplog.at_level("WARNING", logger="hf_dp.clipping.engine"):
        check_exact(Blocks(), id_rows(eoi=3), tmp_path)
    said = [r.getMessage() for r in caplog.records if "generic fallback" in r.getMessage()]
    assert len(said) == 1 and "blocks.* (EmbeddingWithExtra: extra" in said[0] and "× 3" in said[0], said
    assert "blocks.0 " not in said[0]
