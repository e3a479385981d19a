"""Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) and P-tuning's LSTM prompt encoder are exact, or refused
with their true cause (``hf_dp/clipping/recurrent.py``).

The oracle is the model's own loss on a batch of one (float64, σ = 0, q = 1): ``helpers.check_exact`` for the
small recurrent models here, ``helpers.check_update`` / ``helpers.run_group_step`` (PEFT's own loss) for
P-tuning.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import (
    Rows,
    check_exact,
    check_update,
    cls_dataset,
    dp_args,
    lm_dataset,
    p_tuning,
    run_group_step,
    seq2seq_dataset,
    t5_frozen_bias,
    tiny_bert,
    tiny_gpt2,
    tiny_llama,
)
from peft import TaskType
from torch import nn

from hf_dp import DPTrainer, UnsupportedLayerError
from hf_dp.clipping.engine import ClippingEngine
from hf_dp.clipping.recurrent import RecurrentFallback, twin

VOCAB = 13


class Out:
    def __init__(self, logits, loss=None):
        self.logits, self.loss = logits, loss


def ce_loss(outputs, labels):
    return nn.functional.cross_entropy(outputs.logits, labels, reduction="none")


class Classifier(nn.Module):
    """ids → embedding → ``rnn`` → logits from every output position, ``h_n`` and (LSTM) ``c_n``: each of the
    layer's outputs carries gradient. Its own loss is the batch mean of the cross-entropy (one example: its own)."""

    def __init__(self, rnn: nn.RNNBase, swap_axes: bool = False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, rnn.input_size)
        self.rnn = rnn
        self.swap_axes = swap_axes  # feed (B, T, d) to a batch_first=False layer: time and batch swapped (a bug)
        dirs = 2 if rnn.bidirectional else 1
        out = getattr(rnn, "proj_size", 0) or rnn.hidden_size
        state = rnn.num_layers * dirs * (out + (rnn.hidden_size if isinstance(rnn, nn.LSTM) else 0))
        self.head = nn.Linear(dirs * out, 2)
        self.state_head = nn.Linear(state, 2)

    def forward(self, input_ids, labels=None):
        x = self.emb(input_ids)
        first = self.rnn.batch_first or self.swap_axes
        out, state = self.rnn(x if first else x.transpose(0, 1))
        seq = out if first else out.transpose(0, 1)
        states = state if isinstance(state, tuple) else (state,)
        flat = torch.cat([s.transpose(0, 1).flatten(1) for s in states], 1)
        logits = self.head(seq).mean(1) + (0 if self.swap_axes else self.state_head(flat))
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return Out(logits, loss)


def rows(n: int = 4, seq_len: int = 5, seed: int = 0) -> Rows:
    g = torch.Generator().manual_seed(seed)
    return Rows([{"input_ids": torch.randint(0, VOCAB, (seq_len,), generator=g), "labels": torch.tensor(i % 2)}
                 for i in range(n)])


RNNS = {
    "lstm_2layer_bidirectional": lambda: nn.LSTM(3, 4, num_layers=2, bidirectional=True, batch_first=True),
    "lstm_proj_seq_first_no_bias": lambda: nn.LSTM(3, 4, num_layers=2, proj_size=2, bias=False),
    "gru_2layer_bidirectional_seq_first": lambda: nn.GRU(3, 4, num_layers=2, bidirectional=True),
    "rnn_relu_bidirectional": lambda: nn.RNN(3, 4, nonlinearity="relu", bidirectional=True, batch_first=True),
}


@pytest.mark.parametrize("case", list(RNNS))
def test_recurrent_layer_matches_oracle(tmp_path, case):
    """Every parameter of the layer (and the embedding and heads around it) gets each example's exact gradient."""
    torch.manual_seed(0)
    check_exact(Classifier(RNNS[case]()), rows(), tmp_path, ga=2, per_example_loss=ce_loss)


