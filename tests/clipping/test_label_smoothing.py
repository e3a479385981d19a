"""``label_smoothing_factor`` (the official example scripts' ``--label_smoothing_factor 0.1``): DPTrainer trains
what the plain ``Trainer`` trains with it, per example.

The oracle is the plain ``transformers.Trainer``'s own ``compute_loss`` with the same ``label_smoothing_factor`` on
a batch of one (``helpers.trainer_loss``: its ``LabelSmoother``, shifted for causal LMs), float64, σ = 0, clipped and
summed by ``helpers.oracle``. The smoother sums ``-log p`` over the vocabulary in float32 (transformers'
``LabelSmoother``), hence rtol 1e-6 instead of 1e-7.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from helpers import (
    VOCAB,
    assert_refused_before_any_release,
    check_exact,
    cls_dataset,
    dp_args,
    image_cls,
    lm_dataset,
    seq2seq_dataset,
    t5_frozen_bias,
    tiny_bert,
    tiny_bert_mlm,
    tiny_bert_token_classification,
    tiny_gpt2,
    token_dataset,
    trainer_loss,
)
from helpers.neighbours import assert_neighbours_within_c

from hf_dp import DPTrainer, DPTrainingArguments
from hf_dp.losses import LabelSmoothedLoss, causal_lm_loss

EPS = 0.1
RTOL_SMOOTHED = 1e-6  # the Trainer's LabelSmoother sums over the vocabulary in float32


def _seq2seq_with_decoder_inputs(n: int) -> Dataset:
    """Rows as DataCollatorForSeq2Seq gives them: ``decoder_input_ids`` built from the labels by the model's own
    ``prepare_decoder_input_ids_from_labels`` (the Trainer pops ``labels`` before the forward when it smooths)."""
    model = t5_frozen_bias()
    data = seq2seq_dataset(n)
    return data.add_column("decoder_input_ids", model.prepare_decoder_input_ids_from_labels(
        labels=torch.tensor(data["labels"])).tolist())


def _tiny_vit():
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16,
                                               num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
                                               num_labels=3, hidden_dropout_prob=0.0,
                                               attention_probs_dropout_prob=0.0))


HEADS = {
    "image_classification": (_tiny_vit, lambda: image_cls(4)),
    "causal_lm": (tiny_gpt2, lambda: lm_dataset(4, seq_len=6)),
    "sequence_classification": (tiny_bert, lambda: cls_dataset(4, 3)),
    "token_classification": (tiny_bert_token_classification, lambda: token_dataset(4, 4)),
    "masked_lm": (tiny_bert_mlm, lambda: token_dataset(4, VOCAB)),
    "seq2seq_lm": (t5_frozen_bias, lambda: _seq2seq_with_decoder_inputs(4)),
}


@pytest.mark.parametrize("head", sorted(HEADS))
def test_label_smoothing_is_the_trainers_own_loss_per_example(tmp_path, head):
    build, data = HEADS[head]
    torch.manual_seed(0)
    model = build().double()
    trainer = check_exact(model, data(), tmp_path, rtol=RTOL_SMOOTHED, label_smoothing_factor=EPS,
                          oracle_loss=trainer_loss(model, tmp_path / "plain", label_smoothing_factor=EPS))
    assert isinstance(trainer.per_example_loss, LabelSmoothedLoss) and trainer.task == head


def test_smoothing_changes_the_update(tmp_path):
    """Not vacuous: the smoothed step differs from the unsmoothed one (same model, same data)."""
    updates = []
    for eps in (0.0, EPS):
        torch.manual_seed(0)
        model = tiny_gpt2().double()
        before = [p.detach().clone() for p in model.parameters()]
        DPTrainer(model=model, args=dp_args(tmp_path / str(eps), 4, label_smoothing_factor=eps),
                  train_dataset=lm_dataset(4, seq_len=6)).train()
        updates.append(torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters())]))
    assert not torch.allclose(updates[0], updates[1], rtol=1e-4, atol=0)


def test_neighbours_within_c_with_label_smoothing(tmp_path):
    """Adding or removing one example moves the summed clipped update by at most C, smoothing on."""
    assert_neighbours_within_c(tmp_path, label_smoothing_factor=EPS)


def test_multi_label_head_trains_unsmoothed_as_the_trainer_does(tmp_path):
    """transformers' Trainer turns smoothing off (with a warning) for a multi-label ``problem_type`` set before it
    is built; DPTrainer then trains the model's own (unsmoothed) loss too."""
    torch.manual_seed(0)
    model = tiny_bert()
    model.config.problem_type = "multi_label_classification"
    with pytest.warns(UserWarning, match="multi-label"):
        trainer = DPTrainer(model=model, args=dp_args(tmp_path, 2, label_smoothing_factor=EPS),
                            train_dataset=cls_dataset(4, 3))
    assert not isinstance(trainer.per_example_loss, LabelSmoothedLoss)


def _regression_data(n: int) -> Dataset:
    data = cls_dataset(n, 2)
    return data.map(lambda r: {"labels": float(r["labels"]) - 0.5})


def test_regression_head_with_smoothing_is_refused_before_any_release(tmp_path):
    """The Trainer's LabelSmoother gathers log p of an integer label: a regression head cannot be smoothed (the plain
    Trainer fails at its first loss). Refused at the first step, nothing released."""
    torch.manual_seed(0)
    trainer = DPTrainer(model=tiny_bert(num_labels=1), args=dp_args(tmp_path, 2, label_smoothing_factor=EPS),
                        train_dataset=_regression_data(4))
    assert_refused_before_any_release(trainer, "regression head: transformers' LabelSmoother smooths over integer")


