"""Default per-example losses equal the model's own loss on a batch of one (DESIGN invariant 9).

Two levels, both against ``model(**one_example).loss`` (``helpers.single_example_loss``), in float64:

* loss level: hf_dp's per-example loss on a batch, through DPTrainer's own input building (``_model_inputs``), equals
  the model's own loss of each example run alone;
* update level: σ = 0, q = 1, SGD lr = 1: update × N == Σ_i clip(∇L_i) (``helpers.check_update``).

Parameters today's engine refuses (learned positional embeddings with an offset, T5's relative attention bias, ViT's
``cls_token``/``position_embeddings``, convolutions) are frozen here: other branches make them exact (issue 13).
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from helpers import VOCAB, check_update, dp_args, per_example_grads, seq2seq_dataset, single_example_loss, tiny_t5
from transformers import (
    ViTConfig,
    ViTForImageClassification,
    Wav2Vec2Config,
    Wav2Vec2ForSequenceClassification,
)

from hf_dp import DPTrainer

S2S = dict(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
           decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=32, dropout=0.0,
           attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
           decoder_start_token_id=2)


def _s2s(model_name: str, config_name: str, **extra):
    import transformers

    def make():
        return getattr(transformers, model_name)(getattr(transformers, config_name)(**S2S, **extra))

    return make


SEQ2SEQ = {
    # M2M100 is also NLLB's architecture (NLLB checkpoints load as M2M100ForConditionalGeneration).
    "m2m100": _s2s("M2M100ForConditionalGeneration", "M2M100Config", encoder_layerdrop=0.0, decoder_layerdrop=0.0),
    "blenderbot": _s2s("BlenderbotForConditionalGeneration", "BlenderbotConfig"),
    "blenderbot_small": _s2s("BlenderbotSmallForConditionalGeneration", "BlenderbotSmallConfig"),
    "bart": _s2s("BartForConditionalGeneration", "BartConfig"),
    "mbart": _s2s("MBartForConditionalGeneration", "MBartConfig"),  # its own shift (wraps the last token around)
    "marian": _s2s("MarianMTModel", "MarianConfig"),
    "pegasus": _s2s("PegasusForConditionalGeneration", "PegasusConfig"),
    "t5": tiny_t5,
}


def freeze_refused(model):
    """Freeze what today's engine refuses (made exact on other branches): learned positional embeddings (BART,
    Blenderbot, mBART), scaled word embeddings (``*ScaledWordEmbedding``, tied to the LM head, so that is frozen
    too), T5's relative attention bias."""
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) and type(module) is not torch.nn.Embedding:
            module.weight.requires_grad_(False)
    for name, p in model.named_parameters():
        if "embed_positions" in name or "relative_attention_bias" in name:
            p.requires_grad_(False)
    return model


def batch_of(dataset: Dataset) -> dict:
    return {k: torch.tensor(dataset[k]) for k in dataset.column_names}


def check_losses(model, dataset: Dataset, tmp_path, **trainer_kw):
    """hf_dp's per-example losses on the whole batch (DPTrainer's own inputs) == the model's own loss per example."""
    model = model.double().eval()
    trainer = DPTrainer(model=model, args=dp_args(tmp_path, len(dataset), 1, 1.0), train_dataset=dataset,
                        **trainer_kw)
    batch = batch_of(dataset)
    labels = batch.pop("labels")
    with torch.no_grad():
        ours = trainer.per_example_loss(model(**trainer._model_inputs(model, batch, labels)), labels)
        own = torch.stack([single_example_loss(model, {k: v[i:i + 1] for k, v in batch_of(dataset).items()})
                           for i in range(len(dataset))])
    assert ours.shape == (len(dataset),)
    torch.testing.assert_close(ours, own.to(ours.dtype), rtol=1e-9, atol=1e-12)
    return trainer


@pytest.mark.parametrize("name", list(SEQ2SEQ))
def test_seq2seq_loss_is_the_models_own(tmp_path, name):
    torch.manual_seed(0)
    trainer = check_losses(freeze_refused(SEQ2SEQ[name]()), seq2seq_dataset(4), tmp_path)
    assert trainer.task == "seq2seq_lm"


