"""Empirical privacy audits (hf_dp.audit): canaries and exposure, membership inference, callbacks, evaluate metrics.

One deterministic small setup (a word-level tokenizer, a 1-layer GPT-2, random word sequences plus canaries) is trained
twice with the same seeds — without noise and with DP — and shared by the exposure and callback tests.
"""

from __future__ import annotations

import itertools
import json
import math
import warnings

import numpy as np
import pytest
import torch
from datasets import Dataset
from helpers import load_example
from scipy import stats
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from hf_dp import DPTrainer, DPTrainingArguments, NotPrivateWarning
from hf_dp.audit import (
    CanaryExposureCallback,
    CanarySet,
    MembershipInferenceCallback,
    attack_metrics,
    audit_report,
    canary_exposure,
    clopper_pearson,
    epsilon_lower_bound,
    exposure_by_distribution,
    load_metric,
    make_canaries,
    membership_inference,
    metric_path,
    per_example_losses,
    roc_auc,
    roc_curve,
)

WORDS = ("the secret of is a an and to in on at by for with from cat dog bird fish tree rock moon star sun rain snow "
         "wind fire water stone river cloud lake hill road ship king queen bread milk salt gold iron glass").split()
T = 16


def word_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", unk_token="[UNK]")


def sentences(n: int, seed: int, vocab: int = len(WORDS) + 2) -> Dataset:
    """Random word sequences (length 6-10, right-padded to T): learnable only by memorisation."""
    g = np.random.default_rng(seed)
    rows: dict[str, list] = {"input_ids": [], "attention_mask": [], "labels": []}
    for _ in range(n):
        length = int(g.integers(6, 11))
        ids = g.integers(2, vocab, size=length).tolist()
        pad = T - length
        rows["input_ids"].append(ids + [0] * pad)
        rows["attention_mask"].append([1] * length + [0] * pad)
        rows["labels"].append(ids + [-100] * pad)
    return Dataset.from_dict(rows)


