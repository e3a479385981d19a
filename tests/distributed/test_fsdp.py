"""FSDP2 (accelerate's FSDP plugin) with flat clipping: exact against the per-example oracle, noise once.

On CPU accelerate never enables FSDP (it silently runs DDP; accelerate/state.py), so the 2-process run goes through
the test-only shim ``tests/scripts/cpu_fsdp_shim.py``. The refusals and the "FSDP requested but not enabled"
warning are checked in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from helpers import SCRIPTS, flat_clipped_sum, free_port, lm_dataset, per_example_grads, tiny_gpt2
from safetensors.torch import load_file

from hf_dp import DPTrainer, DPTrainingArguments, PoissonBatchSampler, PrivacyAccountant
from hf_dp.clipping.fsdp import fsdp_requested

WORKER = str(SCRIPTS / "fsdp_worker.py")
C, N, SEED, SIGMA = 0.5, 16, 23, 1.5  # as in the worker



@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), WORKER, str(out)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    params = [torch.load(out / f"params_rank{r}.pt") for r in range(2)]
    infos = [json.load(open(out / f"info_rank{r}.json")) for r in range(2)]
    return out, params, infos


def _oracle_steps(q: float, expected_batch: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """Parameters after each step: union of both ranks' Poisson samples, clipped one example at a time (float64),
    summed, divided by qN, SGD with lr 1."""
    torch.manual_seed(0)
    model = tiny_gpt2().double()
    data = lm_dataset(N, seed=3)
    chunks = [list(PoissonBatchSampler(N, q, -(-N // expected_batch), num_chunks=2, seed=SEED, rank=r, world_size=2))
              for r in range(2)]
    out = []
    for s in range(steps):
        indices = [i for r in range(2) for chunk in chunks[r][2 * s:2 * s + 2] for i in chunk]
        total = flat_clipped_sum(per_example_grads(model, data, indices), C)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p -= total[n] / expected_batch
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


@pytest.mark.slow
def test_fsdp2_flat_clipping_exact_and_identical(fsdp_run):
    out, params, infos = fsdp_run
    info = infos[0]
    assert [i["world_size"] for i in infos] == [2, 2]
    assert info["is_fsdp_enabled"] and info["model_class"].startswith("FSDP") and info["sharded"]
    assert all(i["self_checked"] for i in infos)  # dp_self_check ran under FSDP (hooks vs autograd, singles)
    # Micro-batching happened (a chunk > per-device batch 2) and a rank ran padding micro-batches (weight 0).
    assert sum(i["stats"]["micro_batches"] - i["stats"]["padding"] for i in infos) > 4 * 2
    assert sum(i["stats"]["padding"] for i in infos) > 0
    assert infos[0]["stats"]["micro_batches"] == infos[1]["stats"]["micro_batches"]  # same number of collectives
    q, expected_batch = info["sample_rate"], info["expected_batch_size"]
    assert (q, expected_batch) == (0.5, 8)

    clean = [p["clean"] for p in params]
    for step in range(2):
        for k in clean[0][step]:
            assert torch.equal(clean[0][step][k], clean[1][step][k]), k  # one model: every rank sees the same
    torch.manual_seed(0)
    init = dict(tiny_gpt2().double().named_parameters())
    for step, ref in enumerate(_oracle_steps(q, expected_batch, 2)):
        for k, r in ref.items():
            torch.testing.assert_close(init[k] - clean[0][step][k], init[k] - r, rtol=1e-9, atol=1e-12,
                                       msg=f"step {step + 1}: {k}")

    # Checkpoints and the final save carry the privacy state (written on rank 0) and the trained weights.
    for d in ("checkpoint-1", "checkpoint-2", "final"):
        state = json.load(open(out / "clean" / d / "dp_state.json"))
        assert sum(int(r["steps"]) for r in state["accountant"]["history"]) == (1 if d == "checkpoint-1" else 2)
    reloaded = tiny_gpt2().double()
    reloaded.load_state_dict(load_file(out / "clean" / "final" / "model.safetensors"), strict=False)
    for k, v in reloaded.named_parameters():
        assert torch.equal(v.detach(), clean[0][1][k]), k


@pytest.mark.slow
def test_fsdp2_nonfinite_example_gets_factor_zero_without_poisoning_pass_two(fsdp_run):
    """One example's loss is NaN: it gets clipping factor 0, and pass 2 (a plain backward, where 0·NaN = NaN) runs on
    the finite examples only, on every rank: the update is finite and equals the oracle over the other examples."""
    _, params, infos = fsdp_run
    nan = [p["nan"][0] for p in params]
    for k in nan[0]:
        assert torch.isfinite(nan[0][k]).all() and torch.equal(nan[0][k], nan[1][k]), k
    assert all(i["nan_stats"].get("nonfinite_redo", 0) >= 1 for i in infos)  # every rank re-ran its forward
    assert sum(i["nan_nonfinite"] for i in infos) >= 1
    torch.manual_seed(0)
    model = tiny_gpt2().double()
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    data = lm_dataset(16, seed=3)
    first = data[0]["input_ids"][0]
    keep = [i for i in range(len(data)) if data[i]["input_ids"][0] != first]
    grads = per_example_grads(model, data, keep)
    expected = flat_clipped_sum(grads, 0.5)
    moved = False
    for k, v in expected.items():
        torch.testing.assert_close(init[k] - nan[0][k], v / 16, rtol=1e-9, atol=1e-12, msg=k)
        moved = moved or bool(v.abs().max() > 0)
    assert moved


@pytest.mark.slow
def test_fsdp2_use_outside_a_hooked_forward_is_refused_without_self_check(fsdp_run):
    """Pass 2 is a plain backward: a parameter used outside its layer's forward would leak its unclipped gradient
    into the update. The hooks-vs-reduced-gradient comparison at the first step always runs (also with
    dp_self_check=False) and refuses it on every rank."""
    _, _, infos = fsdp_run
    for info in infos:
        assert info["escape"].startswith("UnsupportedLayerError"), info["escape"][:300]
        assert "ln_f.weight" in info["escape"] or "on another rank" in info["escape"]


@pytest.mark.slow
def test_fsdp2_q_or_c_changed_inside_a_step_is_refused_before_its_release(fsdp_run):
    """Under FSDP the step's q and C were checked only when its chunks were fetched: C shrunk between two chunks
    (clipped at 0.5, noised at σ·1e-4) trained, and a batch size changed in ``on_step_begin`` (after the draw) had
    step 2 recorded at q = 0.25 for a draw at q = 0.5. Both are now refused before that step is released, on every
    rank; C changed before a step's first chunk (every chunk and the noise use it) trains."""
    _, _, infos = fsdp_run
    for info in infos:
        mid = info["mid_step"]
        c, q, ok = mid["c_between_chunks"], mid["q_after_draw"], mid["c_before_chunks"]
        assert "per_sample_max_grad_norm changed from 0.5 to 0.0001 inside a DP step" in c["outcome"], c
        assert not c["history"], c
        assert "drawn at sampling rate q = 0.5" in q["outcome"] and q["history"] == [[0.5, 1]], q
        assert ok == {"outcome": "trained", "history": [[0.5, 2]]}, ok