@pytest.mark.parametrize("name", ["m2m100", "blenderbot", "blenderbot_small", "mbart", "marian"])
def test_seq2seq_update_matches_oracle(tmp_path, name):
    torch.manual_seed(1)
    check_update(freeze_refused(SEQ2SEQ[name]()), seq2seq_dataset(6), tmp_path, per_device=2, ga=3)


def test_seq2seq_without_a_shift_function_lets_the_model_build_decoder_inputs(tmp_path, monkeypatch):
    """A model with none of the known shift functions gets ``labels=`` and builds its decoder inputs itself."""
    import hf_dp.losses

    monkeypatch.setattr(hf_dp.losses, "decoder_input_ids_from_labels", lambda model, labels: None)
    torch.manual_seed(2)
    trainer = check_losses(freeze_refused(SEQ2SEQ["mbart"]()), seq2seq_dataset(3), tmp_path)
    batch = batch_of(seq2seq_dataset(3))
    labels = batch.pop("labels")
    assert "labels" in trainer._model_inputs(trainer.model, batch, labels)


def test_custom_loss_on_seq2seq_still_gets_decoder_inputs_from_labels(tmp_path):
    """With a custom per_example_loss, an encoder-decoder LM still gets its teacher-forcing decoder inputs (BART
    would otherwise build them from input_ids, silently training another objective)."""
    from hf_dp.losses import token_loss

    torch.manual_seed(3)
    trainer = check_losses(freeze_refused(SEQ2SEQ["bart"]()), seq2seq_dataset(3), tmp_path, per_example_loss=token_loss)
    assert trainer.task == "custom"


def tiny_bert2bert():
    """``EncoderDecoderModel`` (bert2bert): its forward builds ``decoder_attention_mask`` from the shifted labels'
    pad tokens when it builds the decoder inputs from ``labels``."""
    from transformers import BertConfig, EncoderDecoderConfig, EncoderDecoderModel

    bert = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
                max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)
    cfg = EncoderDecoderConfig.from_encoder_decoder_configs(BertConfig(**bert), BertConfig(**bert))
    cfg.pad_token_id, cfg.decoder_start_token_id = 0, 2
    return EncoderDecoderModel(config=cfg)


def test_encoder_decoder_model_gets_the_decoder_mask_it_builds_from_labels(tmp_path):
    """A target with an ignored token in the middle (-100, shifted to the pad id): EncoderDecoderModel's own loss
    masks it as a key of the later positions, so the per-example loss must too (it did not: decoder_input_ids alone)."""
    data = seq2seq_dataset(4)
    data = data.map(lambda row: {"labels": [row["labels"][0], -100, *row["labels"][2:]]})
    torch.manual_seed(6)
    trainer = check_losses(tiny_bert2bert(), data, tmp_path)
    assert trainer.task == "seq2seq_lm"


def test_masked_lm_named_like_a_causal_head_gets_the_token_loss(tmp_path):
    """FlaubertWithLMHeadModel is listed only as a masked LM but its name ends with "LMHeadModel": its own loss is
    the unshifted token cross-entropy (it was refused as a causal LM whose loss hf_dp could not identify)."""
    from helpers import token_dataset
    from transformers import FlaubertConfig, FlaubertWithLMHeadModel

    torch.manual_seed(7)
    model = FlaubertWithLMHeadModel(FlaubertConfig(
        vocab_size=VOCAB, emb_dim=16, n_layers=1, n_heads=2, max_position_embeddings=32, dropout=0.0,
        attention_dropout=0.0, pad_index=0))
    trainer = check_losses(model, token_dataset(4, num_labels=VOCAB, seq_len=6), tmp_path)
    assert trainer.task == "masked_lm"


