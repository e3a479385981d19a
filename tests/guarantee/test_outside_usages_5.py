"""Ordinary usages from a fifth outside probe (session 13), each closed by the invariant it violated.

* A model carries what was done to it (DESIGN invariant 13): PEFT initialisations computed from data the user runs
  through the model (``init_lora_weights="eva"``: the SVD of the layers' inputs on a dataloader; ``"corda"``;
  ``"lora_ga"``: gradients on batches) put weights computed from that data, without noise, into the released model.
  Initialised from the training set itself, the run said ``dp_guarantee = "strict"``. Now warned at construction and
  recorded in ``dp_guarantee`` (not covered if that data is private).
* Per-example gradients are exact or refused with a true cause (invariant 1): ``*ForMultipleChoice`` folds each
  example's choices into the batch dimension; it was refused only without ``per_example_loss``, and with a loss of
  the user's own it failed at the first step with torch's bare shape mismatch. Refused at construction, whatever the
  loss.
* A refusal states its true cause: a ``per_example_loss`` that reads other examples' outputs (in-batch negatives) or
  divides by a count over the batch was refused as "the model mixes examples ... find the layer"; the message now
  names the loss as a cause and what to do.

What the probe found holding (DoRA, VeRA, OFT, BOFT, ``layers_to_transform``, LoRA+, IA3, LN tuning, FourierFT,
VB-LoRA, HRA, MiSS, RoAd, DeLoRA, GraLoRA, WaveFT exact against the oracle; BatchNorm, weight and spectral norm,
LoHa / LoKr / C3A / RandLoRA / PVeRA / Lily / FRoD refused with true causes; accelerate's ``split_batches``,
``dispatch_batches``, ``even_batches``, ``use_seedable_sampler``; ``resume_from_checkpoint`` with another N, batch
size or σ, recorded at the new mechanism; AdaLoRA's ``update_and_allocate`` refused between steps unless inside
``hf_dp.post_processing()``, then trained; ``DataCollatorForSeq2Seq`` on T5; pruning masks) is in the session's report.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import cls_dataset, quick_dp_args, tiny_bert
from helpers.neighbours import C, bert, bert_data, distance, neighbour_args, summed_updates
from helpers.runs import assert_refused_before_any_release

from hf_dp import DPTrainer


# ---------------------------------------------------------------------- adapters initialised from data
def eva_lora(data):
    """A tiny BERT with an EVA-initialised LoRA adapter (PEFT ``initialize_lora_eva_weights``) on ``data``."""
    from peft import EvaConfig, LoraConfig, TaskType, get_peft_model
    from peft.tuners.lora import initialize_lora_eva_weights
    from torch.utils.data import DataLoader
    from transformers import default_data_collator

    torch.manual_seed(0)
    config = LoraConfig(task_type=TaskType.SEQ_CLS, r=2, target_modules=["query", "value"], init_lora_weights="eva",
                        eva_config=EvaConfig(rho=1.0))
    model = get_peft_model(tiny_bert(), config)
    loader = DataLoader(data.remove_columns(["labels"]), batch_size=8, collate_fn=default_data_collator)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        initialize_lora_eva_weights(model, loader, show_progress_bar=False)
    return model


def test_adapter_initialised_from_the_training_data_is_said_and_recorded_not_strict(tmp_path):
    """EVA's initial lora_A is the SVD of the layers' inputs on the training rows, computed without noise and
    released with the model; unchecked, dp_guarantee (dp_state.json, the card) said "strict". Warned once at
    construction and recorded as not covered if that data is private."""
    data = cls_dataset(16, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = DPTrainer(model=eva_lora(data), args=quick_dp_args(tmp_path, max_steps=1), train_dataset=data)
    said = [str(w.message) for w in caught if "initialised from data" in str(w.message)]
    assert len(said) == 1 and "init_lora_weights='eva'" in said[0]
    assert "Run the initialisation on public data" in said[0]
    trainer.train()
    guarantee = trainer.privacy_record().dp_guarantee
    assert guarantee.startswith("not strict: adapter weights initialised from data before DP training")
    assert "init_lora_weights='eva'" in guarantee and guarantee.endswith("not covered if that data is private")


@pytest.mark.parametrize("init, from_data", [("eva", True), ("corda", True), ("corda_kpm", True), ("lora_ga", True),
                                             (True, False), ("gaussian", False), ("pissa", False), ("olora", False)])
def test_which_lora_initialisations_read_data(init, from_data):
    """CorDA and LoRA-GA read data as EVA does (their preprocessing needs a model run the tests cannot afford here:
    the config is set on a plain LoRA model); the data-free initialisations are not flagged."""
    from peft import LoraConfig, TaskType, get_peft_model

    from hf_dp.peft_support import data_initialisation_note, data_initialised_adapters

    torch.manual_seed(0)
    model = get_peft_model(tiny_bert(), LoraConfig(task_type=TaskType.SEQ_CLS, r=2, target_modules=["query"]))
    model.peft_config["default"].init_lora_weights = init
    found = data_initialised_adapters(model)
    assert bool(found) is from_data
    note = data_initialisation_note(model)
    assert (note is not None) is from_data and (note is None or "; " not in note)  # the card splits notes at "; "


def test_plain_lora_stays_strict_and_unwarned(tmp_path):
    from peft import LoraConfig, TaskType

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = DPTrainer(model=tiny_bert(), args=quick_dp_args(tmp_path, max_steps=1),
                            train_dataset=cls_dataset(16, 3),
                            peft_config=LoraConfig(task_type=TaskType.SEQ_CLS, r=2, target_modules=["query"]))
    assert not [w for w in caught if "initialised from data" in str(w.message)]
    assert trainer.dp_guarantee == "strict"


# ---------------------------------------------------------------------- heads that fold each example into rows
def test_multiple_choice_head_is_refused_with_a_loss_of_your_own(tmp_path):
    """Unchecked, with ``per_example_loss`` the run reached the first step and failed there with torch's "The size of
    tensor a (15) must match the size of tensor b (5)" (5 examples of 3 choices each: 15 rows reach every layer).
    Refused at construction with the true cause and the way out."""
    from transformers import BertConfig, BertForMultipleChoice

    torch.manual_seed(0)
    model = BertForMultipleChoice(BertConfig(vocab_size=61, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=24, max_position_embeddings=32, pad_token_id=0))
    g = torch.Generator().manual_seed(0)
    from datasets import Dataset

    data = Dataset.from_dict({"input_ids": torch.randint(1, 61, (5, 3, 6), generator=g).tolist(),
                              "attention_mask": [[[1] * 6] * 3] * 5, "labels": [0, 1, 2, 1, 0]})

    def loss(outputs, labels):
        return torch.nn.functional.cross_entropy(outputs.logits, labels, reduction="none")

    with pytest.raises(ValueError, match=r"BertForMultipleChoice folds the choices into the batch dimension.*a custom "
                                         r"per_example_loss does not change this.*Put all choices of an example in one "
                                         r"sequence"):
        DPTrainer(model=model, args=neighbour_args(tmp_path, 5), train_dataset=data, per_example_loss=loss)


# ---------------------------------------------------------------------- a loss that reads other examples
def in_batch_negatives(outputs, labels):
    """A contrastive loss: each row's logits scored against every row's of the batch (the others are negatives)."""
    z = torch.nn.functional.normalize(outputs.logits, dim=-1)
    sim = z @ z.T
    return torch.logsumexp(sim, -1) - sim.diagonal()


def test_loss_with_in_batch_negatives_is_refused_naming_the_loss(tmp_path):
    """The refusal said "the model mixes examples ... find the layer that computes across the batch": untrue, the
    model is per example and the loss reads the other rows. It now names the loss and what to do; nothing released."""
    trainer = DPTrainer(model=bert(), args=neighbour_args(tmp_path, 4), train_dataset=bert_data(4),
                        per_example_loss=in_batch_negatives)
    assert_refused_before_any_release(trainer, r"the model or the per-example loss mixes examples.*a per_example_loss "
                                               r"that reads other examples' outputs, such as in-batch negatives.*make "
                                               r"per_example_loss compute each example's loss from its own row",
                                      error=Exception)


# ---------------------------------------------------------------------- what holds
def test_accelerate_data_loader_options_leave_the_dp_loader_within_the_bound(tmp_path):
    """``accelerator_config`` options that change how accelerate splits and dispatches batches: the DP train loader
    is never prepared by accelerate (invariant 4), so they do not touch the Poisson batches; removing one example
    moves the summed update by at most C."""
    config = {"split_batches": True, "dispatch_batches": True, "even_batches": False, "use_seedable_sampler": False}
    sigma_d, sigma_d2 = summed_updates(tmp_path, accelerator_config=config)
    assert 0 < distance(sigma_d, sigma_d2) <= C * (1 + 1e-6)


# ---------------------------------------------------------------------- sequence-first attention (batch_first=False)
class Attend(torch.nn.Module):
    """A PyTorch model of the kind users pass to the Trainer: embeddings, ``nn.MultiheadAttention`` (PyTorch's default
    layout is sequence-first, ``batch_first=False``), a mean-pooled head; its own loss is the batch's cross-entropy."""

    def __init__(self, batch_first: bool):
        super().__init__()
        self.emb = torch.nn.Embedding(61, 16)
        self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=batch_first)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, input_ids, attention_mask=None, labels=None):
        from transformers.modeling_outputs import SequenceClassifierOutput

        h = self.emb(input_ids)
        x = h if self.attn.batch_first else h.transpose(0, 1)
        x = self.attn(x, x, x, need_weights=False)[0]
        logits = self.head((x if self.attn.batch_first else x.transpose(0, 1)).mean(1))
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def cross_entropy(outputs, labels):
    return torch.nn.functional.cross_entropy(outputs.logits, labels, reduction="none")


