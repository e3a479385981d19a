"""Large vocabularies (issue #24, item 3): ``lm_loss_chunk_size`` applies the LM head to a few positions at a time.

Oracle: the model's own loss on a batch of one, differentiated by autograd in float64 (σ = 0, q = 1, SGD lr 1: the
update is minus the released gradient) — the chunked loss must change nothing but memory. Memory is tested by what
the autograd graph keeps (no saved tensor of batch × length × vocabulary elements), never by a measurement.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import VOCAB, assert_refused_before_any_release, check_exact, dp_args, lm_dataset, tiny_gpt2, tiny_llama
from helpers.chat import make_sft_trainer, sft_args, sft_dataset, sft_dp_update

from hf_dp import DPTrainer, DPTrainingArguments, causal_lm_loss

CHUNK = 3  # does not divide the length (10): the last chunk is shorter


class HeadCalls:
    """The positions each call of the LM head saw (a forward hook: the head's own calls, not the engine's)."""

    def __init__(self, head):
        self.lengths: list[int] = []
        head.register_forward_hook(lambda _m, args, _out: self.lengths.append(args[0].shape[1]))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("arch", ["llama", "gpt2_tied"])
def test_chunked_loss_is_exact(tmp_path, arch, clipping, checkpointing):
    """GPT-2's head is tied to its token embedding: one parameter used by the embedding and by every chunk."""
    torch.manual_seed(0)
    model = tiny_llama() if arch == "llama" else tiny_gpt2(tied=True)
    calls = HeadCalls(model.get_output_embeddings())
    extra = dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}) \
        if checkpointing else {}
    if checkpointing and clipping == "flat":
        extra["flat_clipping_passes"] = "one"  # book-keeping, exact to round-off (two passes: the test below)
    check_exact(model, lm_dataset(6, seed=3), tmp_path, clipping=clipping, lm_loss_chunk_size=CHUNK, **extra)
    assert sorted(calls.lengths).count(1) >= 2  # chunks of 3, 3, 3, 1 (the oracle's calls see all 10 positions)


def test_chunked_loss_exact_with_lora(tmp_path):
    from peft import LoraConfig, TaskType, get_peft_model

    torch.manual_seed(2)
    model = get_peft_model(tiny_llama().double(), LoraConfig(
        task_type=TaskType.CAUSAL_LM, r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
        modules_to_save=["lm_head"]))
    with torch.no_grad():  # LoRA's B starts at 0 (A would get no gradient): randomise it
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    check_exact(model, lm_dataset(6, seed=2), tmp_path, lm_loss_chunk_size=4)