def test_users_own_loss_wins_and_is_warned_about(tmp_path):
    """As the plain Trainer's compute_loss_func wins over its label smoother: the user's per_example_loss is trained
    as written, and the user is told once."""
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="is not applied to your per_example_loss") as record:
        trainer = DPTrainer(model=tiny_gpt2(), args=dp_args(tmp_path, 2, label_smoothing_factor=EPS),
                            train_dataset=lm_dataset(4), per_example_loss=causal_lm_loss)
    assert trainer.per_example_loss is causal_lm_loss
    assert sum("per_example_loss" in str(w.message) for w in record) == 1


def test_chunked_lm_head_with_smoothing_is_refused(tmp_path):
    with pytest.raises(ValueError, match="chunked LM head computes only each token's cross-entropy"):
        DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, label_smoothing_factor=EPS,
                            lm_loss_chunk_size=4, use_cpu=True)


def test_first_step_check_compares_with_the_trainers_label_smoother(tmp_path):
    """The first-step check compares the smoothed loss with transformers' own LabelSmoother on one example: a
    smoothed loss that drifts from it (here: the wrong alignment of a causal LM's labels) is refused."""
    torch.manual_seed(0)
    trainer = DPTrainer(model=tiny_gpt2(), args=dp_args(tmp_path, 2, label_smoothing_factor=EPS, dp_seed=1),
                        train_dataset=lm_dataset(4))
    wrong = trainer.per_example_loss
    wrong.targets = lambda labels, **kw: labels  # unshifted, where the Trainer shifts
    assert_refused_before_any_release(trainer, "differs from transformers' LabelSmoother")


@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
def test_dp_sft_smooths_as_trl_per_packed_example(tmp_path, packing):
    """trl's SFTTrainer (loss_type "nll") smooths with the Trainer's LabelSmoother, shifted. DPSFTTrainer trains that
    loss per example, packed or not: against trl's own ``compute_loss`` on each row alone (float64, σ = 0, q = 1)."""
    pytest.importorskip("trl")
    import copy
    import warnings

    from helpers import chat_tokenizer, make_sft_trainer, one_step_against_oracle, sft_args, sft_dataset, tiny_llama
    from trl import SFTConfig, SFTTrainer

    torch.manual_seed(0)
    model = tiny_llama().double()
    plain = copy.deepcopy(model)
    trainer = make_sft_trainer(model, sft_dataset("prompt_completion"),
                               sft_args(tmp_path, packing=packing, label_smoothing_factor=EPS))
    assert isinstance(trainer.per_example_loss, LabelSmoothedLoss) and trainer.padding_free is packing
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oracle = SFTTrainer(model=plain, processing_class=chat_tokenizer(),
                            train_dataset=sft_dataset("prompt_completion"),
                            args=SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to="none",
                                           bf16=False, max_length=64, label_smoothing_factor=EPS))
    grads = []
    params = {n: p for n, p in plain.named_parameters() if p.requires_grad}
    for row in oracle.train_dataset:
        plain.zero_grad(set_to_none=True)
        oracle.compute_loss(plain, oracle.data_collator([row])).backward()
        grads.append({n: p.grad.clone() for n, p in params.items()})
    update, expected = one_step_against_oracle(trainer, grads, expected_batch=4)
    for n in expected:
        torch.testing.assert_close(update[n], expected[n], rtol=1e-5, atol=1e-8, msg=n)


def test_dpo_ignores_label_smoothing_factor_as_trl_does(tmp_path):
    """trl's DPO loss never reads ``label_smoothing_factor`` (its own smoothing is ``label_smoothing``), so a DP-DPO
    run with it set trains exactly trl's DPO loss per row (here against a trl DPOTrainer with it set too)."""
    pytest.importorskip("trl")
    import copy

    from helpers import assert_updates_close, one_step_against_oracle, tiny_llama
    from helpers.preference import dpo_args, dpo_row_grads, dpo_trl_oracle, make_dpo_trainer, pairs

    torch.manual_seed(0)
    model = tiny_llama().double()
    args = dpo_args(tmp_path, label_smoothing_factor=EPS)
    oracle = dpo_trl_oracle(copy.deepcopy(model), pairs(), args, tmp_path, ref_model=copy.deepcopy(model))
    oracle.args.label_smoothing_factor = EPS
    grads = dpo_row_grads(oracle, list(range(4)))
    trainer = make_dpo_trainer(model, pairs(), args)
    assert trainer.per_example_loss == trainer.pair_losses
    update, expected = one_step_against_oracle(trainer, grads, expected_batch=4)
    assert_updates_close(update, expected)


def test_unshifted_causal_head_the_trainer_would_shift_is_refused_before_any_release(tmp_path):
    """BartForCausalLM's own loss reads labels unshifted (the user shifts them), but the Trainer's LabelSmoother
    shifts every class listed as a causal LM: the plain Trainer would train another alignment of the labels than the
    model's own loss. Refused at the first step, with that cause; nothing released."""
    from transformers import BartConfig, BartForCausalLM

    torch.manual_seed(0)
    model = BartForCausalLM(BartConfig(vocab_size=VOCAB, d_model=16, decoder_layers=1, decoder_attention_heads=2,
                                       decoder_ffn_dim=24, max_position_embeddings=32, dropout=0.0))
    trainer = DPTrainer(model=model, args=dp_args(tmp_path, 2, label_smoothing_factor=EPS),
                        train_dataset=lm_dataset(4))
    assert trainer.task == "causal_lm_unshifted"
    assert_refused_before_any_release(trainer, "BartForCausalLM's own loss reads its labels unshifted, but "
                                               "transformers' Trainer smooths them shifted")