def test_labels_column_is_kept_when_the_forward_takes_them_as_kwargs(tmp_path):
    """A head whose forward takes ``labels`` through ``**kwargs`` (Qwen3.5's sequence classification): the Trainer
    keeps only the columns the forward lists, so the labels were dropped and DPTrainer refused ("needs labels")."""
    from helpers import cls_dataset, tiny_bert
    from transformers import BertForSequenceClassification

    class KwargsBertForSequenceClassification(BertForSequenceClassification):
        def forward(self, input_ids=None, attention_mask=None, **kwargs):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    torch.manual_seed(8)
    model = KwargsBertForSequenceClassification(tiny_bert().config)
    check_update(model, cls_dataset(4, num_labels=3, seq_len=6), tmp_path, per_device=2, ga=2)


def test_prophetnet_ngram_loss_is_refused(tmp_path):
    """ProphetNet's own loss adds its n-gram streams (and label smoothing) to the main stream's cross-entropy: the
    seq2seq token loss of ``logits`` trained another objective, silently (the sweep's LoRA run: wrong)."""
    from transformers import ProphetNetConfig, ProphetNetForConditionalGeneration

    from hf_dp.losses import token_loss

    torch.manual_seed(9)
    model = ProphetNetForConditionalGeneration(ProphetNetConfig(
        vocab_size=VOCAB, hidden_size=16, encoder_ffn_dim=24, decoder_ffn_dim=24, num_encoder_layers=1,
        num_decoder_layers=1, num_encoder_attention_heads=2, num_decoder_attention_heads=2, ngram=2,
        max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0,
        decoder_start_token_id=0, eos_token_id=1)).eval()
    batch = {k: v[:1] for k, v in batch_of(seq2seq_dataset(1)).items()}
    own = model(**batch).loss  # float32: ProphetNet's loss computes in float32
    labels = batch.pop("labels")
    logits = model(**batch, decoder_input_ids=model._shift_right(labels)).logits
    assert not torch.allclose(token_loss({"logits": logits}, labels), own)  # why a default would be wrong
    with pytest.raises(ValueError, match="_compute_loss.*per_example_loss=fn"):
        DPTrainer(model=model, args=dp_args(tmp_path, 1, 1, 1.0), train_dataset=seq2seq_dataset(2))