def test_fsdp2_gradient_hook_is_refused_before_it_sees_the_unnoised_sum(fsdp_run):
    """Review (session 12): the gradient-hook refusal was skipped under FSDP2, which runs the sharded parameters'
    post-accumulate hooks after the reduce-scatter, on the clipped sum before the noise (a hook saw a gradient of norm
    1e-4 where the released one had 0.35; an optimizer-in-backward would apply it un-noised). Refused at the step's
    start on every rank: the hook never runs, nothing is released."""
    _, _, infos = fsdp_run
    for info in infos:
        hook = info["gradient_hook"]
        assert hook["outcome"].startswith("ValueError: hf_dp: these trainable parameters carry a hook on their "
                                          "gradient (at this step's start"), hook["outcome"][:300]
        assert hook["hook_ran"] == 0 and hook["steps"] == 0, hook


def test_fsdp2_self_check_skips_eval_mode_where_the_models_backward_raises_in_it(fsdp_run):
    """A model whose own backward raises in eval mode (Reformer's reversible layers assert train mode): FSDP2's
    first-step self-check skips its eval-mode half with a warning (as the local step does, one shared function:
    ``clipping.checks.eval_mode_check``) and the step trains exactly as the same step of GPT-2 (``clean``)."""
    _, params, infos = fsdp_run
    for info, p in zip(infos, params):
        got = info["eval_raises"]
        assert got["outcome"] == "trained" and got["steps"] == 1 and got["self_checked"], got
        assert len(got["warned"]) == 1 and "AssertionError" in got["warned"][0], got["warned"]
        for n, t in p["clean"][0].items():
            torch.testing.assert_close(p["eval_raises"][0][n], t, rtol=1e-12, atol=1e-12, msg=n)