class MixedAttend(Attend):
    """``Attend`` sequence-first, with the batch's mean over the examples (axis 1) subtracted before the attention."""

    def __init__(self):
        super().__init__(batch_first=False)

    def forward(self, input_ids, attention_mask=None, labels=None):
        from transformers.modeling_outputs import SequenceClassifierOutput

        x = self.emb(input_ids).transpose(0, 1)
        x = x - x.mean(1, keepdim=True)
        x = self.attn(x, x, x, need_weights=False)[0]
        return SequenceClassifierOutput(logits=self.head(x.transpose(0, 1).mean(1)))


def test_sequence_first_attention_is_refused_where_its_batch_axis_is_not_proven(tmp_path):
    """``nn.MultiheadAttention`` with PyTorch's default ``batch_first=False`` trains exactly (below): the first step
    proves that axis 1 of its inputs holds the examples and the fallback re-runs it per example along that axis. Where
    that cannot be proven (here its input mixes the examples: the first example's slice differs between the batch and
    the example alone), it is refused naming the layout and that cause; nothing released. (It was refused, before
    session 14, for every sequence-first model, naming batch_first=True as the way out.)"""
    torch.manual_seed(0)
    trainer = DPTrainer(model=MixedAttend().double(), args=neighbour_args(tmp_path, 4),
                        train_dataset=cls_dataset(4, 3), per_example_loss=cross_entropy)
    assert_refused_before_any_release(trainer, r"attn \(MultiheadAttention\).*built with batch_first=False "
                                               r"\(attn\): its inputs and output are sequence-first.*the first step "
                                               r"did not prove that the second axis of its inputs holds the examples.*"
                                               r"something before this module mixes the examples", error=Exception)


