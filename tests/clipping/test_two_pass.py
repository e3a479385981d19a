"""Flat clipping in two passes (issue #24, item 1; ``hf_dp/clipping/two_pass.py``): norms in the recorded backward
(each layer's factors dropped at once), then a second forward and an ordinary backward of ``Σ_u c_u L_u``.

Oracle: the model's own loss on a batch of one, differentiated by autograd in float64 on the model *without*
checkpointing (σ = 0, q = 1, SGD with lr = 1: the update is minus the released gradient divided by the batch).
"""

from __future__ import annotations

import math
import warnings
import weakref
from types import SimpleNamespace

import pytest
import torch
from helpers import (
    automatic_clipped_sum,
    dp_args,
    example_norms,
    flat_clipped_sum,
    lm_dataset,
    lora_llama,
    make_sft_trainer,
    per_example_grads,
    sampled_users,
    sft_args,
    sft_dataset,
    sft_dp_update,
    tiny_gpt2,
    tiny_llama,
    user_args,
    user_data,
    user_gradients,
)
from helpers.neighbours import C, assert_neighbours_within_c, neighbour_args, params, regression_data, regression_model

from hf_dp import DPTrainer, DPTrainingArguments
from hf_dp.clipping import two_pass
from hf_dp.clipping.sums import ClippedSums

CHECKPOINTING = ["off", "nonreentrant", "reentrant"]


