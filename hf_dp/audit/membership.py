"""Loss-based membership inference and an empirical lower bound on ε.

Attacks (a higher score means "member"), all computed from per-example losses, no shadow models:

* ``"loss"`` — the loss-threshold attack of Yeom et al. 2018 ("Privacy Risk in Machine Learning", CSF 2018), the
  attack used by Chen et al. (``004_…``, App. A.2: rank all samples by their loss; low loss ⇒ member):
  ``score = −loss``.
* ``"calibrated"`` — per-example *difficulty calibration* against the model the fine-tuning started from (Watson et
  al. 2022, "On the Importance of Difficulty Calibration in Membership Inference Attacks", ICLR 2022; with the
  pre-trained model as reference this is the likelihood-ratio attack of Mireshghallah et al. 2022, which Chen et al.
  App. A.2 cite): ``score = loss_initial − loss_final``. The initial model is public in fine-tuning, so no reference
  model is trained ("reference-model-free"). For a randomly initialised model the calibration is nearly constant and
  the attack reduces to ``"loss"``.
* ``"zlib"`` — the zlib calibration of Carlini et al. 2021 ("Extracting Training Data from Large Language Models",
  USENIX Security 2021), in its code-length form: ``score = −(Σ_t NLL_t in bits) / (8 · len(zlib(text)))``,
  the model's code length of the example relative to zlib's (examples that the model compresses much better than a
  generic compressor are suspicious). Needs the examples' text.

Each example's loss is its own mean over its labelled tokens (``hf_dp.losses``, the loss DP-SGD clips).

Metrics come from the *exact* ROC of the scores (every distinct score is a threshold; ties are resolved together):
AUC (= the Mann–Whitney probability that a member outscores a non-member, ties counted ½) and TPR at FPR ≤ α for
α ∈ {1%, 0.1%} (the low-FPR regime of Carlini et al. 2022, "Membership Inference Attacks From First Principles").
TPR at FPR α is reported only if there are at least ``⌈1/α⌉`` non-members (else the only FPR ≤ α is 0 and the
number would not measure the α regime); the result then says so in ``notes``.

Empirical ε lower bound (:func:`epsilon_lower_bound`): any (ε, δ)-DP mechanism satisfies, for every test
(Kairouz, Oh & Viswanath 2015), ``TPR ≤ e^ε·FPR + δ`` and ``1 − FPR ≤ e^ε·(1 − TPR) + δ``, so
``ε ≥ max(log((TPR − δ)/FPR), log((1 − δ − FPR)/(1 − TPR)))``. As in Jagielski, Ullman & Oprea 2020 ("Auditing
Differentially Private Machine Learning", NeurIPS 2020) the TPR is replaced by its Clopper–Pearson lower and the FPR
by its Clopper–Pearson upper confidence bound, each one-sided at level ``1 − (1 − confidence)/2`` (Bonferroni: the
pair holds jointly with probability ≥ ``confidence``, default 95%). The threshold is chosen on one random half of the
members and non-members and the bound evaluated on the other half, so the choice does not inflate it. Caveat: the
binomial model treats examples as independent trials, which is exact when each trial is a separate training run
(Jagielski et al.) and a common heuristic when many examples are audited in one run (Steinke, Nasr & Jagielski 2023,
"Privacy Auditing with One (1) Training Run", give the rigorous one-run analysis); read it as an audit statistic, not
a proof.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from scipy import stats

__all__ = [
    "attack_metrics",
    "clopper_pearson",
    "epsilon_lower_bound",
    "membership_inference",
    "per_example_losses",
    "roc_auc",
    "roc_curve",
    "tpr_at_fpr",
    "zlib_bits",
]

DEFAULT_FPRS: tuple[float, ...] = (0.01, 0.001)
_MODEL_KEYS = ("input_ids", "attention_mask", "token_type_ids", "labels")


# ----------------------------------------------------------------------------------------------------------------------
# Losses
# ----------------------------------------------------------------------------------------------------------------------
def _collate(rows: list[dict[str, Any]], pad_token_id: int) -> dict[str, torch.Tensor]:
    length = max(len(r["input_ids"]) for r in rows)
    out: dict[str, list[list[int]]] = {}
    for key in _MODEL_KEYS:
        if key not in rows[0]:
            continue
        fill = -100 if key == "labels" else (pad_token_id if key == "input_ids" else 0)
        vals = []
        for r in rows:
            x = list(r[key]) if isinstance(r[key], (list, tuple)) else r[key]
            vals.append(x + [fill] * (length - len(x)) if isinstance(x, list) else x)
        out[key] = vals
    if "attention_mask" not in out:
        out["attention_mask"] = [[1] * len(r["input_ids"]) + [0] * (length - len(r["input_ids"])) for r in rows]
    return {k: torch.tensor(v) for k, v in out.items()}


@torch.no_grad()
def per_example_losses(
    model: torch.nn.Module,
    dataset: Any,
    *,
    batch_size: int = 64,
    per_example_loss: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    return_counts: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Each example's own loss (mean over its labelled tokens) under ``model``, in eval mode, as float64 nats.

    Args:
        dataset: rows with ``input_ids`` and ``labels`` (``attention_mask`` optional); variable lengths are
            right-padded. Other columns are ignored.
        per_example_loss: ``fn(outputs, labels) -> Tensor[B]``; default by model head
            (:func:`hf_dp.default_per_example_loss`, the loss DPTrainer clips).
        return_counts: also return each example's number of scored tokens (shifted for causal LMs).
    """
    from ..losses import default_per_example_loss

    loss_fn, task = (per_example_loss, "custom") if per_example_loss is not None else default_per_example_loss(model)
    pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    pad = 0 if pad is None else int(pad)
    try:
        device = next(model.parameters()).device
    except StopIteration:  # pragma: no cover
        device = torch.device("cpu")
    was_training = model.training
    model.eval()
    losses, counts = [], []
    try:
        for start in range(0, len(dataset), batch_size):
            rows = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
            batch = {k: v.to(device) for k, v in _collate(rows, pad).items()}
            labels = batch.pop("labels")
            out = model(**batch)
            losses.append(loss_fn(out, labels).double().cpu())
            lab = labels[:, 1:] if task == "causal_lm" else labels
            counts.append(lab.reshape(lab.shape[0], -1).ne(-100).sum(1).cpu() if lab.dim() > 1
                          else torch.ones(lab.shape[0], dtype=torch.long))
    finally:
        model.train(was_training)
    loss_arr = torch.cat(losses).numpy() if losses else np.zeros(0)
    if return_counts:
        return loss_arr, (torch.cat(counts).numpy() if counts else np.zeros(0, dtype=np.int64))
    return loss_arr