def test_fsdp2_noise_added_once_per_coordinate(fsdp_run):
    _, params, infos = fsdp_run
    noisy = [p["noisy"][0] for p in params]
    clean = params[0]["clean"][0]  # same seed: same Poisson batches; only the noise differs
    for k in noisy[0]:
        assert torch.equal(noisy[0][k], noisy[1][k]), k
    noise = torch.cat([(clean[k] - noisy[0][k]).reshape(-1) for k in clean])  # SGD lr 1: update difference
    expected_std = SIGMA * C / infos[0]["expected_batch_size"]  # σC/(qN), once — not √2 times
    assert abs(float(noise.std()) / expected_std - 1) < 0.05
    assert abs(float(noise.mean())) < 0.05 * expected_std
    acc = PrivacyAccountant()
    acc.step(SIGMA, infos[0]["sample_rate"])
    assert infos[0]["epsilon_noisy"] == pytest.approx(acc.get_epsilon(1 / N**1.1))


@pytest.mark.slow
def test_fsdp_requested_on_cpu_without_shim_runs_ddp_and_warns(fsdp_run):
    """TrainingArguments(fsdp=...) on CPU: accelerate silently builds a DDP job; DPTrainer warns loudly."""
    _, _, infos = fsdp_run
    for i in infos:
        assert i["fallback"] == {"is_fsdp_enabled": False, "distributed_type": "DistributedType.MULTI_CPU",
                                 "warned": True}


# ---------------------------------------------------------------------- in-process: requests and refusals
def _args(tmp_path, **kw) -> DPTrainingArguments:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, per_device_train_batch_size=2,
                                   max_steps=1, report_to="none", use_cpu=True, **kw)


def test_accelerate_use_fsdp_without_fsdp_warns(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch --use_fsdp` exports
    with pytest.warns(UserWarning, match="FSDP was requested"):
        trainer = DPTrainer(model=tiny_gpt2(), args=_args(tmp_path), train_dataset=lm_dataset(16))
    assert not trainer.is_fsdp_enabled
    assert fsdp_requested(trainer.args, {"ACCELERATE_USE_FSDP": "false"}) is False


class _FakeFSDPTrainer(DPTrainer):
    """Pretends accelerate enabled FSDP with the given version (only __init__'s checks run)."""

    version = 2

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.is_fsdp_enabled = True
        self.accelerator.state.fsdp_plugin = type("Plugin", (), {"fsdp_version": self.version})()


@pytest.fixture
def fake_fsdp():
    from accelerate.state import AcceleratorState

    missing = object()
    saved = AcceleratorState._shared_state.get("fsdp_plugin", missing)
    yield _FakeFSDPTrainer
    if saved is missing:  # the accelerate state is process-wide (Borg): leave no FSDP plugin for later tests
        AcceleratorState._shared_state.pop("fsdp_plugin", None)
    else:
        AcceleratorState._shared_state["fsdp_plugin"] = saved


@pytest.mark.parametrize("kw,match", [
    ({"clipping": "per_layer"}, "clipping='flat' only.*DDP.*per_device"),
    ({"clipping": "per_device"}, "clipping='flat' only"),
    ({"privacy_unit": "user", "user_id_column": "author"}, "privacy_unit='example' only"),
])
def test_fsdp_refuses_all_but_flat_example_level(tmp_path, fake_fsdp, kw, match):
    data = lm_dataset(16).add_column("author", [i % 4 for i in range(16)])
    with pytest.raises(ValueError, match=match):
        fake_fsdp(model=tiny_gpt2(), args=_args(tmp_path, **kw), train_dataset=data)


def test_fsdp1_refused(tmp_path, fake_fsdp):
    fake_fsdp.version = 1
    try:
        with pytest.raises(ValueError, match="FSDP2 only"):
            fake_fsdp(model=tiny_gpt2(), args=_args(tmp_path), train_dataset=lm_dataset(16))
    finally:
        fake_fsdp.version = 2


def test_fsdp_engine_holds_no_parameters(tmp_path, fake_fsdp):
    """The FSDP engine keeps no reference to the pre-wrap parameters (FSDP frees them after sharding)."""
    trainer = fake_fsdp(model=tiny_gpt2(), args=_args(tmp_path), train_dataset=lm_dataset(16))
    engine = trainer.clipping_engine
    assert all(p.device.type == "meta" for p in engine.params.values())
    assert set(engine.params) == {n for n, p in trainer.model.named_parameters() if p.requires_grad}