class PassCounter:
    """Counts pass 2's runs (``two_pass.clipped_backward``) while it is installed."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = two_pass.clipped_backward

        def spy(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr("hf_dp.clipping.local.clipped_backward", spy)


def ckpt_kw(checkpointing: str) -> dict:
    if checkpointing == "off":
        return {}
    return dict(gradient_checkpointing=True,
                gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})


def one_step(model, data, tmp_path, expected: dict, n: int, per_device: int, ga: int, max_norm: float,
             rtol: float = 1e-7, **kw):
    """One DP step over all of ``data`` equals ``expected / n``; returns the trainer. ``rtol``: Llama's RMSNorm computes
    in float32 inside a float64 model, so pass 2's backward of ``Σ c_i L_i`` rounds the scaled gradients there (as any
    backward of that model does), where book-keeping scales rounded per-example factors in float64 afterwards."""
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    trainer = DPTrainer(model=model, args=dp_args(tmp_path, per_device, ga, max_norm, **kw), train_dataset=data)
    trainer.train()
    assert trainer.accountant.steps == 1
    for k, p in model.named_parameters():
        target = expected[k] / n if p.requires_grad else torch.zeros_like(p)
        atol = rtol * float(target.abs().max()) if rtol > 1e-7 else 1e-10
        torch.testing.assert_close(before[k] - p.detach(), target, rtol=rtol, atol=atol, msg=k)
    return trainer


@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
def test_llama_two_pass_exact(tmp_path, monkeypatch, checkpointing):
    """Full fine-tuning, gradient accumulation (2 chunks of 3): exact against the oracle, with checkpointing on
    (reentrant, non-reentrant) and off; pass 2 ran once per micro-batch."""
    torch.manual_seed(0)
    model = tiny_llama().double()
    data = lm_dataset(6, seed=4)
    grads = per_example_grads(model, data, list(range(6)))
    c = sorted(example_norms(grads))[3]  # some examples clipped, some not
    counter = PassCounter(monkeypatch)
    one_step(model, data, tmp_path, flat_clipped_sum(grads, c), 6, 3, 2, c, rtol=1e-6, flat_clipping_passes="two",
             **ckpt_kw(checkpointing))
    assert counter.calls == 2


@pytest.mark.parametrize("checkpointing", ["nonreentrant", "reentrant"])
def test_lora_two_pass_exact(tmp_path, checkpointing):
    torch.manual_seed(2)
    model = lora_llama(tiny_llama().double())
    data = lm_dataset(6, seed=2)
    grads = per_example_grads(model, data, list(range(6)))
    c = sorted(example_norms(grads))[3]
    one_step(model, data, tmp_path, flat_clipped_sum(grads, c), 6, 3, 2, c, rtol=1e-6, **ckpt_kw(checkpointing))


def test_gpt2_tied_automatic_clipping_two_pass_exact(tmp_path):
    """Tied wte / lm_head, automatic clipping C/(‖g‖+γ), two passes chosen by "auto" from checkpointing."""
    torch.manual_seed(1)
    model = tiny_gpt2(tied=True).double()
    data = lm_dataset(6, seed=1)
    grads = per_example_grads(model, data, list(range(6)))
    one_step(model, data, tmp_path, automatic_clipped_sum(grads, 0.5, 0.05), 6, 3, 2, 0.5,
             clipping_function="automatic", automatic_clipping_gamma=0.05, **ckpt_kw("nonreentrant"))


@pytest.mark.parametrize("contribution", ["mean", "sum"])
def test_user_level_two_pass_exact(tmp_path, monkeypatch, contribution):
    """User-level DP: each user's (weighted) sum clipped as one unit; pass 2's loss is Σ_i c_{u(i)} w_i L_i."""
    torch.manual_seed(0)
    model = tiny_gpt2().double()
    indices, owners = sampled_users()
    data = user_data()
    grads = per_example_grads(model, data, indices)
    max_norm = sorted(example_norms(grads))[len(indices) // 2] / 2
    expected = {n: torch.zeros_like(t) for n, t in grads[0].items()}
    for g_u in user_gradients(grads, owners, contribution):
        factor = min(1.0, max_norm / (math.sqrt(sum(float(t.pow(2).sum()) for t in g_u.values())) + 1e-6))
        for n in expected:
            expected[n] += factor * g_u[n]
    counter = PassCounter(monkeypatch)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    DPTrainer(model=model, args=user_args(tmp_path, user_contribution=contribution, per_sample_max_grad_norm=max_norm,
                                          flat_clipping_passes="two"), train_dataset=data).train()
    assert counter.calls >= 1
    for k, p in model.named_parameters():
        torch.testing.assert_close(before[k] - p.detach(), expected[k] / 3, rtol=1e-7, atol=1e-10, msg=k)


def test_nan_example_two_pass_equals_the_finite_oracle(tmp_path, monkeypatch):
    """A NaN regression label (its loss and gradient are NaN): factor 0, and 0 · NaN does not poison the sum — the
    micro-batch is clipped by book-keeping instead of pass 2; the update is the oracle over the finite examples and
    the example is counted."""
    data = regression_data(5)
    model = regression_model()
    grads = per_example_grads(model, data, [0, 1, 3, 4])
    counter = PassCounter(monkeypatch)
    trainer = DPTrainer(model=model, args=neighbour_args(tmp_path, 5, dp_self_check=False, flat_clipping_passes="two"),
                        train_dataset=data)
    before = params(model)
    trainer.train()
    expected = flat_clipped_sum(grads, C)
    for n, p in model.named_parameters():
        torch.testing.assert_close((before[n] - p.detach()) * 5, expected[n], rtol=1e-7, atol=1e-12, msg=n)
    assert trainer.nonfinite_examples == 1
    assert counter.calls == 0  # the one micro-batch held the NaN example: book-keeping


def test_neighbours_within_c_two_pass(tmp_path):
    """‖Σ_D − Σ_D′‖ ≤ C with two passes (BERT, every example clipped), with checkpointing on."""
    assert_neighbours_within_c(tmp_path, flat_clipping_passes="two", gradient_checkpointing=True)


def test_an_exception_in_pass_two_discards_the_step(tmp_path, monkeypatch):
    """The atomic step (DESIGN invariant 11): pass 2 raises after its backward wrote ``.grad`` (the accumulator):
    the step is discarded — no clipped sum held, no ``.grad`` left, nothing counted."""
    real = two_pass.backward_clipped_loss

    def raising(*args, **kwargs):
        real(*args, **kwargs)
        raise RuntimeError("interrupted in pass 2")

    monkeypatch.setattr(two_pass, "backward_clipped_loss", raising)
    torch.manual_seed(0)
    model = tiny_llama().double()
    trainer = DPTrainer(model=model, args=dp_args(tmp_path, 3, 2, 1.0, flat_clipping_passes="two"),
                        train_dataset=lm_dataset(6, seed=4))
    with pytest.raises(RuntimeError, match="interrupted in pass 2"):
        trainer.train()
    assert not trainer.clipping_engine.summed_grads and not trainer._dp_step.has_partial_step()
    assert all(p.grad is None for p in model.parameters())
    assert trainer.accountant.steps == 0


def test_dropout_pass_two_draws_pass_one_masks(tmp_path):
    """With dropout on, pass 2's forward draws the masks pass 1 drew (the random state is restored): the two-pass
    update equals the one-pass update, and the random state after the step is the same."""
    data = lm_dataset(6, seed=5)
    updates, states = [], []
    for passes in ("one", "two"):
        torch.manual_seed(5)
        model = tiny_gpt2(tied=False)
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.3
        model = model.double()
        before = {k: p.detach().clone() for k, p in model.named_parameters()}
        args = dp_args(tmp_path / passes, 3, 2, 0.05, seed=7, flat_clipping_passes=passes, **ckpt_kw("nonreentrant"))
        torch.manual_seed(6)
        DPTrainer(model=model, args=args, train_dataset=data).train()
        states.append(torch.get_rng_state())
        updates.append({k: before[k] - p.detach() for k, p in model.named_parameters()})
    for k in updates[0]:
        assert updates[0][k].abs().max() > 0, k
        torch.testing.assert_close(updates[1][k], updates[0][k], rtol=1e-9, atol=1e-12, msg=k)
    assert torch.equal(states[0], states[1])


def test_dp_sft_packed_two_pass_exact(tmp_path):
    """DP-SFT with packed segments (trl's default checkpointing on: "auto" picks two passes): each segment is one
    example, against its own loss on a batch of one."""
    pytest.importorskip("trl")
    torch.manual_seed(0)
    trainer = make_sft_trainer(tiny_llama().double(), sft_dataset("prompt_completion"),
                               sft_args(tmp_path, packing=True, gradient_checkpointing=True,
                                        flat_clipping_passes="auto"))
    assert two_pass.flat_clipping_passes(trainer.args, trainer.model) == 2
    update, expected = sft_dp_update(trainer, list(range(4)), 4)
    for n in expected:
        torch.testing.assert_close(update[n], expected[n], rtol=1e-5, atol=1e-8, msg=n)


@pytest.mark.parametrize("unit", ["row", "user-mean"])
def test_dpo_pairs_two_pass_equal_one_pass(tmp_path, monkeypatch, unit):
    """Preference rows (a pair's two sequences at i and B + i, one unit; ``StepPieces.unit_layout``,
    ``rows_per_example=2``), per row and per user (ann's two rows one unit): the two-pass update equals book-keeping's
    (which tests/trl_trainers/test_dpo.py holds to trl's loss on one row), and the logged loss is the same."""
    pytest.importorskip("trl")
    from helpers.preference import dpo_args, make_dpo_trainer, pairs

    kw = dict(privacy_unit="user", user_id_column="user", user_contribution="mean") if unit != "row" else {}
    updates, losses = [], []
    for passes in ("one", "two"):
        torch.manual_seed(0)
        model = tiny_llama().double()
        data = pairs(4, users=["ann", "bob", "ann", "cat"]) if kw else pairs(4)
        args = dpo_args(tmp_path / passes, per_device=3 if kw else 2, ga=1 if kw else 2, flat_clipping_passes=passes,
                        per_sample_max_grad_norm=0.05, **kw)
        trainer = make_dpo_trainer(model, data, args)
        counter = PassCounter(monkeypatch)
        before = {k: p.detach().clone() for k, p in model.named_parameters()}
        trainer.train()
        assert (counter.calls > 0) == (passes == "two")
        updates.append({k: before[k] - p.detach() for k, p in model.named_parameters()})
        losses.append(trainer.state.log_history[-1]["train_loss"])
    for k in updates[0]:
        assert updates[0][k].abs().max() > 0, k
        atol = 1e-6 * float(updates[0][k].abs().max())
        torch.testing.assert_close(updates[1][k], updates[0][k], rtol=1e-6, atol=atol, msg=k)
    assert losses[1] == pytest.approx(losses[0], rel=1e-12)


def _llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=61, hidden_size=16, intermediate_size=24, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("passes", ["one", "two"])
def test_pass_one_drops_the_factors_before_the_backward_ends(tmp_path, monkeypatch, passes):
    """Memory regression: when the recorded backward ends (the engine asks for the norms), how many recorded factors
    (the tensors of the uses handed to the sums) are still alive. One pass keeps every layer's (6 blocks × 7
    Linear layers + head + embedding); two passes keep none beyond the few the Gram cache holds (the last layers'
    inputs and output gradients, whose Grams a layer sharing them may reuse: ``norms._GRAM_CACHE`` entries)."""
    live: set = set()
    at_end: list[int] = []
    real_add, real_norms = ClippedSums.add_uses, ClippedSums.per_example_norms_sq

    def add_uses(self, uses):
        for u in uses:
            for t in (u.left, u.right):
                if isinstance(t, torch.Tensor) and t.is_floating_point():  # (an embedding's ids: the batch's)
                    key = object()
                    live.add(key)
                    weakref.finalize(t.untyped_storage(), live.discard, key)
        return real_add(self, uses)

    def norms(self):
        at_end.append(len(live))
        return real_norms(self)

    monkeypatch.setattr(ClippedSums, "add_uses", add_uses)
    monkeypatch.setattr(ClippedSums, "per_example_norms_sq", norms)
    torch.manual_seed(7)
    DPTrainer(model=_llama(6), args=dp_args(tmp_path, 4, 1, 1.0, flat_clipping_passes=passes, dp_self_check=False,
                                            **ckpt_kw("nonreentrant")), train_dataset=lm_dataset(4, seq_len=16)).train()
    assert at_end
    if passes == "one":
        assert at_end[-1] >= 6 * 7
    else:
        assert at_end[-1] <= 8  # norms._GRAM_CACHE = 4 entries, each an input and an output gradient at most


def test_auto_picks_two_passes_with_checkpointing_only():
    model = SimpleNamespace(is_gradient_checkpointing=False)
    args = SimpleNamespace(flat_clipping_passes="auto", world_size=1, gradient_checkpointing=False)
    assert two_pass.flat_clipping_passes(args, model) == 1
    args.gradient_checkpointing = True
    assert two_pass.flat_clipping_passes(args, model) == 2
    args.gradient_checkpointing, model.is_gradient_checkpointing = False, True  # on the model (peft's kbit prep)
    assert two_pass.flat_clipping_passes(args, model) == 2
    args.flat_clipping_passes = "one"
    assert two_pass.flat_clipping_passes(args, model) == 1
    args.flat_clipping_passes, model.is_gradient_checkpointing = "two", False
    assert two_pass.flat_clipping_passes(args, model) == 2


@pytest.mark.parametrize("kwargs, match", [
    (dict(flat_clipping_passes="three"), "flat_clipping_passes must be one of"),
    (dict(flat_clipping_passes="two", clipping="per_layer"), "applies to clipping='flat' only"),
    (dict(flat_clipping_passes="one", clipping="per_layer"), "applies to clipping='flat' only"),
])
def test_argument_errors(tmp_path, kwargs, match):
    with warnings.catch_warnings(), pytest.raises(ValueError, match=match):
        warnings.simplefilter("ignore")
        DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, use_cpu=True, **kwargs)


def test_one_pass_under_fsdp_is_refused():
    from hf_dp.clipping.fsdp import check_fsdp_supported

    args = SimpleNamespace(clipping="flat", privacy_unit="example", flat_clipping_passes="one",
                           activation_checkpointing=False, gradient_checkpointing=False)
    with pytest.raises(ValueError, match="always two-pass"):
        check_fsdp_supported(SimpleNamespace(fsdp_version=2, activation_checkpointing=False), args)


def test_a_forward_that_changes_between_the_passes_is_refused(tmp_path, monkeypatch):
    """Pass 1's factors bound pass 2's gradients only if pass 2 recomputes the same function of each example. A
    forward that changes between two calls on the same data (here: losses shifted once the random state has been
    restored for pass 2, as a generator of the model's own would shift them) is refused before anything is released."""
    from helpers import assert_refused_before_any_release

    from hf_dp.clipping.rules import UnsupportedLayerError

    state = {"pass2": False}
    restore = two_pass.RandomState.restore
    monkeypatch.setattr(two_pass.RandomState, "restore", lambda self: (state.update(pass2=True), restore(self))[1])
    example_losses = DPTrainer._example_losses
    monkeypatch.setattr(DPTrainer, "_example_losses",
                        lambda self, *a, **k: example_losses(self, *a, **k) * (1.5 if state["pass2"] else 1.0))
    torch.manual_seed(0)
    trainer = DPTrainer(model=tiny_llama().double(), train_dataset=lm_dataset(4, seed=1),
                        args=dp_args(tmp_path, 2, 1, 1.0, flat_clipping_passes="two"))
    assert_refused_before_any_release(trainer, "second forward of this micro-batch gave other per-example losses",
                                      UnsupportedLayerError)