def test_recurrent_layer_per_layer_clipping_matches_oracle(tmp_path):
    """Per-layer clipping (inside the backward pass): the layer's parameters form one group, clipped to its own
    threshold (the harness sets every group's threshold to its median per-example norm). Two of its parameters are
    frozen: the others are still exact."""
    torch.manual_seed(9)
    model = Classifier(RNNS["lstm_2layer_bidirectional"]())
    model.rnn.weight_hh_l0.requires_grad_(False)
    model.rnn.bias_ih_l1_reverse.requires_grad_(False)
    model.config = SimpleNamespace()
    trainer = check_exact(model, rows(), tmp_path, clipping="per_layer", per_example_loss=ce_loss)
    assert any(n.startswith("rnn.") for g in trainer.group_clipper.groups for n in g.params)


def test_twin_reproduces_pytorch():
    """The functional twin is PyTorch's layer for every combination of options (float64, to rounding)."""
    torch.manual_seed(1)
    x = torch.randn(3, 4, 2, dtype=torch.float64)
    for cls, extra in ((nn.LSTM, {}), (nn.LSTM, {"proj_size": 2}), (nn.GRU, {}), (nn.RNN, {}),
                       (nn.RNN, {"nonlinearity": "relu"})):
        for bidirectional in (False, True):
            m = cls(2, 3, num_layers=2, bidirectional=bidirectional, batch_first=True, **extra).double()
            out, state = m(x)
            states = state if isinstance(state, tuple) else (state,)
            mine = twin(m, x, None)
            for ref, got in zip((out, *states), mine):
                torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
            # packed, lengths 4, 1, 3 (enforce_sorted=False): what the first-batch verification compares
            packed = nn.utils.rnn.pack_padded_sequence(x, torch.tensor([4, 1, 3]), batch_first=True,
                                                       enforce_sorted=False)
            fb = RecurrentFallback(m, "rnn", tuple(n for n, _ in m.named_parameters()))
            fb.verify((packed,), {}, m(packed), 3, fb.mapped_leaves((packed,), {}, 3))


class EncoderDecoder(nn.Module):
    """An LSTM encoder whose final state ``(h_n, c_n)`` starts an LSTM decoder (``hx`` carrying gradient back to the
    encoder), and a GRU called twice in one forward (on both halves of the sequence)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 3)
        self.enc = nn.LSTM(3, 4, num_layers=2, batch_first=True)
        self.dec = nn.LSTM(3, 4, num_layers=2, batch_first=True)
        self.gru = nn.GRU(3, 2, batch_first=True)
        self.head = nn.Linear(4 + 2, 2)

    def forward(self, input_ids, labels=None):
        x = self.emb(input_ids)
        half = x.shape[1] // 2
        _, state = self.enc(x[:, :half])
        out, _ = self.dec(x[:, half:], state)
        g1, _ = self.gru(x[:, :half])
        g2, _ = self.gru(x[:, half:])
        logits = self.head(torch.cat([out.mean(1), g1.mean(1) * g2.mean(1)], 1))
        return Out(logits, None if labels is None else nn.functional.cross_entropy(logits, labels))


def test_initial_state_and_two_calls_match_oracle(tmp_path):
    torch.manual_seed(4)
    check_exact(EncoderDecoder(), rows(seq_len=6), tmp_path, ga=2, per_example_loss=ce_loss)


class LastStep(nn.Module):
    """A sequence-first GRU read at each example's own last step: right-padding does not change its result."""

    def __init__(self):
        super().__init__()
        self.emb, self.rnn, self.head = nn.Embedding(VOCAB, 3), nn.GRU(3, 4, num_layers=2), nn.Linear(4, 2)

    def forward(self, input_ids, lengths, labels=None):
        out, _ = self.rnn(self.emb(input_ids).transpose(0, 1))  # (T, B, H)
        last = out[lengths - 1, torch.arange(out.shape[1])]
        logits = self.head(last)
        return Out(logits, None if labels is None else nn.functional.cross_entropy(logits, labels))


def pad_to_longest(features: list[dict]) -> dict:
    """Dynamic padding: each micro-batch is padded to its own longest example (so 1 and B examples differ in T)."""
    longest = max(int(f["lengths"]) for f in features)
    ids = torch.stack([nn.functional.pad(f["input_ids"][:int(f["lengths"])], (0, longest - int(f["lengths"])))
                       for f in features])
    return {"input_ids": ids, "lengths": torch.stack([f["lengths"] for f in features]),
            "labels": torch.stack([f["labels"] for f in features])}


