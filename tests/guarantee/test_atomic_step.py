"""A DP step is atomic (DESIGN invariant 11; ``clipping/step.py``): its partial state goes out whole with its noise
or is discarded, and a step drawn again is the same Poisson draw (``sampling.py``: the draw of DP step k is a
function of the run's seed and k). Also: the logged loss is the realised mean of the sampled examples' losses.

The updates are checked against the oracle (σ = 0, SGD with lr = 1 and a constant schedule, float64): the model's own
loss on a batch of one per example, clipped by the rule written out in ``tests/helpers/oracle.py``. The interruptions
are the ordinary ones: a ``KeyboardInterrupt`` or an exception between or inside gradient accumulation chunks followed
by ``train()`` again, a callback ending the epoch or the run between two chunks, and accelerate's
``find_executable_batch_size`` re-running the loop after an out-of-memory error.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from helpers import (
    cls_dataset,
    dp_args,
    flat_clipped_sum,
    lm_dataset,
    per_example_grads,
    single_example_loss,
    tiny_bert,
    tiny_gpt2,
)
from transformers import TrainerCallback

from hf_dp import DPTrainer, DPTrainingArguments

C = 1e-2  # every example is clipped: a gradient counted twice shows as a jump far above the rounding error
N = 6


def step_args(tmp_path, batch: int, ga: int, sigma: float = 0.0, **overrides) -> DPTrainingArguments:
    """``helpers.dp_args`` with C = ``C``, noise multiplier ``sigma``, nothing logged, no self-check: SGD with lr = 1
    and a constant schedule, θ₁ = θ₀ − Σ / (expected batch)."""
    base = dict(noise_multiplier=sigma, logging_strategy="no", dp_self_check=False)
    base.update(overrides)
    return dp_args(tmp_path, batch, ga, C, **base)


def bert() -> torch.nn.Module:
    torch.manual_seed(0)
    return tiny_bert().double()


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def oracle_sum(model: torch.nn.Module, data, indices: list[int]) -> dict[str, torch.Tensor]:
    """Σ_i clip(g_i) over ``indices``: each example's gradient of the model's own loss on a batch of one."""
    return flat_clipped_sum(per_example_grads(model, data, indices), C)


def assert_update_is(before, model, expected_batch: int, summed: dict[str, torch.Tensor]) -> None:
    for n, p in model.named_parameters():
        torch.testing.assert_close((before[n] - p.detach()) * expected_batch, summed[n], rtol=1e-7, atol=1e-12,
                                   msg=n)


def train(trainer: DPTrainer, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer.train(**kw)


class RaiseAtSubstep(TrainerCallback):
    """Raises ``error`` once, after the first chunk of the ``step``-th step (a KeyboardInterrupt in a notebook)."""

    def __init__(self, error: BaseException, step: int = 0):
        self.error, self.step, self.fired = error, step, False

    def on_substep_end(self, args, state, control, **kwargs):
        if not self.fired and state.global_step == self.step:
            self.fired = True
            raise self.error


class FailNextForward:
    """A forward pre-hook armed after the first chunk of step ``step``: the next forward (the step's second chunk)
    raises ``error`` once — an exception (or an out-of-memory error) from inside a chunk."""

    def __init__(self, model: torch.nn.Module, error: BaseException, step: int = 0):
        self.error, self.step, self.armed, self.fired = error, step, False, False
        model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        if self.armed and not self.fired:
            self.fired = True
            raise self.error

    def callback(self) -> TrainerCallback:
        hook = self

        class Arm(TrainerCallback):
            def on_substep_end(self, args, state, control, **kwargs):
                if state.global_step == hook.step and not hook.fired:
                    hook.armed = True

        return Arm()


class RecordDraws(DPTrainer):
    """Records every step's batch as the sorted dataset indices of its rows (all of a step's chunks)."""

    def get_batch_samples(self, epoch_iterator, num_batches, *args, **kwargs):
        batches, n = super().get_batch_samples(epoch_iterator, num_batches, *args, **kwargs)
        rows = {tuple(r): i for i, r in enumerate(self.train_dataset["input_ids"])}
        drawn = [rows[tuple(r.tolist())] for b in batches if "input_ids" in b for r in b["input_ids"]]
        self.draws = getattr(self, "draws", []) + [sorted(drawn)]
        return batches, n


def unique_rows(n: int):
    """Classification rows whose input_ids identify them (the first token is the index)."""
    data = cls_dataset(n, 3).to_dict()
    data["input_ids"] = [[3 + i] + ids[1:] for i, ids in enumerate(data["input_ids"])]
    from datasets import Dataset

    return Dataset.from_dict(data)


# ------------------------------------------------------------------------------------ interrupted, then train()
@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("a bug in a callback")])
def test_interrupted_between_chunks_then_train_again_releases_only_the_new_step(tmp_path, error, caplog):
    """q = 1, GA = 3: the first ``train()`` stops after chunk 1 of step 1 (the exception comes from a callback, not
    from the DP step); ``train()`` again releases exactly the oracle of its own step (every example once)."""
    data = unique_rows(N)
    trainer = DPTrainer(model=bert(), args=step_args(tmp_path, 2, 3), train_dataset=data,
                        callbacks=[RaiseAtSubstep(error)])
    before = params(trainer.model)
    with pytest.raises(type(error)):
        train(trainer)
    assert trainer.accountant.steps == 0 and all(torch.equal(before[k], v) for k, v in params(trainer.model).items())
    summed = oracle_sum(trainer.model, data, list(range(N)))
    with caplog.at_level("WARNING", logger="hf_dp.clipping.step"):
        train(trainer)
    assert "was discarded" in caplog.text
    assert trainer.accountant.steps == 1
    assert_update_is(before, trainer.model, N, summed)


def test_exception_inside_a_chunk_discards_the_step(tmp_path):
    """The second chunk's forward raises: the step is discarded as the exception escapes the DP step (nothing is
    left in the engine, even before the next ``train()``), and ``train()`` again releases the new step only."""
    data = unique_rows(N)
    model = bert()
    fail = FailNextForward(model, ValueError("boom"))
    trainer = DPTrainer(model=model, args=step_args(tmp_path, 2, 3), train_dataset=data, callbacks=[fail.callback()])
    before = params(model)
    with pytest.raises(ValueError, match="boom"):
        train(trainer)
    assert not trainer._dp_step.has_partial_step() and not trainer.clipping_engine.summed_grads
    summed = oracle_sum(model, data, list(range(N)))
    train(trainer)
    assert_update_is(before, model, N, summed)


def test_refusal_between_chunks_discards_the_step(tmp_path):
    """A parameter unfrozen between two chunks is refused (``guarantee.check_trainable_set_change``); the refusal
    escapes the step, which is discarded at once."""

    class UnfreezeBetweenChunks(TrainerCallback):
        def on_substep_end(self, args, state, control, **kwargs):
            trainer.model.bert.embeddings.word_embeddings.weight.requires_grad_(True)

    model = bert()
    model.bert.embeddings.word_embeddings.requires_grad_(False)
    trainer = DPTrainer(model=model, args=step_args(tmp_path, 2, 3), train_dataset=unique_rows(N),
                        callbacks=[UnfreezeBetweenChunks()])
    with pytest.raises(RuntimeError, match="middle of a DP step"):
        train(trainer)
    assert not trainer._dp_step.has_partial_step() and not trainer.clipping_engine.summed_grads


def test_fsdp_step_discards_its_pass_two_gradients(tmp_path):
    """Under FSDP a step's clipped sum lives in the sharded ``.grad`` (pass 2 is a plain backward of Σ c_i L_i): a
    discarded step drops it, and the first-step check it was part of is re-armed. (FSDP needs several processes:
    the strategy is built by hand here, as in test_step.py, and a chunk's pass-2 gradient is simulated.)"""
    from hf_dp.clipping.fsdp import FSDPFlatClipping

    trainer = DPTrainer(model=bert(), args=step_args(tmp_path, 2, 3), train_dataset=unique_rows(N))
    trainer.is_fsdp_enabled = True
    trainer._build_clipping()
    step = trainer._dp_step
    assert isinstance(step, FSDPFlatClipping)
    step._begin_chunk(trainer.model)  # a chunk ran ...
    step._checking = True
    for p in trainer.model.parameters():
        p.grad = torch.ones_like(p)  # ... and its pass-2 backward accumulated into .grad
    step.begin_step()  # the next step starts before this one was released
    assert all(p.grad is None for p in trainer.model.parameters())
    assert not step.has_partial_step() and not step._checking


# ------------------------------------------------------------------------------ callbacks that cut a step
class StopAtFirstSubstep(TrainerCallback):
    def __init__(self, flag: str):
        self.flag, self.fired = flag, False

    def on_substep_end(self, args, state, control, **kwargs):
        if not self.fired:
            self.fired = True
            setattr(control, self.flag, True)


def test_callback_ending_the_epoch_between_chunks_discards_the_step(tmp_path, caplog):
    """Epoch 1 is cut after chunk 1 of its only step; epoch 2's step is the same DP step (same draw) and releases
    exactly the oracle over every example once (q = 1)."""
    data = unique_rows(N)
    trainer = RecordDraws(model=bert(), args=step_args(tmp_path, 2, 3, max_steps=-1, num_train_epochs=2),
                          train_dataset=data, callbacks=[StopAtFirstSubstep("should_epoch_stop")])
    before = params(trainer.model)
    summed = oracle_sum(trainer.model, data, list(range(N)))
    with caplog.at_level("WARNING", logger="hf_dp.clipping.step"):
        train(trainer)
    assert "was discarded" in caplog.text
    assert trainer.accountant.steps == 1 and trainer.state.global_step == 1
    assert trainer.draws == [list(range(N))] * 2
    assert_update_is(before, trainer.model, N, summed)


def test_poisson_draw_after_an_epoch_cut_is_the_same_dp_step(tmp_path):
    """q = 1/2: the step cut by the callback and the step trained in its place are the same draw (DP step 0)."""
    data = unique_rows(16)
    trainer = RecordDraws(model=bert(), args=step_args(tmp_path, 2, 2, max_steps=-1, num_train_epochs=2),
                          train_dataset=data, callbacks=[StopAtFirstSubstep("should_epoch_stop")])
    train(trainer)
    assert trainer.accountant.steps == 4  # epoch 1: none (cut at its first step); epoch 2: its 4 steps
    assert trainer.draws[0] == trainer.draws[1] != trainer.draws[2]
    assert len({tuple(d) for d in trainer.draws[1:]}) == 4


def test_callback_ending_the_run_between_chunks_leaves_nothing_behind(tmp_path, caplog):
    data = unique_rows(N)
    trainer = DPTrainer(model=bert(), args=step_args(tmp_path, 2, 3), train_dataset=data,
                        callbacks=[StopAtFirstSubstep("should_training_stop")])
    before = params(trainer.model)
    with caplog.at_level("WARNING", logger="hf_dp.clipping.step"):
        train(trainer)
    assert "was discarded" in caplog.text and "training ended" in caplog.text
    assert trainer.accountant.steps == 0 and not trainer._dp_step.has_partial_step()
    assert all(torch.equal(before[k], v) for k, v in params(trainer.model).items())
    summed = oracle_sum(trainer.model, data, list(range(N)))
    train(trainer)
    assert_update_is(before, trainer.model, N, summed)


# ---------------------------------------------------------------------------- out of memory, retried
def oom() -> torch.cuda.OutOfMemoryError:
    """What accelerate's find_executable_batch_size retries on (utils/memory.py, should_reduce_batch_size)."""
    return torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_out_of_memory_retry_releases_only_the_retried_step(tmp_path, caplog):
    """``auto_find_batch_size``: step 1's second chunk runs out of memory; accelerate re-runs the loop with smaller
    micro-batches. The retried step releases exactly the oracle over every example once (q = 1)."""
    data = unique_rows(N)
    model = bert()
    fail = FailNextForward(model, oom())
    trainer = DPTrainer(model=model, args=step_args(tmp_path, 2, 3, auto_find_batch_size=True), train_dataset=data,
                        callbacks=[fail.callback()])
    before = params(model)
    summed = oracle_sum(model, data, list(range(N)))
    with caplog.at_level("WARNING", logger="hf_dp.clipping.step"):
        train(trainer)
    assert fail.fired and "OutOfMemoryError escaped" in caplog.text
    assert trainer.accountant.steps == 1
    assert_update_is(before, model, N, summed)


def test_out_of_memory_retry_redraws_the_same_batch_with_a_secret_seed(tmp_path):
    """q = 1/2 and a secret seed: step 2 runs out of memory in its second chunk; the step trained in its place
    after the retry is the same Poisson draw (the same DP step of the same run), not a fresh one. Its update is the
    oracle over that draw. (Whatever the secret seed, the draws compared are equal under the invariant.)"""
    data = unique_rows(16)
    model = bert()
    fail = FailNextForward(model, oom(), step=1)

    class Snapshot(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if fail.fired and not hasattr(self, "before"):
                self.before = params(model)
                self.summed = oracle_sum(model, data, trainer.draws[-1])

        def on_step_end(self, args, state, control, **kwargs):
            if hasattr(self, "before") and not hasattr(self, "after"):
                self.after = params(model)

    snap = Snapshot()
    trainer = RecordDraws(model=model, args=step_args(tmp_path, 4, 2, dp_seed=None, auto_find_batch_size=True,
                                                    max_steps=2), train_dataset=data,
                          callbacks=[fail.callback(), snap])
    train(trainer)
    assert fail.fired and len(trainer.draws) == 4  # step 1, step 2 (out of memory), retried: step 2, step 3
    assert trainer.draws[2] == trainer.draws[1] != trainer.draws[0]
    assert trainer.draws[3] not in trainer.draws[:3]
    for n, p in snap.after.items():
        torch.testing.assert_close((snap.before[n] - p) * 8, snap.summed[n], rtol=1e-7, atol=1e-12, msg=n)


# ---------------------------------------------------------------------------- draws across train() calls
def test_second_train_on_the_same_model_never_replays_the_first_runs_draws(tmp_path):
    """With a fixed dp_seed, the draws of DP steps 1-3 and 4-6 (two ``train()`` calls on one model) differ: the
    accountant's composition assumes independent draws."""
    trainer = RecordDraws(model=bert(), args=step_args(tmp_path, 4, 2, max_steps=3), train_dataset=unique_rows(16))
    train(trainer)
    train(trainer)
    assert trainer.accountant.steps == 6 and len(trainer.draws) == 6
    first, second = trainer.draws[:3], trainer.draws[3:]
    assert not any(d in first for d in second)


@pytest.mark.parametrize("runs_before", [0, 1])
def test_resumed_run_draws_the_steps_it_would_have_drawn(tmp_path, runs_before):
    """Resuming inside an epoch (the Trainer skips the epoch's first batches and calls the sampler's ``set_epoch``)
    trains the draws of the DP steps the uninterrupted run drew, also when the checkpoint is of a model's second
    ``train()`` (its Trainer steps restart at 0, its DP steps do not); with ignore_data_skip as well."""
    data = unique_rows(16)
    args = dict(max_steps=3, save_strategy="steps", save_steps=1)
    whole = RecordDraws(model=bert(), args=step_args(tmp_path / "a", 1, 2, **args), train_dataset=data)
    for _ in range(runs_before + 1):
        train(whole)  # the last run's checkpoint-1 holds DP step 3 × runs_before + 1
    assert whole.steps_per_epoch == 8  # checkpoint-1 is inside the first epoch
    done = 3 * runs_before + 1
    for skip in (False, True):
        resumed = RecordDraws(model=bert(), args=step_args(tmp_path / "a", 1, 2, max_steps=3, ignore_data_skip=skip),
                              train_dataset=data)
        train(resumed, resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-1"))
        assert resumed.accountant.steps == done + 2
        assert resumed.draws == whole.draws[done:], skip


@pytest.mark.parametrize("kind", ["example", "user"])
def test_sampler_draw_is_a_function_of_seed_and_step(kind):
    """Two samplers started at DP steps 5 and 7 draw the same batches for steps 7 and 8; ``set_epoch`` (which
    transformers calls on a resumed run's sampler) no longer moves draws keyed by ``set_first_step``."""
    import numpy as np

    from hf_dp import PoissonBatchSampler, PoissonUserSampler

    def make():
        if kind == "user":
            return PoissonUserSampler(np.arange(64) % 20, 0.5, steps_per_epoch=4, num_chunks=2, seed=3)
        return PoissonBatchSampler(64, 0.5, steps_per_epoch=4, num_chunks=2, seed=3)

    a, b = make(), make()
    a.set_first_step(5)
    b.set_first_step(7)
    b.set_epoch(3)
    first, second = list(a), list(b)
    assert first[4:] == second[:4]  # steps 7 and 8
    assert first[:4] != second[:4] and a.last_step == 8 and b.last_step == 10
    c = make()
    c.set_epoch(1)  # standalone: epoch e starts at step e × steps_per_epoch (here steps 4-7)
    assert list(c)[2:] == first[:6] and c.last_step == 7


# --------------------------------------------------------------------------------------------- the logged loss
def test_logged_loss_is_the_realised_mean_with_accumulation_and_empty_steps(tmp_path):
    """GA = 2, q = 1/4 over 8 examples, lr = 0 (θ fixed, so each example's loss is the model's own loss on a batch of
    one at θ₀), logging every 3 steps: each logged loss is the mean over the examples sampled in its window's steps
    (computed independently from the recorded draws), a window with an empty step included; ``train_loss`` is the
    mean over the run's sampled examples. The fixed dp_seed leaves a step of each window empty (asserted)."""
    torch.manual_seed(0)
    model = tiny_gpt2().double()
    data = lm_dataset(8)
    trainer = RecordDraws(model=model, args=step_args(tmp_path, 1, 2, sigma=1.0, max_steps=6, learning_rate=0.0,
                                                    logging_strategy="steps", logging_steps=3, dp_seed=0),
                          train_dataset=data)
    out = train(trainer)
    model.eval()
    with torch.no_grad():
        loss_of = [float(single_example_loss(model, {k: torch.tensor([data[i][k]]) for k in data.column_names}))
                   for i in range(len(data))]
    draws = trainer.draws
    assert len(draws) == 6 and [] in draws[:3] and [] in draws[3:], draws  # an empty step in each window
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    windows = [draws[:3], draws[3:]]
    expected = [sum(loss_of[i] for d in w for i in d) / sum(len(d) for d in w) for w in windows]
    assert logged == pytest.approx(expected, rel=1e-9)
    everything = [i for d in draws for i in d]
    run_mean = sum(loss_of[i] for i in everything) / len(everything)
    assert out.training_loss == pytest.approx(run_mean, rel=1e-9)
    assert trainer.state.log_history[-1]["train_loss"] == pytest.approx(run_mean, rel=1e-9)


def test_window_of_empty_steps_logs_no_loss():
    from hf_dp.clipping.step import RealisedLoss

    log = RealisedLoss()
    log.add(torch.tensor([0.0, 0.0], dtype=torch.float64))
    assert log.pop_window() is None and log.run_mean() is None
    log.add(torch.tensor([3.0, 2.0], dtype=torch.float64))
    log.add(torch.tensor([0.0, 0.0], dtype=torch.float64))
    assert log.pop_window() == 1.5 and log.pop_window() is None and log.run_mean() == 1.5
    assert math.isfinite(log.run_mean())


def test_a_batch_drawn_for_another_step_is_refused_before_training(tmp_path):
    """If the sampler and the Trainer's loop ever disagree (here a callback after hf_dp's restarts the draws at
    DP step 0 in a second ``train()``), the step is refused before anything of it is trained or released."""

    class ReplayDraws(TrainerCallback):
        def on_epoch_begin(self, args, state, control, **kwargs):
            trainer._dp_sampler.set_first_step(0)

    trainer = DPTrainer(model=bert(), args=step_args(tmp_path, 4, 2, max_steps=2), train_dataset=unique_rows(16))
    trainer.add_callback(ReplayDraws())  # after hf_dp's own callback
    train(trainer)
    before = params(trainer.model)
    with pytest.raises(RuntimeError, match="Poisson draw of DP step 0, but the model is at DP step 2"):
        train(trainer)
    assert trainer.accountant.steps == 2 and all(torch.equal(before[k], v) for k, v in params(trainer.model).items())