def test_chunked_loss_exact_with_logit_softcapping(tmp_path):
    """Gemma 2 caps its logits (``final_logit_softcapping``) between the head and the loss."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(3)
    model = Gemma2ForCausalLM(Gemma2Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=32, final_logit_softcapping=0.5,
        bos_token_id=0, eos_token_id=0, pad_token_id=0))
    check_exact(model, lm_dataset(4, seed=5), tmp_path, lm_loss_chunk_size=CHUNK, rtol=1e-4)  # float32 norms inside


@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
def test_dp_sft_with_chunked_loss_is_exact(tmp_path, packing):
    """DP-SFT (trl's completion-only labels). Packed: the chunks of a padding-free row cut across its examples, and
    most chunks hold tokens of some examples only; each call of the head is split per packed example over the
    positions it sees."""
    torch.manual_seed(0)
    trainer = make_sft_trainer(tiny_llama().double(), sft_dataset("prompt_completion"),
                               sft_args(tmp_path, packing=packing, lm_loss_chunk_size=5))
    assert trainer.padding_free is packing
    calls = HeadCalls(trainer.model.get_output_embeddings())
    update, expected = sft_dp_update(trainer, list(range(4)), expected_batch=4)
    for k in expected:
        torch.testing.assert_close(update[k], expected[k], rtol=1e-5, atol=1e-8, msg=k)
    assert calls.lengths and min(calls.lengths) <= 5


def _saved_sizes(trainer) -> list[int]:
    """The sizes of every tensor the autograd graph saved for the backward during training."""
    sizes: list[int] = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.train()
    return sizes


@pytest.mark.parametrize("chunk", [None, 4], ids=["full_logits", "chunked"])
def test_no_batch_by_length_by_vocabulary_tensor_is_kept_for_the_backward(tmp_path, chunk):
    """The memory regression test: unchunked, the log-softmax of the whole (B, T, V) logits is saved for the
    backward; chunked, each chunk's are recomputed, and nothing of B·T·V elements is kept."""
    torch.manual_seed(0)
    data = lm_dataset(4, seed=1)
    trainer = DPTrainer(model=tiny_llama().double(), train_dataset=data,
                        args=dp_args(tmp_path, 4, 1, 1.0, lm_loss_chunk_size=chunk))
    full = 4 * 10 * VOCAB
    largest = max(_saved_sizes(trainer))
    assert (largest >= full) if chunk is None else (largest < full)


# ---------------------------------------------------------------------- refused, with the reason
@pytest.mark.parametrize("arch", ["cohere", "granite"])
def test_chunked_loss_exact_with_scaled_logits(tmp_path, arch):
    """Cohere multiplies its logits by ``logit_scale``, Granite divides them by ``config.logits_scaling``, between
    the head and the loss: the chunked loss applies the same constant (``chunked_loss.logit_scaling``)."""
    from transformers import CohereConfig, CohereForCausalLM, GraniteConfig, GraniteForCausalLM

    cfg_cls, model_cls, scale = ((CohereConfig, CohereForCausalLM, dict(logit_scale=0.25)) if arch == "cohere"
                                 else (GraniteConfig, GraniteForCausalLM, dict(logits_scaling=4.0)))
    torch.manual_seed(0)
    model = model_cls(cfg_cls(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0, **scale))
    rtol = 1e-5 if arch == "cohere" else 1e-7  # CohereLayerNorm normalises in float32 (also unchunked)
    check_exact(model, lm_dataset(4, seed=1), tmp_path, lm_loss_chunk_size=CHUNK, rtol=rtol)


def _logits_transformed():
    """A tiny Llama whose forward scales the logits it returns: a step between the head and the loss that the chunked
    loss does not know of (its loss is passed as ``causal_lm_loss``: no default loss for the subclass)."""
    from transformers import LlamaForCausalLM

    class LogitsTransformed(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
            out.logits = out.logits * 0.25
            return out

    return LogitsTransformed(tiny_llama().config).double()


def test_a_model_whose_forward_transforms_the_logits_is_refused_before_any_release(tmp_path):
    """A forward that scales its logits between the head and the loss in a way the chunked loss does not reproduce:
    the first-step check compares it with the model's own forward and refuses."""
    torch.manual_seed(0)
    trainer = DPTrainer(model=_logits_transformed(), train_dataset=lm_dataset(4, seed=1),
                        args=dp_args(tmp_path, 2, 1, 1.0, lm_loss_chunk_size=4), per_example_loss=causal_lm_loss)
    assert_refused_before_any_release(trainer, "differs from the loss of the model's own forward")


def test_a_loss_of_your_own_is_refused_at_train_start(tmp_path):
    def my_loss(outputs, labels):
        return causal_lm_loss(outputs, labels) * 2

    trainer = DPTrainer(model=tiny_llama(), train_dataset=lm_dataset(4), per_example_loss=my_loss,
                        args=dp_args(tmp_path, 2, 1, 1.0, lm_loss_chunk_size=4))
    with pytest.raises(ValueError, match="not the causal-LM next-token loss"):
        trainer.train()
    assert trainer.accountant.steps == 0


def test_prompt_learning_and_bad_sizes_are_refused(tmp_path):
    from peft import PromptTuningConfig, TaskType, get_peft_model

    model = get_peft_model(tiny_llama(), PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=2))
    with pytest.raises(ValueError, match="prompt-learning adapter"):
        DPTrainer(model=model, train_dataset=lm_dataset(4), args=dp_args(tmp_path, 2, 1, 1.0, lm_loss_chunk_size=4))
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="lm_loss_chunk_size must be a positive"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, lm_loss_chunk_size=bad)