def test_the_way_out_batch_first_attention_trains_exactly(tmp_path):
    from helpers import check_exact

    torch.manual_seed(0)
    check_exact(Attend(batch_first=True), cls_dataset(4, 3), tmp_path, per_example_loss=cross_entropy)


def test_sequence_first_attention_trains_exactly(tmp_path):
    from helpers import check_exact

    torch.manual_seed(0)
    check_exact(Attend(batch_first=False), cls_dataset(4, 3), tmp_path, per_example_loss=cross_entropy)


class Encoder(torch.nn.Module):
    """A pure-PyTorch classifier on ``nn.TransformerEncoder`` / ``nn.TransformerEncoderLayer`` with PyTorch's defaults
    (sequence-first, ``batch_first=False``; dropout off for the exact check), padding masked by
    ``src_key_padding_mask`` (batch-first, ``(batch, length)``, in the same call as the sequence-first input)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(61, 16)
        layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=24, dropout=0.0)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, input_ids, attention_mask=None, labels=None):
        from transformers.modeling_outputs import SequenceClassifierOutput

        x = self.encoder(self.emb(input_ids).transpose(0, 1), src_key_padding_mask=attention_mask == 0)
        x = x.transpose(0, 1) * attention_mask[..., None]
        logits = self.head(x.sum(1) / attention_mask.sum(1, keepdim=True))
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


class AttendWithWeights(Attend):
    """``Attend`` sequence-first, asking for the attention weights too (``need_weights=True``, PyTorch's default:
    a batch-first ``(batch, length, length)`` output beside the sequence-first one) and using them."""

    def __init__(self):
        super().__init__(batch_first=False)

    def forward(self, input_ids, attention_mask=None, labels=None):
        from transformers.modeling_outputs import SequenceClassifierOutput

        x = self.emb(input_ids).transpose(0, 1)
        out, weights = self.attn(x, x, x, key_padding_mask=attention_mask == 0)
        logits = self.head(out.transpose(0, 1).mean(1) + weights.pow(2).sum((1, 2))[:, None])
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


@pytest.mark.parametrize("build", [Encoder, AttendWithWeights], ids=["transformer_encoder", "attention_weights"])
def test_sequence_first_transformer_layers_train_exactly(tmp_path, build):
    """Per example exact against the oracle (float64, σ = 0): the encoder's attention and its ``linear1/2`` /
    norms see ``(length, batch, d)``, the padding mask ``(batch, length)``; the attention weights come out
    batch-first."""
    from helpers import check_exact

    torch.manual_seed(0)
    check_exact(build(), cls_dataset(4, 3), tmp_path, per_example_loss=cross_entropy)


def test_sequence_first_encoder_neighbours_within_c(tmp_path):
    """Adding or removing one example moves the summed clipped update by at most C (sequence-first encoder)."""
    def build(args, data):
        torch.manual_seed(0)
        return DPTrainer(model=Encoder().double(), args=args, train_dataset=data, per_example_loss=cross_entropy)

    sigma_d, sigma_d2 = summed_updates(tmp_path, build=build, data_fn=lambda n: cls_dataset(5, 3).select(range(n)))
    assert 0 < distance(sigma_d, sigma_d2) <= C * (1 + 1e-6)


# ---------------------------------------------------------------------- several GPUs in one process
def test_several_gpus_in_one_process_are_refused_at_construction(tmp_path, monkeypatch):
    """A machine with several GPUs and a plain ``python train.py``: the Trainer wraps the model in
    ``torch.nn.DataParallel`` at ``train()`` (``args.n_gpu > 1``), whose replicas run the layers in threads; nothing
    refused it. Refused at construction with the ways out (one process per GPU, or one GPU visible). The machine is
    simulated: ``n_gpu`` is what the Trainer reads."""
    from hf_dp import DPTrainingArguments

    args = neighbour_args(tmp_path, 4)
    monkeypatch.setattr(DPTrainingArguments, "n_gpu", property(lambda self: 2))
    with pytest.raises(ValueError, match=r"2 GPUs are visible to one process.*torch\.nn\.DataParallel.*Launch one "
                                         r"process per GPU.*CUDA_VISIBLE_DEVICES=0"):
        DPTrainer(model=bert(), args=args, train_dataset=bert_data(4))