def test_sequence_first_with_dynamic_padding_matches_oracle(tmp_path):
    """The first-step probe proves the second axis is the batch although the padded length differs between the
    run on all examples and the run on the first alone."""
    torch.manual_seed(7)
    data = packed_rows()
    assert len({int(r["lengths"]) for r in data.rows}) > 1
    model = LastStep()
    model.config = SimpleNamespace()
    check_exact(model, data, tmp_path, per_example_loss=ce_loss, data_collator=pad_to_longest)


# --------------------------------------------------------------------------------------------- P-tuning (LSTM)
P_TUNING = {
    "gpt2": (lambda: p_tuning(tiny_gpt2(), TaskType.CAUSAL_LM, reparam="LSTM"), lambda: lm_dataset(6, seed=2)),
    "llama": (lambda: p_tuning(tiny_llama(), TaskType.CAUSAL_LM, reparam="LSTM"), lambda: lm_dataset(6, seed=2)),
    "bert_classification": (lambda: p_tuning(tiny_bert(num_labels=2), TaskType.SEQ_CLS, reparam="LSTM"),
                            lambda: cls_dataset(6, 2)),
    "t5": (lambda: p_tuning(t5_frozen_bias(), TaskType.SEQ_2_SEQ_LM, reparam="LSTM"), lambda: seq2seq_dataset(6)),
}


@pytest.mark.parametrize("case", list(P_TUNING))
def test_p_tuning_lstm_flat_matches_oracle(tmp_path, case):
    torch.manual_seed(2)
    make_model, make_data = P_TUNING[case]
    check_update(make_model(), make_data(), tmp_path, 2, 3)


@pytest.mark.parametrize("base", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_p_tuning_lstm_per_layer_matches_oracle(tmp_path, base):
    torch.manual_seed(3)
    model = p_tuning(base(), TaskType.CAUSAL_LM, reparam="LSTM")
    _, groups = run_group_step(model, lm_dataset(6, seed=3), tmp_path, "per_layer", thresholds="median")
    assert any("lstm_head" in n for g in groups for n in g)


# --------------------------------------------------------------------------------------------- refusals
def test_dropout_between_layers_is_refused(tmp_path):
    model = Classifier(nn.LSTM(3, 4, num_layers=2, dropout=0.2, batch_first=True)).double()
    with pytest.raises(UnsupportedLayerError, match=r"rnn \(LSTM\) applies dropout between its layers"):
        DPTrainer(model=model, args=dp_args(tmp_path, 2), train_dataset=rows(), per_example_loss=ce_loss)


def test_p_tuning_lstm_with_encoder_dropout_is_refused(tmp_path):
    from peft import PromptEncoderConfig, get_peft_model

    cfg = PromptEncoderConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=3, encoder_hidden_size=8,
                              encoder_reparameterization_type="LSTM", encoder_dropout=0.1)
    with pytest.raises(UnsupportedLayerError, match="lstm_head.*dropout.*encoder_dropout=0.0"):
        DPTrainer(model=get_peft_model(tiny_gpt2(), cfg), args=dp_args(tmp_path, 2),
                  train_dataset=lm_dataset(4))


class Packed(Classifier):
    """The usual text-classifier idiom: pack the padded batch by each example's own length, classify from the
    packed output (unpacked, mean over each example's own steps) and the final state."""

    def __init__(self, rnn: nn.RNNBase, enforce_sorted: bool = False):
        super().__init__(rnn)
        self.enforce_sorted = enforce_sorted

    def forward(self, input_ids, lengths, labels=None):
        x = self.emb(input_ids)
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), batch_first=True,
                                                   enforce_sorted=self.enforce_sorted)
        out, state = self.rnn(packed)
        seq, lens = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        states = state if isinstance(state, tuple) else (state,)
        flat = torch.cat([s.transpose(0, 1).flatten(1) for s in states], 1)
        logits = self.head(seq.sum(1) / lens[:, None].to(seq)) + self.state_head(flat)  # padded steps are 0
        return Out(logits, None if labels is None else nn.functional.cross_entropy(logits, labels))