def test_the_first_step_check_compares_a_long_row_on_its_first_positions(tmp_path):
    """The check's full logits of a long row would be what chunking avoids holding: it compares the first positions
    (where a target remains), and the whole row otherwise."""
    from hf_dp.chunked_loss import ChunkedLMLoss

    chunked = ChunkedLMLoss(tiny_llama(), chunk_size=4)
    ids = torch.arange(40).view(1, 40)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
    labels = ids.clone()
    cut, cut_labels = chunked.check_batch(batch, labels, longest=16)
    assert cut["input_ids"].shape == (1, 16) and cut["attention_mask"].shape == (1, 16) and cut_labels.shape == (1, 16)
    assert cut["use_cache"] is False
    masked = labels.clone()
    masked[:, :30] = -100  # only the end is trained: compared on the whole row
    assert chunked.check_batch(batch, masked, longest=16)[1].shape == (1, 40)
    assert chunked.check_batch(batch, labels, longest=64)[1].shape == (1, 40)


@pytest.mark.parametrize("reentrant", [None, False, True], ids=["plain", "nonreentrant", "reentrant"])
@pytest.mark.parametrize("arch", ["llama", "gpt2_tied"])
def test_the_heads_group_is_clipped_once_inside_the_backward(arch, reentrant):
    """A chunk re-run by the backward is a recompute, not a new call of the head (the chunk's output marks the start
    of the backward: ``Recorder.backward_starts_at``); otherwise the head's group would wait for a use that never
    comes and be clipped only after the backward, keeping its factors to the end."""
    from hf_dp.chunked_loss import ChunkedLMLoss
    from hf_dp.clipping.engine import ClippingEngine
    from hf_dp.clipping.modes import build_groups

    torch.manual_seed(0)
    model = (tiny_llama() if arch == "llama" else tiny_gpt2(tied=True)).double()
    model.config.use_cache = False
    if reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    ids = torch.randint(2, VOCAB, (3, 10), generator=torch.Generator().manual_seed(0))
    engine = ClippingEngine(model)
    groups = [g.params for g in build_groups(engine, "per_layer")]
    head = [k for k, names in enumerate(groups) if any("lm_head" in n or "wte" in n for n in names)]
    clipped, after, done = [], [], []

    def handler(k, _norms):
        (after if done else clipped).append(k)
        return torch.ones(3, dtype=torch.float64)

    engine.set_fused_groups(groups, handler)
    recorder = engine.recorder
    with engine.record(3):
        losses = ChunkedLMLoss(model, CHUNK)(model, {"input_ids": ids}, ids, causal_lm_loss,
                                             on_output=recorder.backward_starts_at, window=recorder.positions)
        losses.sum().backward()
        done.append(True)
        engine.finish_fused()
    assert head and [clipped.count(k) for k in head] == [1] * len(head)
    assert not [k for k in after if k in head]


def test_the_comparison_is_not_vacuous_when_the_first_row_has_no_target(tmp_path):
    """A logit scale the chunked loss does not reproduce is caught even when the first row of the first micro-batch
    has no labelled position (both losses would be 0): the comparison then scores the row's own tokens. (Here no row
    has one.)"""
    from datasets import Dataset

    torch.manual_seed(0)
    model = _logits_transformed()
    rows = lm_dataset(4, seed=1).to_dict()
    rows["labels"] = [[-100] * len(r) for r in rows["labels"]]
    trainer = DPTrainer(model=model, train_dataset=Dataset.from_dict(rows),
                        args=dp_args(tmp_path, 2, 1, 1.0, lm_loss_chunk_size=4), per_example_loss=causal_lm_loss)
    with pytest.raises(ValueError, match="differs from the loss of the model's own forward"):
        trainer.train()
    assert trainer.accountant.steps == 0


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_chunked_loss_with_two_pass_flat_clipping_is_exact(tmp_path, reentrant):
    """With checkpointing on, flat clipping runs in two passes (``flat_clipping_passes="auto"``): the chunked loss in
    both (pass 2 is the model's own backward of Σ c_i L_i; Llama's RMSNorm rounds in float32, hence 1e-5)."""
    torch.manual_seed(0)
    check_exact(tiny_llama(), lm_dataset(6, seed=3), tmp_path, lm_loss_chunk_size=CHUNK, rtol=1e-5,
                gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": reentrant})
