"""Issue 25: probe-then-fine-tune (Ke et al. 2024; Li et al. 2022 §5) under one budget (``hf_dp/probe.py``).

Phase 1 trains the head alone, phase 2 continues from it (the whole model, or LoRA); the final model's card states
the ε of both phases composed, checked against prv-accountant's RDP accountant called directly on the two phases'
(σ, q, steps) — not our accountant — and the total target is met. The plan made before any data
(``plan_probe_then_finetune``) gives the σ each phase then uses. A phase 2 that cannot run fails before phase 1
spends anything.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import cls_dataset, quick_dp_args, tiny_bert
from prv_accountant import PoissonSubsampledGaussianMechanism
from prv_accountant.other_accountants import RDP

from hf_dp import DPTrainer, plan_probe_then_finetune, probe_epsilon, probe_then_finetune, train_only
from hf_dp.cards import privacy_report

N = 16
DELTA = 0.05
TOTAL = 4.0
SHARE = 0.4
PROBE_STEPS, FT_STEPS = 2, 3
Q = 4 / N  # quick_dp_args: per-device batch 4, no accumulation


def args(out, **kw):
    return quick_dp_args(out, **{"noise_multiplier": None, "target_delta": DELTA, "logging_steps": 100,
                                 "dp_seed": 0, "accountant": "rdp", **kw})


def rdp_epsilon(mechanisms, delta=DELTA) -> float:
    """ε of prv-accountant's own RDP accountant (Mironov 2017; not hf_dp's accountant) for (σ, q, steps) mechanisms.
    (RDP: the same calibration code path as PRV, ~20x cheaper; the PRV card is checked the same way in
    test_history.py.)"""
    prvs = [PoissonSubsampledGaussianMechanism(sampling_probability=q, noise_multiplier=s) for s, q, _ in mechanisms]
    return float(RDP(prvs=prvs).compute_epsilon(delta=delta, num_self_compositions=[n for _, _, n in mechanisms])[2])


def run(tmp_path, peft_config=None, probe_share=SHARE):
    torch.manual_seed(0)
    model = tiny_bert(num_labels=2)
    model.bert.embeddings.word_embeddings.weight.requires_grad_(False)  # the user's own choice: frozen in phase 2 too
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    probe_args = args(tmp_path / "probe", target_epsilon=probe_epsilon(TOTAL, probe_share), max_steps=PROBE_STEPS)
    ft_args = args(tmp_path / "ft", target_epsilon=TOTAL, max_steps=FT_STEPS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        probe, finetune = probe_then_finetune(DPTrainer, model, head="classifier", probe_args=probe_args,
                                              finetune_args=ft_args, peft_config=peft_config,
                                              train_dataset=cls_dataset(N, 2))
    return model, start, probe, finetune


@pytest.mark.parametrize("phase2", ["full", "lora"])
def test_final_card_states_both_phases_composed_and_meets_the_total(tmp_path, phase2):
    peft_config = None
    if phase2 == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=2, lora_alpha=4, target_modules=["query", "value"], modules_to_save=["classifier"])
    model, start, probe, finetune = run(tmp_path, peft_config)
    s1, s2 = probe.noise_multiplier, finetune.noise_multiplier
    # The plan made before any data gives the σ each phase used (one calibration).
    plan = plan_probe_then_finetune(total_epsilon=TOTAL, probe_share=SHARE, num_examples=N, target_delta=DELTA,
                                    per_device_train_batch_size=4, accountant="rdp", probe={"max_steps": PROBE_STEPS},
                                    finetune={"max_steps": FT_STEPS})
    assert plan["probe"]["noise_multiplier"] == pytest.approx(s1, rel=1e-9)
    assert plan["finetune"]["noise_multiplier"] == pytest.approx(s2, rel=1e-9)
    # The final model's card: ε of both phases composed, by prv-accountant directly; the total is met.
    finetune.save_model(tmp_path / "final")
    card = privacy_report(tmp_path / "final")
    composed = rdp_epsilon([(s1, Q, PROBE_STEPS), (s2, Q, FT_STEPS)])
    assert card["steps"] == PROBE_STEPS + FT_STEPS
    assert card["epsilon"] == pytest.approx(composed, rel=1e-6)
    assert card["epsilon"] <= TOTAL
    assert plan["epsilon"] == pytest.approx(composed, rel=1e-6)
    probe_eps = probe.privacy_spent()["epsilon"]
    assert probe_eps <= probe_epsilon(TOTAL, SHARE) < card["epsilon"]
    assert probe_eps == pytest.approx(rdp_epsilon([(s1, Q, PROBE_STEPS)]), rel=1e-5)
    # Phase 1 trained the head alone; phase 2 trained from there.
    base = finetune.model.get_base_model() if phase2 == "lora" else model
    if phase2 == "full":  # phase 2 trains what was trainable before the probe, the user's frozen embeddings excepted
        moved = {n for n, p in base.named_parameters() if not torch.equal(p, start[n])}
        trainable = {n for n, p in base.named_parameters() if p.requires_grad}
        assert "bert.embeddings.word_embeddings.weight" not in moved | trainable
        assert {"bert.pooler.dense.weight", "bert.encoder.layer.0.attention.self.query.weight"} <= moved & trainable
    else:
        assert all(torch.equal(p, start[n]) for n, p in base.named_parameters() if n in start)  # frozen base
        assert any("lora_" in n for n, p in finetune.model.named_parameters() if p.requires_grad)


def test_train_only_names_the_head_and_returns_the_earlier_trainable_set():
    model = tiny_bert(num_labels=2)
    model.bert.embeddings.word_embeddings.weight.requires_grad_(False)
    before = train_only(model, "classifier")
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {"classifier.weight", "classifier.bias"}
    assert before["bert.embeddings.word_embeddings.weight"] is False and before["bert.pooler.dense.weight"] is True
    train_only(model, lambda name: name.startswith("bert.pooler."))  # or a predicate on the name
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {"bert.pooler.dense.weight",
                                                                            "bert.pooler.dense.bias"}


# ------------------------------------------------------------------------------------------ refused before training
def test_a_phase_two_that_cannot_run_fails_before_phase_one_spends_anything(tmp_path):
    """Phase 2 is planned before phase 1 trains: a phase-2 setting that cannot be private (here an expected batch
    above N, q > 1) fails at once, not after phase 1 spent its share."""
    torch.manual_seed(0)
    model = tiny_bert(num_labels=2)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    probe_args = args(tmp_path / "p", target_epsilon=1.0, max_steps=1)
    ft_args = args(tmp_path / "f", target_epsilon=TOTAL, max_steps=1, gradient_accumulation_steps=8)
    with pytest.raises(ValueError, match="exceeds the training set size"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        probe_then_finetune(DPTrainer, model, head="classifier", probe_args=probe_args, finetune_args=ft_args,
                            train_dataset=cls_dataset(N, 2))
    assert all(torch.equal(p, start[n]) for n, p in model.named_parameters())  # nothing trained, nothing spent
    with pytest.raises(ValueError, match="exceeds the training set size"):
        plan_probe_then_finetune(total_epsilon=TOTAL, num_examples=N, target_delta=DELTA, accountant="rdp",
                                 per_device_train_batch_size=4, probe={"max_steps": 1},
                                 finetune={"max_steps": 1, "gradient_accumulation_steps": 8})


def test_bad_recipes_are_refused_with_the_reason(tmp_path):
    model = tiny_bert(num_labels=2)
    with pytest.raises(ValueError, match="probe_share must be in"):
        probe_epsilon(TOTAL, 1.0)
    with pytest.raises(ValueError, match="names no parameter"):
        train_only(model, "score")
    assert all(p.requires_grad for p in model.parameters())  # a refused head changes nothing
    kw = dict(head="classifier", train_dataset=cls_dataset(N, 2))
    with pytest.raises(ValueError, match="must be below the total"):
        probe_then_finetune(DPTrainer, model, probe_args=args(tmp_path, target_epsilon=3.0),
                            finetune_args=args(tmp_path, target_epsilon=3.0), **kw)
    with pytest.raises(ValueError, match="needs target_epsilon"):
        probe_then_finetune(DPTrainer, model, probe_args=args(tmp_path, target_epsilon=None, noise_multiplier=1.0),
                            finetune_args=args(tmp_path, target_epsilon=3.0), **kw)
    with pytest.raises(ValueError, match="one δ"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        probe_then_finetune(DPTrainer, model, probe_args=args(tmp_path, target_epsilon=1.0),
                            finetune_args=args(tmp_path, target_epsilon=3.0, target_delta=DELTA / 2), **kw)
    assert all(p.requires_grad for p in model.parameters())  # a refused recipe leaves the trainable set as it was
    with pytest.raises(ValueError, match="must not set"):
        plan_probe_then_finetune(total_epsilon=TOTAL, num_examples=N, probe={"target_epsilon": 1.0})
    with pytest.raises(ValueError, match="one δ"):
        plan_probe_then_finetune(total_epsilon=TOTAL, num_examples=N, accountant="rdp", per_device_train_batch_size=4,
                                 probe={"max_steps": 1, "target_delta": DELTA},
                                 finetune={"max_steps": 1, "target_delta": DELTA / 2})


def test_phase_two_is_planned_after_the_earlier_runs_the_model_carries(tmp_path, monkeypatch):
    """A model already DP-trained once: phase 2's early plan composes that earlier run AND phase 1 (what phase 2's
    accountant will start from, the model's privacy history), not phase 1 alone."""
    from hf_dp import probe as probe_module

    torch.manual_seed(0)
    model = tiny_bert(num_labels=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        DPTrainer(model=model, args=args(tmp_path / "earlier", noise_multiplier=2.0, max_steps=1),
                  train_dataset=cls_dataset(N, 2)).train()
    seen = []

    def spy(**kw):
        seen.append(kw["history"])
        raise RuntimeError("planned")

    monkeypatch.setattr(probe_module, "plan_privacy", spy)
    probe_args = args(tmp_path / "p", target_epsilon=probe_epsilon(TOTAL, SHARE), max_steps=PROBE_STEPS)
    ft_args = args(tmp_path / "f", target_epsilon=TOTAL, max_steps=FT_STEPS)
    with pytest.raises(RuntimeError, match="planned"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        probe_then_finetune(DPTrainer, model, head="classifier", probe_args=probe_args, finetune_args=ft_args,
                            train_dataset=cls_dataset(N, 2))
    (history,) = seen
    assert [(r.noise_multiplier, r.sample_rate, r.steps) for r in history[:1]] == [(2.0, Q, 1)]  # the earlier run
    assert len(history) == 2 and history[1].steps == PROBE_STEPS  # then phase 1
