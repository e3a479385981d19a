"""`evaluate` metric: membership inference from attack scores (AUC, TPR at low FPR, empirical ε lower bound).

Shipped with hf_dp; load offline with ``hf_dp.audit.load_metric("membership_inference")``. The computation is
:func:`hf_dp.audit.membership.attack_metrics`.
"""

from __future__ import annotations

import datasets
import evaluate

from hf_dp.audit.membership import DEFAULT_FPRS, attack_metrics

_CITATION = """\
@inproceedings{yeom2018privacy,
  title={Privacy Risk in Machine Learning: Analyzing the Connection to Overfitting},
  author={Yeom, Samuel and Giacomelli, Irene and Fredrikson, Matt and Jha, Somesh}, booktitle={CSF}, year={2018}}
@inproceedings{carlini2022membership,
  title={Membership Inference Attacks From First Principles},
  author={Carlini, Nicholas and Chien, Steve and Nasr, Milad and Song, Shuang and Terzis, Andreas and
          Tram{\\`e}r, Florian},
  booktitle={IEEE S&P}, year={2022}}
@inproceedings{jagielski2020auditing,
  title={Auditing Differentially Private Machine Learning: How Private is Private SGD?},
  author={Jagielski, Matthew and Ullman, Jonathan and Oprea, Alina}, booktitle={NeurIPS}, year={2020}}
"""

_DESCRIPTION = """\
Membership inference metrics from per-example attack scores (higher = "member"): the exact ROC (every distinct score
is a threshold), its AUC (Mann-Whitney, ties count 1/2), the TPR at FPR <= 1% and 0.1% (None, with a note, when there
are fewer than 1/FPR non-members), and with `delta` the empirical lower bound on epsilon: eps >= max(log((TPR - delta)
/ FPR), log((1 - delta - FPR) / (1 - TPR))) with Clopper-Pearson bounds (Bonferroni, joint level `confidence`) and the
threshold chosen on a disjoint random half.
"""

_KWARGS_DESCRIPTION = """\
Args:
    predictions (list of float): attack score per example, higher = more likely a member (e.g. minus the loss).
    references (list of int): 1 = member (training example), 0 = non-member (held-out example).
    fpr_targets (tuple of float): default (0.01, 0.001).
    delta (float, optional): the training run's delta; enables the epsilon lower bound.
    confidence (float): default 0.95.
    seed (int): seed of the selection/evaluation split for the bound.
Returns:
    auc, tpr_at_fpr ({"0.01": ..., "0.001": ...}), num_members, num_nonmembers, notes, epsilon_lower_bound (if delta).
Examples:
    >>> metric = hf_dp.audit.load_metric("membership_inference")
    >>> metric.compute(predictions=[-0.1, -0.2, -2.0, -3.0], references=[1, 1, 0, 0])["auc"]
    1.0
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class MembershipInference(evaluate.Metric):
    """Membership inference metrics as an `evaluate` metric."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({
                "predictions": datasets.Value("float64"),
                "references": datasets.Value("int64"),
            }),
            reference_urls=["https://arxiv.org/abs/2112.03570", "https://arxiv.org/abs/2006.07709"],
        )

    def _compute(self, predictions, references, fpr_targets=DEFAULT_FPRS, delta=None, confidence=0.95, seed=0):
        return attack_metrics(predictions, references, fpr_targets=fpr_targets, delta=delta, confidence=confidence,
                              seed=seed)