# ----------------------------------------------------------------------------------------------- vision / audio
@pytest.fixture
def float64_default():
    """Float features (pixels, waveforms) become float64 tensors in the collator and the oracle."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def tiny_vit(num_labels: int = 3, problem_type: str | None = None):
    cfg = ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
                    num_attention_heads=2, intermediate_size=24, num_labels=num_labels, problem_type=problem_type,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = ViTForImageClassification(cfg)
    for name, p in model.named_parameters():  # conv patch embedding, cls_token, position_embeddings: other branches
        if ".embeddings." in name:
            p.requires_grad_(False)
    return model


def tiny_wav2vec2(num_labels: int = 3):
    cfg = Wav2Vec2Config(vocab_size=10, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=24, conv_dim=(8, 8), conv_stride=(4, 2), conv_kernel=(8, 3),
                         num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, mask_time_prob=0.0,
                         hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
                         final_dropout=0.0, layerdrop=0.0, num_labels=num_labels, classifier_proj_size=8)
    model = Wav2Vec2ForSequenceClassification(cfg)
    model.freeze_feature_encoder()  # conv feature encoder (GroupNorm); the positional conv: other branches
    for p in model.wav2vec2.encoder.pos_conv_embed.parameters():
        p.requires_grad_(False)
    return model


def image_dataset(n: int, labels: str, num_labels: int = 3, seed: int = 0) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64)
    if labels == "single":
        y = torch.randint(0, num_labels, (n,), generator=g).tolist()
    elif labels == "multi":
        y = (torch.rand(n, num_labels, generator=g, dtype=torch.float64) < 0.5).double().tolist()
    else:  # regression
        y = torch.randn(n, num_labels, generator=g, dtype=torch.float64).squeeze(-1).tolist()
    return Dataset.from_dict({"pixel_values": pixels.tolist(), "labels": y})


VIT = {  # name: (model kwargs, label kind, num_labels)
    "single_label": (dict(num_labels=3), "single", 3),
    "multi_label": (dict(num_labels=3, problem_type="multi_label_classification"), "multi", 3),
    "regression_one": (dict(num_labels=1), "regression", 1),  # HF: MSE when num_labels == 1
    "regression_two": (dict(num_labels=2, problem_type="regression"), "regression", 2),
}


@pytest.mark.parametrize("case", list(VIT))
def test_image_classification_loss_is_the_models_own(tmp_path, float64_default, case):
    kwargs, kind, k = VIT[case]
    torch.manual_seed(4)
    trainer = check_losses(tiny_vit(**kwargs), image_dataset(4, kind, k), tmp_path)
    assert trainer.task == "image_classification"


@pytest.mark.parametrize("case", ["single_label", "regression_one"])
def test_image_classification_update_matches_oracle(tmp_path, float64_default, case):
    kwargs, kind, k = VIT[case]
    torch.manual_seed(5)
    check_update(tiny_vit(**kwargs), image_dataset(6, kind, k, seed=1), tmp_path, per_device=3, ga=2)


def audio_dataset(n: int, num_labels: int = 3, seed: int = 0) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    return Dataset.from_dict({"input_values": torch.randn(n, 120, generator=g, dtype=torch.float64).tolist(),
                              "labels": torch.randint(0, num_labels, (n,), generator=g).tolist()})


def test_audio_classification_matches_oracle(tmp_path, float64_default):
    """Wav2Vec2's head applies cross-entropy whatever config.problem_type says: so does hf_dp's default."""
    torch.manual_seed(6)
    trainer = check_losses(tiny_wav2vec2(), audio_dataset(4), tmp_path)
    assert trainer.task == "audio_classification"
    model = tiny_wav2vec2()
    model.config.problem_type = "multi_label_classification"  # ignored by Wav2Vec2's own loss: CE on class ids
    check_losses(model, audio_dataset(4), tmp_path)
    check_update(tiny_wav2vec2(), audio_dataset(6, seed=1), tmp_path, per_device=2, ga=3)


# ---------------------------------------------------------------------------------------- QA, refusals
def tiny_bert_qa():
    from transformers import BertConfig, BertForQuestionAnswering

    return BertForQuestionAnswering(BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0))


def qa_dataset(n: int, seq_len: int = 8, seed: int = 0) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, seq_len, (n,), generator=g)
    end = (start + torch.randint(0, 3, (n,), generator=g)).clamp(max=seq_len - 1)
    end[0] = seq_len + 5  # out of range: ignored by HF (clamped to T = ignore index); contributes 0 here
    return Dataset.from_dict({"input_ids": torch.randint(2, VOCAB, (n, seq_len), generator=g).tolist(),
                              "start_positions": start.tolist(), "end_positions": end.tolist()})


def test_question_answering_refused_with_instructions_that_work(tmp_path):
    """The default refuses QA heads; doing what the message says trains HF's start/end loss exactly."""
    import warnings

    from helpers import flat_clipped_sum

    from hf_dp.losses import question_answering_loss

    torch.manual_seed(7)
    data = qa_dataset(6)
    with pytest.raises(ValueError, match=r"label_names=\['labels'\].*question_answering_loss"):
        DPTrainer(model=tiny_bert_qa(), args=dp_args(tmp_path, 2, 3, 1.0), train_dataset=data)

    model = tiny_bert_qa().double()
    # The oracle (model's own loss, batch of one) on examples 1..5: HF's mean over an ignored end term is NaN.
    grads = per_example_grads(model, data, list(range(1, 6)))
    train = data.select(range(1, 6)).map(lambda ex: {"labels": [ex["start_positions"], ex["end_positions"]]},
                                         remove_columns=["start_positions", "end_positions"])
    expected = flat_clipped_sum(grads, 0.5)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = dp_args(tmp_path, 5, 1, 0.5, label_names=["labels"])
    trainer = DPTrainer(model=model, args=args, train_dataset=train, per_example_loss=question_answering_loss)
    trainer.train()
    for k, p in model.named_parameters():
        torch.testing.assert_close(before[k] - p.detach(), expected[k] / 5, rtol=1e-7, atol=1e-10, msg=k)
    # The out-of-range end term is ignored: example 0's loss is its start term / 2.
    batch = {"input_ids": torch.tensor(data["input_ids"][:1])}
    out = model(**batch)
    loss = question_answering_loss(out, torch.tensor([[data[0]["start_positions"], data[0]["end_positions"]]]))
    start = torch.nn.functional.cross_entropy(out.start_logits, torch.tensor([data[0]["start_positions"]]))
    torch.testing.assert_close(loss[0], start / 2)


