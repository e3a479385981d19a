"""What leaves the machine with a model (issue 12, hole 11): redacted trainer records in every Hub upload."""

from __future__ import annotations

import json
import os
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from helpers import lm_dataset, quick_dp_args, tiny_gpt2
from huggingface_hub import HfApi
from huggingface_hub.utils import filter_repo_objects
from transformers import TrainerState

from hf_dp import DPTrainer
from hf_dp.release import PRIVATE_DIR, PUBLIC_KEYS, PUBLIC_PREFIXES, STAGING_DIR, redact_trainer_state

PRIVATE_LOG_KEYS = ("loss", "train_loss", "grad_norm", "total_flos", "num_input_tokens_seen", "eval_loss",
                    "train_runtime")


def _make(out: Path, **kw) -> DPTrainer:
    args = quick_dp_args(out, **{"max_steps": 2, **kw})
    torch.manual_seed(0)
    return DPTrainer(model=tiny_gpt2(), args=args, train_dataset=lm_dataset(16), eval_dataset=lm_dataset(8, seed=1))


def _uploaded_files(folder: str, ignore) -> dict[str, str]:
    """{relative path: text of JSON files} that ``upload_folder`` would send (its own ignore-pattern filter)."""
    rels = [str(p.relative_to(folder)) for p in Path(folder).rglob("*") if p.is_file()]
    kept = filter_repo_objects(rels, ignore_patterns=ignore)
    return {r: (Path(folder, r).read_text() if r.endswith(".json") else "") for r in kept}


def _record(uploads: list):
    def fake_upload(self, *, repo_id, folder_path, **kwargs):
        uploads.append({"path_in_repo": kwargs.get("path_in_repo"), "folder": folder_path,
                        "files": _uploaded_files(folder_path, kwargs.get("ignore_patterns"))})
        job = Future()
        job.set_result(SimpleNamespace(commit_url="https://hub.invalid/commit/1"))
        return job

    return fake_upload


def _assert_redacted(state_text: str, eval_public: bool = False) -> dict:
    state = json.loads(state_text)
    assert state["total_flos"] == 0 and state.get("num_input_tokens_seen", 0) == 0
    for record in state["log_history"]:
        for key in PRIVATE_LOG_KEYS:
            if not (eval_public and key.startswith("eval_")):
                assert key not in record, (key, record)
        assert not any(k.startswith("audit/") for k in record)
    assert any("epsilon" in r for r in state["log_history"])  # the privacy spent stays public
    return state


@pytest.mark.parametrize("strategy, path_in_repo", [("checkpoint", "last-checkpoint"),
                                                    ("all_checkpoints", "checkpoint-{}")])
def test_pushed_checkpoints_carry_no_training_loss(tmp_path, strategy, path_in_repo):
    uploads: list = []
    out = tmp_path / "run"
    with mock.patch.object(HfApi, "create_repo", return_value=SimpleNamespace(repo_id="me/ckpt")), \
            mock.patch.object(HfApi, "upload_folder", autospec=True, side_effect=_record(uploads)):
        # dp_seed: with a secret one, step 1's Poisson batch (q = 1/4 of 16 rows) is empty about once in 100 runs,
        # leaving checkpoint-1 with no flos and no loss to check.
        trainer = _make(out, save_strategy="steps", save_steps=1, push_to_hub=True, hub_model_id="me/ckpt",
                        hub_strategy=strategy, include_num_input_tokens_seen="all", dp_seed=0)
        trainer.train()
    checkpoints = [u for u in uploads if u["path_in_repo"] is not None]
    assert [u["path_in_repo"] for u in checkpoints] == [path_in_repo.format(s) for s in (1, 2)]
    for step, up in enumerate(checkpoints, start=1):
        assert {"trainer_state.json", "model.safetensors", "README.md", "dp_state.json"} <= set(up["files"])
        pushed = _assert_redacted(up["files"]["trainer_state.json"])
        assert pushed["global_step"] == step  # still a resumable state
        local = json.loads((out / f"checkpoint-{step}" / "trainer_state.json").read_text())
        assert local["total_flos"] > 0 and any("loss" in r for r in local["log_history"])  # resume keeps it all
        assert pushed["log_history"] == [r for r in (
            {k: v for k, v in r.items() if k in PUBLIC_KEYS or k.startswith(PUBLIC_PREFIXES)}
            for r in local["log_history"]) if set(r) - {"step", "epoch"}]
    state = TrainerState.load_from_json(str(out / STAGING_DIR / "checkpoint-2" / "trainer_state.json"))
    assert state.global_step == 2 and state.total_flos == 0
    for up in uploads:  # nothing private or staged goes up with output_dir
        assert not any(f.startswith((STAGING_DIR, PRIVATE_DIR, "checkpoint-")) for f in up["files"])
        if "trainer_state.json" in up["files"]:
            _assert_redacted(up["files"]["trainer_state.json"])