def packed_rows(n: int = 4, seq_len: int = 6) -> Rows:
    g = torch.Generator().manual_seed(6)  # four different lengths
    out = []
    for i in range(n):
        length = int(torch.randint(1, seq_len + 1, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (seq_len,), generator=g) * (torch.arange(seq_len) < length)
        out.append({"input_ids": ids, "lengths": torch.tensor(length), "labels": torch.tensor(i % 2)})
    return Rows(out)


@pytest.mark.parametrize("make", [lambda: nn.LSTM(3, 4, num_layers=2, bidirectional=True, batch_first=True),
                                  lambda: nn.GRU(3, 4, bidirectional=True, batch_first=True)], ids=["lstm", "gru"])
def test_packed_sequence_matches_oracle(tmp_path, make):
    """Variable lengths, enforce_sorted=False: each sequence stops at its own length (and the reverse direction starts
    there); the oracle packs each example alone."""
    torch.manual_seed(6)
    data = packed_rows()
    assert len({int(r["lengths"]) for r in data.rows}) == 4  # the first micro-batch (verified) has two lengths too
    check_exact(Packed(make()), data, tmp_path, ga=2, per_example_loss=ce_loss)


class PackedHalves(Classifier):
    """Packs each example's two halves as two sequences, first halves of all examples first: the layer's sequences
    are not the examples (example i is sequences i and B + i)."""

    def __init__(self):
        super().__init__(nn.GRU(3, 2, batch_first=True))
        self.head = nn.Linear(4, 2)

    def forward(self, input_ids, lengths=None, labels=None):
        x = self.emb(input_ids)
        half = x.shape[1] // 2
        both = torch.cat([x[:, :half], x[:, half:]], 0)
        lens = torch.full((both.shape[0],), half)
        _, state = self.rnn(nn.utils.rnn.pack_padded_sequence(both, lens, batch_first=True, enforce_sorted=False))
        b = x.shape[0]
        logits = self.head(torch.cat([state[-1][:b], state[-1][b:]], 1))
        return Out(logits, None if labels is None else nn.functional.cross_entropy(logits, labels))


def test_packed_sequences_that_are_not_the_examples_are_refused(tmp_path):
    model = PackedHalves().double()
    trainer = DPTrainer(model=model, args=dp_args(tmp_path, 2, ga=2, dp_self_check=False),
                        train_dataset=rows(seq_len=6), per_example_loss=ce_loss)
    with pytest.raises(UnsupportedLayerError, match=r"rnn \(GRU\) is called with a PackedSequence of 4 sequences in "
                                                    r"a micro-batch of 2 examples"):
        trainer.train()


class Halves(nn.Module):
    """Runs the layer on each example's two halves as two rows, example-major ``(2B, T/2, d)`` (rows 2i, 2i+1 are
    example i's), as a word-level model runs a character LSTM on every word of every example."""

    def __init__(self):
        super().__init__()
        self.emb, self.rnn, self.head = nn.Embedding(VOCAB, 3), nn.LSTM(3, 4, batch_first=True), nn.Linear(8, 2)

    def forward(self, input_ids, labels=None):
        x = self.emb(input_ids)
        b, t = x.shape[:2]
        out, (h, _) = self.rnn(x.reshape(2 * b, t // 2, -1))
        logits = self.head(h[-1].reshape(b, 8)) + self.head(out.reshape(b, 2, t // 2, 4).mean(2).reshape(b, 8))
        return Out(logits, None if labels is None else nn.functional.cross_entropy(logits, labels))


def test_example_major_rows_match_oracle(tmp_path):
    """k = 2 rows per example, example-major: the first-step probe proves it ("flat"), each example's rows are
    grouped into its own factors."""
    torch.manual_seed(8)
    check_exact(Halves(), rows(seq_len=6), tmp_path, ga=2, per_example_loss=ce_loss)


def test_packed_sequence_sorted_by_the_caller_is_refused(tmp_path):
    """enforce_sorted=True: the sequences are in the caller's length order, which cannot be matched to examples."""
    model = Packed(nn.LSTM(3, 4, batch_first=True), enforce_sorted=True).double()
    data = Rows([dict(r, lengths=torch.tensor(6)) for r in packed_rows().rows])  # equal lengths: PyTorch accepts it
    trainer = DPTrainer(model=model, args=dp_args(tmp_path, 2), train_dataset=data, per_example_loss=ce_loss)
    with pytest.raises(UnsupportedLayerError, match=r"rnn \(LSTM\) is called with a PackedSequence packed with "
                                                    r"enforce_sorted=True"):
        trainer.train()


class Unbatched(Classifier):
    """Runs the layer once on one sequence (no batch axis) shared by every example."""

    def forward(self, input_ids, labels=None):
        shared, _ = self.rnn(self.emb.weight[:4])  # (T, d): one unbatched sequence
        feats = shared.mean(0).expand(input_ids.shape[0], -1) + self.emb(input_ids).mean(1).repeat(1, 2)[:, :4]
        logits = self.head(feats)
        return Out(logits, None if labels is None else nn.functional.cross_entropy(logits, labels))


def test_unbatched_input_is_refused(tmp_path):
    model = Unbatched(nn.GRU(3, 4, batch_first=True)).double()
    trainer = DPTrainer(model=model, args=dp_args(tmp_path, 2), train_dataset=rows(), per_example_loss=ce_loss)
    with pytest.raises(UnsupportedLayerError, match=r"rnn \(GRU\) is called with an unbatched input"):
        trainer.train()


def test_batch_axis_not_holding_examples_is_refused(tmp_path):
    """A batch_first=False layer fed (B, T, d) with T == B: its recurrence runs over the examples, yet every size
    matches. The first step's probe (1 example vs B) shows its batch axis does not hold the examples."""
    model = Classifier(nn.LSTM(3, 4), swap_axes=True).double()
    data = rows(n=4, seq_len=2)  # micro-batches of 2 examples of 2 tokens
    trainer = DPTrainer(model=model, args=dp_args(tmp_path, 2, ga=2, dp_self_check=False), train_dataset=data,
                        per_example_loss=ce_loss)  # the always-on first-step probe alone refuses it
    with pytest.raises(UnsupportedLayerError, match=r"second \(batch_first=False\) axis of its input.*not proven"):
        trainer.train()


def test_output_changed_by_a_hook_is_refused(tmp_path):
    """A forward hook that rescales the layer's output: the twin no longer reproduces it, so it is refused."""
    model = Classifier(nn.GRU(3, 4, batch_first=True)).double()
    model.rnn.register_forward_hook(lambda m, args, out: (2 * out[0], out[1]))
    trainer = DPTrainer(model=model, args=dp_args(tmp_path, 2), train_dataset=rows(), per_example_loss=ce_loss)
    with pytest.raises(UnsupportedLayerError, match=r"rnn \(GRU\): hf_dp's functional twin.*does not reproduce"):
        trainer.train()


def test_subclass_with_own_forward_is_refused():
    class MyLSTM(nn.LSTM):
        def forward(self, x, hx=None):
            out, state = super().forward(x, hx)
            return out * 2, state

    with pytest.raises(UnsupportedLayerError, match=r"rnn \(MyLSTM\) is a subclass.*own forward"):
        ClippingEngine(Classifier(MyLSTM(3, 4, batch_first=True)))


class Tagger(nn.Module):
    """A logit per token (what a packed row's per-token loss would use)."""

    def __init__(self):
        super().__init__()
        self.emb, self.rnn, self.head = nn.Embedding(VOCAB, 3), nn.LSTM(3, 4, batch_first=True), nn.Linear(4, 2)

    def forward(self, input_ids):
        return self.head(self.rnn(self.emb(input_ids))[0])


def test_padding_free_packed_rows_are_refused():
    """Several examples packed in one row: the recurrence carries one example's state into the next, so splitting
    the layer's per-token factors by example would not give each example's gradient."""
    model = Tagger().double()
    engine = ClippingEngine(model)
    ids = torch.randint(0, VOCAB, (1, 6))
    with pytest.raises(UnsupportedLayerError, match="padding-free packed rows"), \
            engine.record(1, segments=torch.tensor([[0, 0, 0, 1, 1, 1]])):
        model(ids).sum().backward()