def test_unknown_head_message_says_what_to_pass():
    from transformers import BertConfig, BertForPreTraining

    from hf_dp.losses import default_per_example_loss

    model = BertForPreTraining(BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                                          num_attention_heads=2, intermediate_size=24))
    with pytest.raises(ValueError, match=r"per_example_loss=fn.*shape \(batch,\).*hf_dp.losses has"):
        default_per_example_loss(model)


def test_multiple_choice_and_teacher_heads_refused():
    from transformers import BertConfig, BertForMultipleChoice, DeiTConfig, DeiTForImageClassificationWithTeacher

    from hf_dp.losses import default_per_example_loss

    bert = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=24)
    with pytest.raises(ValueError, match="folds the choices into the batch"):
        default_per_example_loss(BertForMultipleChoice(bert))
    deit = DeiTConfig(image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=24)
    with pytest.raises(ValueError, match="computes no training loss"):
        default_per_example_loss(DeiTForImageClassificationWithTeacher(deit))


def test_decoder_only_vlm_gets_the_causal_loss():
    """Llava-style ``*ForConditionalGeneration`` models are decoder-only: their own loss is ForCausalLMLoss (shifted),
    not a seq2seq token loss."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from hf_dp.losses import default_per_example_loss

    torch.manual_seed(8)
    cfg = LlavaConfig(vision_config=CLIPVisionConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                                     num_attention_heads=2, image_size=8, patch_size=4),
                      text_config=LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24,
                                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1),
                      image_token_index=VOCAB - 1)
    model = LlavaForConditionalGeneration(cfg).double().eval()
    loss_fn, task = default_per_example_loss(model)
    assert task == "causal_lm"
    ids = torch.randint(2, VOCAB - 2, (3, 7))
    labels = ids.clone()
    labels[1, 5:] = -100
    with torch.no_grad():
        ours = loss_fn(model(input_ids=ids), labels)
        own = torch.stack([single_example_loss(model, {"input_ids": ids[i:i + 1], "labels": labels[i:i + 1]})
                           for i in range(3)])
    torch.testing.assert_close(ours, own, rtol=1e-9, atol=1e-12)


def test_loss_input_checks():
    """Wrong QA labels and an invalid problem_type are refused, not silently reinterpreted."""
    from types import SimpleNamespace

    from hf_dp.losses import question_answering_loss, sequence_classification_loss

    out = SimpleNamespace(start_logits=torch.randn(2, 5), end_logits=torch.randn(2, 5))
    with pytest.raises(ValueError, match=r"shape \(batch, 2\)"):
        question_answering_loss(out, torch.tensor([1, 2]))
    cfg = SimpleNamespace(problem_type="ordinal", num_labels=3)
    with pytest.raises(ValueError, match="Invalid config.problem_type 'ordinal'"):
        sequence_classification_loss(config=cfg)(SimpleNamespace(logits=torch.randn(2, 3)), torch.tensor([0, 1]))


def test_vlm_with_its_own_loss_is_refused():
    """A ``*ForConditionalGeneration`` whose forward computes another loss (e.g. BLIP's label smoothing) gets no
    default: the causal loss would silently train another objective."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from hf_dp.losses import default_per_example_loss

    class SmoothedLlavaForConditionalGeneration(LlavaForConditionalGeneration):
        def forward(self, input_ids=None, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids, **kwargs)
            if labels is not None:
                out.loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                                             label_smoothing=0.1)
            return out

    cfg = LlavaConfig(vision_config=CLIPVisionConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                                     num_attention_heads=2, image_size=8, patch_size=4),
                      text_config=LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24,
                                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1),
                      image_token_index=VOCAB - 1)
    with pytest.raises(ValueError, match="no default per-example loss for SmoothedLlavaForConditionalGeneration"):
        default_per_example_loss(SmoothedLlavaForConditionalGeneration(cfg))