def test_push_to_hub_redacts_saved_state_and_metrics(tmp_path):
    out = tmp_path / "run"
    # dp_seed: with a secret one, both Poisson steps (q = 1/4 of 16 rows) are empty about once in 10⁴ runs, leaving
    # no flos and no loss to check.
    trainer = _make(out, eval_strategy="steps", eval_steps=1, dp_seed=0)
    result = trainer.train()
    trainer.save_model()
    trainer.save_state()  # what run_glue-style scripts do before push_to_hub
    trainer.save_metrics("train", result.metrics)
    trainer.save_metrics("eval", trainer.evaluate())
    assert "train_loss" in json.loads((out / "train_results.json").read_text())
    uploads: list = []
    trainer.hub_model_id = None
    with mock.patch.object(HfApi, "create_repo", return_value=SimpleNamespace(repo_id="me/run")), \
            mock.patch.object(HfApi, "upload_folder", autospec=True, side_effect=_record(uploads)):
        trainer.push_to_hub()
    (up,) = uploads
    files = up["files"]
    assert {"trainer_state.json", "train_results.json", "eval_results.json", "all_results.json"} <= set(files)
    _assert_redacted(files["trainer_state.json"])
    for name in ("train_results.json", "eval_results.json", "all_results.json"):
        metrics = json.loads(files[name])
        assert not set(metrics) & set(PRIVATE_LOG_KEYS), (name, metrics)
        assert not any(k.startswith(("eval_", "train_")) for k in metrics), (name, metrics)
    # the originals stay on the machine, outside the upload
    original = json.loads((out / PRIVATE_DIR / "trainer_state.json").read_text())
    assert any("loss" in r for r in original["log_history"]) and original["total_flos"] > 0
    assert "train_loss" in json.loads((out / PRIVATE_DIR / "train_results.json").read_text())
    assert not any(f.startswith(PRIVATE_DIR) for f in files)


def test_declared_public_evaluation_is_kept(tmp_path):
    state = {"global_step": 2, "total_flos": 123.0, "best_metric": 0.5,
             "log_history": [{"loss": 2.0, "epsilon": 0.3, "step": 1, "epoch": 0.5},
                             {"eval_loss": 1.9, "eval_accuracy": 0.6, "eval_runtime": 0.1, "step": 2, "epoch": 1.0},
                             {"audit/mia_loss_auc": 0.7, "step": 2}]}
    private = redact_trainer_state(state)
    assert private["log_history"] == [{"epsilon": 0.3, "step": 1, "epoch": 0.5}]
    assert private["best_metric"] is None and private["total_flos"] == 0
    public = redact_trainer_state(state, eval_public=True)
    assert public["log_history"][1] == {"eval_loss": 1.9, "eval_accuracy": 0.6, "eval_runtime": 0.1, "step": 2,
                                        "epoch": 1.0}
    assert public["best_metric"] == 0.5 and len(public["log_history"]) == 2  # audit results are never kept


def test_tensorboard_logs_inside_output_dir_are_a_guarantee_exception(tmp_path, monkeypatch):
    from transformers.integrations import TensorBoardCallback

    with mock.patch.object(HfApi, "create_repo", return_value=SimpleNamespace(repo_id="me/x")):
        trainer = _make(tmp_path / "run", push_to_hub=True, hub_model_id="me/x")
    assert trainer.dp_guarantee == "strict"
    cb = TensorBoardCallback.__new__(TensorBoardCallback)  # tensorboard itself is not installed here
    cb.logging_dir = None  # the Trainer's default: output_dir/runs/<date_host>
    trainer.callback_handler.callbacks.append(cb)
    assert "TensorBoard logs" in trainer.dp_guarantee and trainer.dp_guarantee.startswith("not strict")
    cb.logging_dir = str(tmp_path / "tb")  # TENSORBOARD_LOGGING_DIR outside output_dir: nothing uploaded
    assert trainer.dp_guarantee == "strict"
    cb.logging_dir = None
    monkeypatch.setattr(trainer.args, "push_to_hub", False)
    assert trainer.dp_guarantee == "strict"


def test_staged_copy_does_not_touch_the_checkpoint(tmp_path):
    from hf_dp.release import stage_checkpoint

    ckpt = tmp_path / "out" / "checkpoint-3"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"total_flos": 7.0, "log_history": [{"loss": 1.0,
                                                                                            "step": 3}]}))
    (ckpt / "model.safetensors").write_bytes(b"weights")
    staged = stage_checkpoint(ckpt, tmp_path / "out")
    assert staged == tmp_path / "out" / STAGING_DIR / "checkpoint-3"
    assert json.loads((staged / "trainer_state.json").read_text()) == {"total_flos": 0, "log_history": []}
    assert json.loads((ckpt / "trainer_state.json").read_text())["total_flos"] == 7.0  # the hard link was cut
    assert (staged / "model.safetensors").read_bytes() == b"weights"
    assert os.path.samefile(staged / "model.safetensors", ckpt / "model.safetensors")  # no copy of the weights


def test_a_pushed_checkpoint_still_resumes(tmp_path):
    """What the Hub holds under last-checkpoint/ (the redacted copy) resumes training with the accountant's history."""
    import shutil

    uploads: list = []
    out = tmp_path / "run"
    with mock.patch.object(HfApi, "create_repo", return_value=SimpleNamespace(repo_id="me/ckpt")), \
            mock.patch.object(HfApi, "upload_folder", autospec=True, side_effect=_record(uploads)):
        trainer = _make(out, save_strategy="steps", save_steps=2, push_to_hub=True, hub_model_id="me/ckpt",
                        hub_strategy="checkpoint")
        trainer.train()
    downloaded = tmp_path / "downloaded" / "checkpoint-2"
    shutil.copytree(out / STAGING_DIR / "checkpoint-2", downloaded)  # = the files uploaded as last-checkpoint/
    assert _assert_redacted((downloaded / "trainer_state.json").read_text())["global_step"] == 2
    resumed = _make(tmp_path / "resumed", max_steps=3)
    resumed.train(resume_from_checkpoint=str(downloaded))
    assert resumed.state.global_step == 3 and resumed.accountant.steps == 3