def zlib_bits(texts: Sequence[str]) -> np.ndarray:
    """zlib entropy of each text (Carlini et al. 2021): bits of its zlib-compressed UTF-8 bytes (level 9)."""
    return np.array([8.0 * len(zlib.compress(t.encode("utf-8"), 9)) for t in texts], dtype=np.float64)


# ----------------------------------------------------------------------------------------------------------------------
# ROC
# ----------------------------------------------------------------------------------------------------------------------
def _check(scores: Sequence[float] | np.ndarray, labels: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    y = np.asarray(labels).reshape(-1).astype(bool)
    if s.shape != y.shape:
        raise ValueError(f"scores and labels differ in length ({s.size} vs {y.size}).")
    if not np.isfinite(s).all():
        raise ValueError("scores must be finite.")
    if y.all() or not y.any():
        raise ValueError("Membership inference needs both members (label 1) and non-members (label 0).")
    return s, y


def roc_curve(scores: Sequence[float] | np.ndarray,
              labels: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exact ROC of the rule "member iff score ≥ τ" over every distinct score τ (descending), starting at (0, 0).

    Returns ``(fpr, tpr, thresholds)``; ``thresholds[0] = +inf``.
    """
    s, y = _check(scores, labels)
    order = np.argsort(-s, kind="mergesort")
    s, y = s[order], y[order]
    distinct = np.r_[np.nonzero(np.diff(s))[0], s.size - 1]  # last index of each block of tied scores
    tp = np.cumsum(y)[distinct]
    fp = np.cumsum(~y)[distinct]
    tpr = np.r_[0.0, tp / y.sum()]
    fpr = np.r_[0.0, fp / (~y).sum()]
    return fpr, tpr, np.r_[np.inf, s[distinct]]


def roc_auc(scores: Sequence[float] | np.ndarray, labels: Sequence[int] | np.ndarray) -> float:
    """AUC = P(member score > non-member score) + ½ P(tie) (Mann–Whitney, from average ranks)."""
    s, y = _check(scores, labels)
    ranks = stats.rankdata(s)  # average ranks for ties
    n1, n0 = int(y.sum()), int((~y).sum())
    return float((ranks[y].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def tpr_at_fpr(fpr: np.ndarray, tpr: np.ndarray, target: float) -> float:
    """The largest TPR of an exact ROC point with FPR ≤ ``target`` (no interpolation)."""
    ok = fpr <= target + 1e-12
    return float(tpr[ok].max())


# ----------------------------------------------------------------------------------------------------------------------
# ε lower bound
# ----------------------------------------------------------------------------------------------------------------------
def clopper_pearson(k: int, n: int, alpha: float) -> tuple[float, float]:
    """One-sided Clopper–Pearson bounds at level ``1 − alpha`` each: ``(lower, upper)`` for a binomial proportion."""
    if n <= 0:
        return 0.0, 1.0
    lo = 0.0 if k == 0 else float(stats.beta.ppf(alpha, k, n - k + 1))
    hi = 1.0 if k == n else float(stats.beta.ppf(1 - alpha, k + 1, n - k))
    return lo, hi


def _eps_from_rates(tpr: float, fpr: float, delta: float) -> float:
    """``max(log((TPR − δ)/FPR), log((1 − δ − FPR)/(1 − TPR)), 0)``; ``inf`` where a denominator is 0."""
    best = 0.0
    if tpr - delta > 0:
        best = max(best, math.inf if fpr <= 0 else math.log((tpr - delta) / fpr))
    if 1 - delta - fpr > 0:
        best = max(best, math.inf if tpr >= 1 else math.log((1 - delta - fpr) / (1 - tpr)))
    return best


def epsilon_lower_bound(tp: int, n_pos: int, fp: int, n_neg: int, delta: float = 0.0,
                        confidence: float = 0.95) -> dict[str, float]:
    """Empirical ε lower bound from one attack threshold's counts (Jagielski et al. 2020, Clopper–Pearson).

    ``tp`` of ``n_pos`` members and ``fp`` of ``n_neg`` non-members were called members. With probability ≥
    ``confidence`` (Bonferroni over the two one-sided Clopper–Pearson intervals) the true rates satisfy
    ``TPR ≥ tpr_lower`` and ``FPR ≤ fpr_upper``, and then any (ε, δ)-DP training gives ``ε ≥ epsilon_lower_bound``.
    Also returns the point estimate (``epsilon_point``, no confidence).
    """
    alpha = (1 - confidence) / 2
    tpr_lo, _ = clopper_pearson(tp, n_pos, alpha)
    _, fpr_hi = clopper_pearson(fp, n_neg, alpha)
    return {
        "epsilon_lower_bound": _eps_from_rates(tpr_lo, fpr_hi, delta),
        "epsilon_point": _eps_from_rates(tp / n_pos, fp / n_neg, delta),
        "tpr_lower": tpr_lo,
        "fpr_upper": fpr_hi,
        "tp": int(tp), "n_pos": int(n_pos), "fp": int(fp), "n_neg": int(n_neg),
        "delta": float(delta),
        "confidence": float(confidence),
    }


def _split_bound(s: np.ndarray, y: np.ndarray, delta: float, confidence: float, seed: int) -> dict[str, Any]:
    """Choose the threshold on one random half (best Clopper–Pearson bound), evaluate the bound on the other half."""
    rng = np.random.default_rng(seed)
    sel = np.zeros(s.size, dtype=bool)
    for cls in (True, False):
        idx = np.nonzero(y == cls)[0]
        sel[rng.permutation(idx)[: idx.size // 2]] = True
    ev = ~sel
    if min(y[sel].sum(), (~y[sel]).sum(), y[ev].sum(), (~y[ev]).sum()) == 0:
        return {"epsilon_lower_bound": None, "reason": "too few examples to split into selection and evaluation halves"}
    best_t, best = math.inf, -1.0
    n_pos, n_neg = int(y[sel].sum()), int((~y[sel]).sum())
    for t in np.unique(s[sel]):
        pred = s[sel] >= t
        val = epsilon_lower_bound(int((pred & y[sel]).sum()), n_pos, int((pred & ~y[sel]).sum()), n_neg, delta,
                                  confidence)["epsilon_lower_bound"]
        if val > best:
            best, best_t = val, float(t)
    pred = s[ev] >= best_t
    out: dict[str, Any] = epsilon_lower_bound(int((pred & y[ev]).sum()), int(y[ev].sum()),
                                              int((pred & ~y[ev]).sum()), int((~y[ev]).sum()), delta, confidence)
    out["threshold"] = best_t
    out["method"] = ("Clopper-Pearson (two one-sided intervals, Bonferroni), threshold chosen on a disjoint random "
                     "half; examples treated as independent trials")
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Attacks
# ----------------------------------------------------------------------------------------------------------------------
def attack_metrics(scores: Sequence[float] | np.ndarray, labels: Sequence[int] | np.ndarray, *,
                   fpr_targets: Sequence[float] = DEFAULT_FPRS, delta: float | None = None,
                   confidence: float = 0.95, seed: int = 0) -> dict[str, Any]:
    """AUC, TPR at FPR ≤ each target (exact ROC) and, if ``delta`` is given, the empirical ε lower bound.

    ``labels``: 1 = member (held-in), 0 = non-member (held-out). TPR at a target FPR α is ``None`` (with a note)
    when there are fewer than ``⌈1/α⌉`` non-members.
    """
    s, y = _check(scores, labels)
    fpr, tpr, _ = roc_curve(s, y)
    n_neg, n_pos = int((~y).sum()), int(y.sum())
    out: dict[str, Any] = {"auc": roc_auc(s, y), "num_members": n_pos, "num_nonmembers": n_neg,
                           "tpr_at_fpr": {}, "notes": []}
    for a in fpr_targets:
        need = math.ceil(1 / a - 1e-9)
        if n_neg < need:
            out["tpr_at_fpr"][f"{a:g}"] = None
            out["notes"].append(f"TPR at FPR {a:.1%} not reported: {n_neg} non-members < {need} needed to resolve it")
        else:
            out["tpr_at_fpr"][f"{a:g}"] = tpr_at_fpr(fpr, tpr, a)
    if delta is not None:
        out["epsilon_lower_bound"] = _split_bound(s, y, float(delta), confidence, seed)
    return out


def membership_inference(
    member_losses: Sequence[float] | np.ndarray,
    nonmember_losses: Sequence[float] | np.ndarray,
    *,
    member_reference_losses: Sequence[float] | np.ndarray | None = None,
    nonmember_reference_losses: Sequence[float] | np.ndarray | None = None,
    member_texts: Sequence[str] | None = None,
    nonmember_texts: Sequence[str] | None = None,
    member_counts: Sequence[int] | np.ndarray | None = None,
    nonmember_counts: Sequence[int] | np.ndarray | None = None,
    fpr_targets: Sequence[float] = DEFAULT_FPRS,
    delta: float | None = None,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, Any]:
    """Run the attacks that the inputs allow and return their metrics (see the module docstring).

    Args:
        member_losses, nonmember_losses: per-example losses (nats, mean over tokens) of held-in and held-out
            examples under the trained model. The held-out set should be a real held-out split of the same data.
        member_reference_losses, nonmember_reference_losses: the same examples under the initial (pre-trained)
            model: enables ``"calibrated"``.
        member_texts, nonmember_texts, member_counts, nonmember_counts: texts and scored-token counts: enable
            ``"zlib"``.
        delta: enables the ε lower bound at this δ (use the training run's δ).

    Returns ``{"attacks": {name: attack_metrics(...)}, "num_members", "num_nonmembers"}``.
    """
    lin = np.asarray(member_losses, dtype=np.float64)
    lout = np.asarray(nonmember_losses, dtype=np.float64)
    labels = np.r_[np.ones(lin.size), np.zeros(lout.size)]
    attacks: dict[str, np.ndarray] = {"loss": -np.r_[lin, lout]}
    if member_reference_losses is not None and nonmember_reference_losses is not None:
        ref = np.r_[np.asarray(member_reference_losses, dtype=np.float64),
                    np.asarray(nonmember_reference_losses, dtype=np.float64)]
        attacks["calibrated"] = ref - np.r_[lin, lout]
    if member_texts is not None and nonmember_texts is not None and member_counts is not None \
            and nonmember_counts is not None:
        counts = np.r_[np.asarray(member_counts, dtype=np.float64), np.asarray(nonmember_counts, dtype=np.float64)]
        total_bits = np.r_[lin, lout] * counts / math.log(2)
        attacks["zlib"] = -total_bits / np.maximum(zlib_bits([*member_texts, *nonmember_texts]), 8.0)
    kw = dict(fpr_targets=fpr_targets, delta=delta, confidence=confidence, seed=seed)
    return {
        "num_members": int(lin.size),
        "num_nonmembers": int(lout.size),
        "attacks": {name: attack_metrics(score, labels, **kw) for name, score in attacks.items()},
    }