def _text_cls_data(kind: str, num_labels: int, n: int = 4) -> Dataset:
    from helpers import cls_dataset

    data = cls_dataset(n, max(num_labels, 2), seed=9)
    g = torch.Generator().manual_seed(9)
    if kind == "regression":
        return data.map(lambda ex, i: {"labels": float(torch.randn(1, generator=g)) if num_labels == 1
                                       else torch.randn(num_labels, generator=g).tolist()}, with_indices=True)
    if kind == "multi":
        return data.map(lambda ex: {"labels": (torch.rand(num_labels, generator=g) < 0.5).double().tolist()})
    return data


TEXT_CLS = {  # name: (model kwargs for tiny_bert-like config, label kind, num_labels)
    "single_label": ({}, "single", 3),
    "regression_one": ({}, "regression", 1),  # HF: MSE when num_labels == 1 (problem_type unset)
    "regression_two": ({"problem_type": "regression"}, "regression", 2),
    "multi_label": ({"problem_type": "multi_label_classification"}, "multi", 3),
}


@pytest.mark.parametrize("case", list(TEXT_CLS))
def test_text_classification_loss_is_the_models_own(tmp_path, float64_default, case):
    from helpers import tiny_bert

    kwargs, kind, k = TEXT_CLS[case]
    torch.manual_seed(10)
    model = tiny_bert(num_labels=k)
    for key, value in kwargs.items():
        setattr(model.config, key, value)
    trainer = check_losses(model, _text_cls_data(kind, k), tmp_path)
    assert trainer.task == "sequence_classification"


def test_router_aux_loss_is_refused():
    """With output_router_logits=True a MoE model's own loss adds a batch-level load-balancing term: refused."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from hf_dp.losses import default_per_example_loss

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=1)
    model = MixtralForCausalLM(cfg)
    assert default_per_example_loss(model)[1] == "causal_lm"
    model.config.output_router_logits = True
    with pytest.raises(ValueError, match="output_router_logits"):
        default_per_example_loss(model)
    model.config.output_router_logits = False
    model.config.z_loss_coefficient = 0.01  # Bamba's batch-averaged z-loss
    with pytest.raises(ValueError, match="z_loss_coefficient"):
        default_per_example_loss(model)


def test_whisper_loss_is_the_models_own(tmp_path, float64_default):
    """Speech seq2seq: Whisper builds decoder inputs with its module's shift_tokens_right(labels, pad, start)."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(11)
    cfg = WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, d_model=16, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24,
                        max_source_positions=8, max_target_positions=16, pad_token_id=1, bos_token_id=0,
                        eos_token_id=2, decoder_start_token_id=3, dropout=0.0, attention_dropout=0.0,
                        activation_dropout=0.0)
    model = WhisperForConditionalGeneration(cfg)
    for name, p in model.named_parameters():  # convolutions, positional tables read directly: other branches
        if "conv" in name or "embed_positions" in name:
            p.requires_grad_(False)
    g = torch.Generator().manual_seed(11)
    labels = seq2seq_dataset(3, seed=11)["labels"]
    data = Dataset.from_dict({"input_features": torch.randn(3, 8, 16, generator=g, dtype=torch.float64).tolist(),
                              "labels": labels})
    trainer = check_losses(model, data, tmp_path)
    assert trainer.task == "seq2seq_lm"