def tiny_lm(vocab: int, n_positions: int = T, seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=vocab, n_positions=n_positions, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These models are tiny: one intra-op thread is much faster than two on a shared, busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------------------------------
# Shared training runs
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same model, data, canaries and seeds trained with σ = 0 (non-private) and σ = 1 (DP)."""
    tok = word_tokenizer()
    train, heldout = sentences(32, seed=0), sentences(32, seed=1)
    canaries = make_canaries(tok, repetitions=(0, 16), canaries_per_repetition=2, subvocab=8, secret_length=3,
                             seed=0)
    data = canaries.insert_into(train)
    out = {"tok": tok, "canaries": canaries, "train": train, "heldout": heldout, "data": data}
    for name, sigma in (("nonprivate", 0.0), ("dp", 1.0)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotPrivateWarning)  # σ = 0 is the non-private run
            args = DPTrainingArguments(output_dir=str(tmp_path_factory.mktemp(name)), noise_multiplier=sigma,
                                       per_sample_max_grad_norm=1.0, per_device_train_batch_size=16, max_steps=30,
                                       learning_rate=2e-2, use_cpu=True, report_to="none", save_strategy="no",
                                       disable_tqdm=True, logging_steps=10, dp_seed=0)
            trainer = DPTrainer(model=tiny_lm(len(tok)), args=args, train_dataset=data)
            exposure = CanaryExposureCallback(canaries).attach(trainer)
            mia = MembershipInferenceCallback(train, heldout).attach(trainer)
            trainer.train()
        out[name] = {"trainer": trainer, "exposure": exposure, "mia": mia}
    return out


def _exposures(result: dict, r: int, key: str = "exposure") -> list[float]:
    return [row[key] for row in result["canaries"] if row["repetitions"] == r]


# ---------------------------------------------------------------------------------------------------------------------
# Canaries
# ---------------------------------------------------------------------------------------------------------------------
def test_make_canaries_format_insertion_and_round_trip():
    tok = word_tokenizer()
    cs = make_canaries(tok, repetitions=(0, 1, 5), canaries_per_repetition=2, subvocab=6, secret_length=4, seed=3)
    assert len(cs) == 6 and cs.space_size == 6**4 and cs.max_exposure == pytest.approx(4 * math.log2(6))
    assert len(set(cs.subvocab_ids)) == 6 and all(t in cs.subvocab_ids for c in cs for t in c.secret_ids)
    assert len({c.secret_ids for c in cs}) == 6 and len({c.prefix_ids for c in cs}) == 6  # distinct secrets, contexts
    for c in cs:
        assert c.text.startswith("the secret of ") and len(c.text.split()) == 6 + 4
        assert tok(c.text, add_special_tokens=False)["input_ids"] == [*c.prefix_ids, *c.secret_ids]
    base = sentences(10, seed=0)
    data = cs.insert_into(base)
    assert len(data) == 10 + 2 * (0 + 1 + 5) == 10 + cs.num_inserted_rows
    rows = data.select(range(10, len(data)))
    assert all(len(x) == T for x in rows["input_ids"])  # padded like the base set
    seqs = [tuple(i for i, m in zip(r["input_ids"], r["attention_mask"]) if m) for r in rows]
    for c in cs:
        assert seqs.count(tuple(cs.sequence(c))) == c.repetitions  # r = 0: never inserted
    labels = rows[0]["labels"]
    assert labels[: len(cs.sequence(cs.canaries[2]))] == cs.sequence(cs.canaries[2]) and labels[-1] == -100
    again = CanarySet.from_dict(json.loads(json.dumps(cs.to_dict())))
    assert again == cs


def test_make_canaries_from_token_ids_without_tokenizer():
    cs = make_canaries(None, repetitions=(0, 3), subvocab=[5, 6, 7], secret_length=2, prefix=[2, None, 3],
                       bos_ids=[1], eos_ids=[4], pad_token_id=0)
    assert cs.space_size == 9
    for c in cs:
        assert c.prefix_ids[0] == 2 and c.prefix_ids[1] in (5, 6, 7) and c.prefix_ids[2] == 3
        assert cs.sequence(c) == [1, *c.prefix_ids, *c.secret_ids, 4]
    with pytest.raises(ValueError, match="token ids"):
        make_canaries(None, subvocab=3)


def test_exact_rank_matches_brute_force_over_the_whole_space():
    """The last-token shortcut (V candidates per forward) ranks exactly like scoring all V^l sequences one by one."""
    cs = make_canaries(None, repetitions=(1, 0), subvocab=[3, 4, 5, 6], secret_length=3, prefix=[2, None, 7],
                       bos_ids=[1])
    model = tiny_lm(12, seed=1).eval()
    res = canary_exposure(model, cs, exact=True, batch_size=7)
    for c, row in zip(cs, res["canaries"]):
        ctx = cs.context_ids(c)
        scores = {}
        with torch.no_grad():
            for secret in itertools.product(cs.subvocab_ids, repeat=3):
                ids = torch.tensor([[*ctx, *secret]])
                logp = torch.log_softmax(model(input_ids=ids).logits.double(), -1)[0]
                scores[secret] = -sum(float(logp[len(ctx) - 1 + j, t]) for j, t in enumerate(secret)) / math.log(2)
        own = scores[c.secret_ids]
        assert row["log_perplexity"] == pytest.approx(own, abs=1e-6)
        assert row["rank"] == 1 + sum(s < own - 1e-9 for s in scores.values())
        assert row["exposure_exact"] == pytest.approx(math.log2(64) - math.log2(row["rank"]))
        assert row["num_reference"] == 63  # every other candidate (the two canaries have distinct prefixes)


def test_exposure_by_distribution_recovers_a_known_tail_probability():
    ref = np.random.default_rng(0).normal(30.0, 3.0, size=20000)
    x = 30.0 + 3.0 * stats.norm.ppf(2.0**-10)
    for method in ("normal", "skewnorm"):
        exposure, info = exposure_by_distribution(x, ref, method)
        assert exposure == pytest.approx(10.0, abs=0.4), method
    assert exposure_by_distribution(30.0, ref, "normal")[0] == pytest.approx(1.0, abs=0.05)  # the median: 1 bit
    emp, _ = exposure_by_distribution(-1e9, ref, "empirical")
    assert emp == pytest.approx(math.log2(20001))


def test_exposure_is_high_for_a_repeated_canary_and_near_zero_for_a_never_inserted_one(runs):
    res = runs["nonprivate"]["exposure"].latest
    assert res["exact"] and res["space_size"] == 512 and res["max_exposure"] == pytest.approx(9.0)
    inserted, control = _exposures(res, 16), _exposures(res, 0)
    assert min(inserted) >= 7.0  # ranks first or nearly among 512 candidates
    assert min(_exposures(res, 16, "exposure_exact")) >= 8.0
    assert max(control) < 3.0 and np.mean(control) < 2.0  # chance level (E[−log2 U] = 1.44 bits)
    assert np.mean(_exposures(res, 0, "exposure_exact")) < 2.0


def test_dp_run_has_lower_exposure_than_the_non_private_run(runs):
    nonpriv, dp = runs["nonprivate"]["exposure"].latest, runs["dp"]["exposure"].latest
    assert np.mean(_exposures(dp, 16)) < np.mean(_exposures(nonpriv, 16)) - 1.0
    assert np.mean(_exposures(dp, 16, "exposure_exact")) < np.mean(_exposures(nonpriv, 16, "exposure_exact")) - 1.0


# ---------------------------------------------------------------------------------------------------------------------
# Membership inference
# ---------------------------------------------------------------------------------------------------------------------
def test_roc_auc_and_tpr_at_fpr_are_exact():
    rng = np.random.default_rng(0)
    s = np.round(rng.normal(size=300), 1)  # many ties
    y = rng.integers(0, 2, size=300)
    brute = np.mean([(a > b) + 0.5 * (a == b) for a in s[y == 1] for b in s[y == 0]])
    assert roc_auc(s, y) == pytest.approx(brute)
    fpr, tpr, thr = roc_curve(s, y)
    for t, f, p in zip(thr[1:], fpr[1:], tpr[1:]):
        assert f == np.mean(s[y == 0] >= t) and p == np.mean(s[y == 1] >= t)
    members, nonmembers = np.arange(2000.0, 1900.0, -1), np.arange(1000.0, 0.0, -1)
    nonmembers[:2] = [3000.0, 2999.0]  # two non-members score above every member
    labels = np.r_[np.ones(100), np.zeros(1000)]
    m = attack_metrics(np.r_[members, nonmembers], labels, fpr_targets=(0.01, 0.001))
    assert m["tpr_at_fpr"] == {"0.01": 1.0, "0.001": 0.0} and m["notes"] == []  # 2 FP ≤ 1%; ≤ 1 FP allows no TP
    small = attack_metrics(np.r_[members, nonmembers[:100]], labels[:200], fpr_targets=(0.01, 0.001))
    assert small["tpr_at_fpr"] == {"0.01": 0.0, "0.001": None}
    assert "0.1%" in small["notes"][0] and "100 non-members < 1000" in small["notes"][0]


def test_clopper_pearson_and_epsilon_lower_bound():
    for k, n in ((0, 50), (7, 50), (50, 50)):
        ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.9, method="exact")
        lo, hi = clopper_pearson(k, n, 0.05)
        assert lo == pytest.approx(ci.low) and hi == pytest.approx(ci.high)
    perfect = epsilon_lower_bound(1000, 1000, 0, 1000, delta=1e-5, confidence=0.95)
    fpr_hi = 1 - 0.025 ** (1 / 1000)
    assert perfect["fpr_upper"] == pytest.approx(fpr_hi)
    assert perfect["epsilon_lower_bound"] == pytest.approx(math.log((0.025 ** (1 / 1000) - 1e-5) / fpr_hi), rel=1e-6)
    assert epsilon_lower_bound(500, 1000, 500, 1000)["epsilon_lower_bound"] == 0.0  # no signal, no bound
    rng = np.random.default_rng(1)
    noise = attack_metrics(rng.normal(size=2000), np.r_[np.ones(1000), np.zeros(1000)], delta=1e-5)
    assert noise["epsilon_lower_bound"]["epsilon_lower_bound"] < 0.3


def test_mia_auc_is_one_on_a_memorised_set_and_one_half_on_identical_sets():
    members, nonmembers = sentences(16, seed=10), sentences(16, seed=11)
    model = tiny_lm(len(WORDS) + 2, seed=2)
    init_in, init_out = per_example_losses(model, members), per_example_losses(model, nonmembers)
    batch = {k: torch.tensor(members[k]) for k in ("input_ids", "attention_mask", "labels")}
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):  # full-batch, deliberately over-fitted
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()
    lin, lout = per_example_losses(model, members), per_example_losses(model, nonmembers)
    res = membership_inference(lin, lout, member_reference_losses=init_in, nonmember_reference_losses=init_out)
    assert res["attacks"]["loss"]["auc"] >= 0.99 and res["attacks"]["calibrated"]["auc"] >= 0.99
    same = membership_inference(lin, lin, member_reference_losses=init_in, nonmember_reference_losses=init_in)
    assert same["attacks"]["loss"]["auc"] == 0.5 and same["attacks"]["calibrated"]["auc"] == 0.5


def test_zlib_attack_needs_texts_and_counts():
    lin, lout = np.array([1.0, 1.1, 0.9]), np.array([3.0, 2.5, 2.8])
    res = membership_inference(lin, lout, member_texts=["a b c"] * 3, nonmember_texts=["a b c"] * 3,
                               member_counts=[3] * 3, nonmember_counts=[3] * 3)
    assert set(res["attacks"]) == {"loss", "zlib"} and res["attacks"]["zlib"]["auc"] == 1.0


# ---------------------------------------------------------------------------------------------------------------------
# Callbacks and the model-card report
# ---------------------------------------------------------------------------------------------------------------------
def test_callbacks_log_their_results_next_to_epsilon(runs):
    for name in ("nonprivate", "dp"):
        trainer = runs[name]["trainer"]
        history = trainer.state.log_history
        exp_logs = [h for h in history if "audit/exposure_r16" in h]
        mia_logs = [h for h in history if "audit/mia_loss_auc" in h]
        assert len(exp_logs) == 1 and len(mia_logs) >= 1
        assert exp_logs[0]["step"] == trainer.state.global_step == 30
        assert "epsilon" in exp_logs[0] and "audit/exposure_exact_r0" in exp_logs[0]
        assert "audit/mia_calibrated_auc" in mia_logs[0]  # reference losses recorded at on_train_begin
        assert exp_logs[0]["audit/exposure_r16"] == pytest.approx(
            np.mean(_exposures(runs[name]["exposure"].latest, 16)))
    assert math.isinf(runs["nonprivate"]["exposure"].history[-1]["epsilon"])
    assert runs["dp"]["exposure"].history[-1]["epsilon"] == pytest.approx(runs["dp"]["trainer"].privacy_spent()[
        "epsilon"])
    mia = runs["dp"]["mia"].latest["attacks"]["loss"]
    assert mia["epsilon_lower_bound"]["delta"] == pytest.approx(runs["dp"]["trainer"].target_delta)


def test_callback_runs_on_evaluate_and_adds_to_the_returned_metrics(runs):
    trainer = runs["dp"]["trainer"]
    cb = MembershipInferenceCallback(runs["train"], runs["heldout"], reference=None)
    cb.attach(trainer)
    try:
        metrics = trainer.evaluate(eval_dataset=runs["heldout"])
    finally:
        trainer.remove_callback(cb)
    assert "audit/mia_loss_auc" in metrics and "eval_loss" in metrics
    assert any("audit/mia_loss_auc" in h and "epsilon" in h for h in trainer.state.log_history[-2:])


def test_audit_report_is_a_serialisable_dict_for_the_card(runs):
    report = audit_report(runs["dp"]["trainer"])
    assert set(report) >= {"canary_exposure", "membership_inference", "covered_by_dp", "note"}
    assert report["covered_by_dp"] is False
    ce = report["canary_exposure"]
    assert ce["epsilon"] == pytest.approx(runs["dp"]["trainer"].privacy_spent()["epsilon"])
    assert set(ce["by_repetitions"]) == {"0", "16"} and ce["max_exposure"] == pytest.approx(9.0)
    assert set(report["membership_inference"]["attacks"]) == {"loss", "calibrated"}
    json.dumps(report)
    assert audit_report([]) == {}


# ---------------------------------------------------------------------------------------------------------------------
# evaluate metric modules
# ---------------------------------------------------------------------------------------------------------------------
def test_metric_modules_load_offline_from_the_package(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert metric_path("canary_exposure").endswith("hf_dp/audit/metrics/canary_exposure/canary_exposure.py")
    mia = load_metric("membership_inference")
    scores = [-0.1, -0.2, -2.0, -3.0]
    out = mia.compute(predictions=scores, references=[1, 1, 0, 0])
    assert out["auc"] == 1.0 and out["tpr_at_fpr"]["0.01"] is None
    rng = np.random.default_rng(0)
    s, y = rng.normal(size=400), rng.integers(0, 2, size=400)
    assert mia.compute(predictions=s, references=y, delta=1e-5)["auc"] == pytest.approx(roc_auc(s, y))

    ce = load_metric("canary_exposure")
    ref = rng.normal(20.0, 2.0, size=63)
    out = ce.compute(log_perplexity=[5.0, *ref, 20.0, *ref], canary_id=[0] * 64 + [1] * 64,
                     is_canary=[1] + [0] * 63 + [1] + [0] * 63, space_size=64, repetitions={0: 10, 1: 0})
    assert out["rank"] == [1, 1 + int(np.sum(ref < 20.0))]
    assert out["exposure_exact"][0] == pytest.approx(6.0) and out["max_exposure"] == pytest.approx(6.0)
    assert out["exposure"][0] > 10 and out["by_repetitions"]["10"]["n"] == 1
    with pytest.raises(ValueError, match="unknown|Unknown"):
        load_metric("accuracy")


def test_metric_module_agrees_with_canary_exposure_on_a_model(runs):
    """The evaluate module, fed the log-perplexities of the full space, reproduces the callback's numbers."""
    from hf_dp.audit.canaries import _all_heads, _score_heads

    cs = runs["canaries"]
    model = runs["nonprivate"]["trainer"].model
    res = canary_exposure(model, cs)
    sub = torch.tensor(cs.subvocab_ids)
    lp, cid, flag = [], [], []
    for k, c in enumerate(cs):
        flat = _score_heads(model, cs.context_ids(c), sub[_all_heads(8, 2)], sub, 256).reshape(-1).numpy()
        idx = [cs.subvocab_ids.index(t) for t in c.secret_ids]
        own = idx[0] * 64 + idx[1] * 8 + idx[2]
        lp += flat.tolist()
        cid += [k] * flat.size
        flag += [int(i == own) for i in range(flat.size)]
    out = load_metric("canary_exposure").compute(log_perplexity=lp, canary_id=cid, is_canary=flag,
                                                 space_size=cs.space_size)
    assert out["exposure_exact"] == pytest.approx([row["exposure_exact"] for row in res["canaries"]])
    assert out["exposure"] == pytest.approx([row["exposure"] for row in res["canaries"]], rel=1e-3)


# ---------------------------------------------------------------------------------------------------------------------
# The example script
# ---------------------------------------------------------------------------------------------------------------------
def test_example_script_runs_end_to_end_with_tiny_settings(tmp_path):
    """examples/dp_audit.py on real fortunes and a BPE trained on Austen, with tiny sizes (a smoke test)."""
    module = load_example("dp_audit.py")
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    try:
        out = module.main(["--output_dir", str(tmp_path), "--num_train", "48", "--num_heldout", "16",
                           "--num_members", "16", "--repetitions", "0", "2", "--canaries_per_repetition", "1",
                           "--secret_length", "2", "--pretrain_steps", "2", "--epochs", "1", "--batch_size", "16",
                           "--width", "16", "--noise_multiplier", "1.0"])
    finally:
        hf_logging.set_verbosity(verbosity)
    dp, nonpriv = out["results"]
    assert dp["private"] and dp["noise_multiplier"] == 1.0 and 0 < dp["epsilon"] < math.inf and not nonpriv["private"]
    for res in (dp, nonpriv):
        assert set(res["exposure"]["by_repetitions"]) == {"0", "2"}
        assert set(res["mia"]["attacks"]) == {"loss", "calibrated", "zlib"}
        assert res["audit_report"]["covered_by_dp"] is False
    saved = json.loads((tmp_path / "audit_results.json").read_text())
    assert saved["results"][0]["exposure"]["space_size"] == 100