def test_encoder_decoder_without_teacher_forcing_shift_is_refused():
    """An encoder-decoder with no shift of its own (e.g. Dia's multi-codebook decoder) trains some other loss: no
    default (a custom per_example_loss then gets ``labels=`` passed to the model, which builds its decoder inputs)."""
    from transformers import BartConfig, BartForConditionalGeneration

    from hf_dp.losses import default_per_example_loss

    no_shift = type("NoShiftForConditionalGeneration", (BartForConditionalGeneration,),
                    {"prepare_decoder_input_ids_from_labels": None, "__module__": __name__})
    with pytest.raises(ValueError, match="no default per-example loss for NoShiftForConditionalGeneration"):
        default_per_example_loss(no_shift(BartConfig(**S2S)))


def test_unshifted_causal_heads_get_the_unshifted_loss(tmp_path):
    """BartForCausalLM (like TrOCR, WhisperForCausalLM, Marian/MBart/Pegasus ForCausalLM) does *not* shift its labels:
    its own loss is labels[t] against logits[t]. hf_dp's default follows it (shifting again would train another
    objective); GPT-2/Llama-style heads keep the shifted loss."""
    from helpers import lm_dataset, tiny_gpt2
    from transformers import BartConfig, BartForCausalLM

    from hf_dp.losses import default_per_example_loss

    torch.manual_seed(12)
    model = freeze_refused(BartForCausalLM(BartConfig(**S2S, is_decoder=True, is_encoder_decoder=False)))
    trainer = check_losses(model, lm_dataset(4, pad_id=1, seed=12), tmp_path)
    assert trainer.task == "causal_lm_unshifted"
    assert default_per_example_loss(tiny_gpt2())[1] == "causal_lm"


def test_causal_head_with_another_loss_is_refused():
    from transformers import XLMConfig, XLMWithLMHeadModel

    from hf_dp.losses import default_per_example_loss

    model = XLMWithLMHeadModel(XLMConfig(vocab_size=VOCAB, emb_dim=16, n_layers=1, n_heads=2))
    with pytest.raises(ValueError, match="XLMWithLMHeadModel's own loss is not"):
        default_per_example_loss(model)


# ---------------------------------------------------------------------- checked at the first step, on every model
def _llama_with_an_extra_loss_term():
    """A causal LM whose own loss adds a term hf_dp's default causal-LM loss does not know (like a z-loss or an
    auxiliary loss a custom model adds): the plain Trainer would train loss + 50·mean(logits²)."""
    from helpers import tiny_llama
    from transformers import LlamaForCausalLM

    class ExtraTermLlamaForCausalLM(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
            if out.loss is not None:
                out.loss = out.loss + 50 * out.logits.float().pow(2).mean()
            return out

    torch.manual_seed(0)
    model = ExtraTermLlamaForCausalLM(tiny_llama().config)
    return model


def test_a_model_whose_own_loss_differs_from_the_default_is_refused_before_any_release(tmp_path):
    """The first-step check compares hf_dp's default per-example loss with the model's own loss on one example
    alone, whatever the architecture: a mismatch is refused, naming the fix, before anything is released."""
    from helpers import assert_refused_before_any_release, lm_dataset

    trainer = DPTrainer(model=_llama_with_an_extra_loss_term(), train_dataset=lm_dataset(4, seed=1),
                        args=dp_args(tmp_path, 2, 1, 1.0))
    assert_refused_before_any_release(trainer, "differs from the loss the model's own forward returns")


def test_a_loss_of_your_own_that_reproduces_the_models_loss_is_not_compared(tmp_path):
    """With ``per_example_loss=`` the user states the objective: no comparison (a custom loss need not be the
    model's), and training runs."""
    from helpers import lm_dataset

    from hf_dp import causal_lm_loss

    def with_term(outputs, labels):
        return causal_lm_loss(outputs, labels) + 50 * outputs.logits.float().pow(2).mean((1, 2))

    trainer = DPTrainer(model=_llama_with_an_extra_loss_term(), train_dataset=lm_dataset(4, seed=1),
                        args=dp_args(tmp_path, 2, 1, 1.0), per_example_loss=with_term)
    trainer.train()
    assert trainer.accountant.steps == 1
