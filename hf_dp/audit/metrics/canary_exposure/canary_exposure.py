"""`evaluate` metric: secret-sharer canary exposure (Carlini et al. 2019), shipped with hf_dp.

Load offline with ``hf_dp.audit.load_metric("canary_exposure")`` (``evaluate.load`` of this file's path). The
computation is :func:`hf_dp.audit.canaries.exposure_by_distribution` / :func:`exposure_from_rank`.
"""

from __future__ import annotations

import math

import datasets
import evaluate
import numpy as np

from hf_dp.audit.canaries import exposure_by_distribution, exposure_from_rank, summarize_exposures

_CITATION = """\
@inproceedings{carlini2019secret,
  title={The Secret Sharer: Evaluating and Testing Unintended Memorization in Neural Networks},
  author={Carlini, Nicholas and Liu, Chang and Erlingsson, {\'U}lfar and Kos, Jernej and Song, Dawn},
  booktitle={USENIX Security Symposium}, year={2019}}
@inproceedings{li2022large,
  title={Large Language Models Can Be Strong Differentially Private Learners},
  author={Li, Xuechen and Tram{\\`e}r, Florian and Liang, Percy and Hashimoto, Tatsunori},
  booktitle={ICLR}, year={2022}}
"""

_DESCRIPTION = """\
Exposure of inserted canaries: exposure = log2|R| - log2 rank (exact, when every candidate of the space R is given)
and its 'approximation by distribution modeling' (Carlini et al. 2019): a skew-normal (or normal) is fitted to the
log-perplexities of non-inserted candidates and exposure ~= -log2 CDF(log-perplexity of the canary). Li et al. 2022,
App. M report it for repetitions r in {1, 10, 100} (Table 9).
"""

_KWARGS_DESCRIPTION = """\
Args:
    log_perplexity (list of float): log-perplexity (bits) of each scored sequence (the canary and its candidates).
    canary_id (list of int): the canary each sequence belongs to (same format/prefix); -1 = a reference candidate
        shared by all canaries.
    is_canary (list of int): 1 for the inserted canary itself (exactly one per canary_id >= 0), 0 for a non-inserted
        candidate.
    space_size (int, optional): |R|. Gives max_exposure = log2|R|, and the exact rank exposure for every canary whose
        candidates (its own + shared) number |R| - 1.
    method (str): "skewnorm" (default), "normal" or "empirical".
    repetitions (dict or list, optional): canary_id -> repetition count r, for the per-r summary.
Returns:
    canary_ids, exposure (distribution model), exposure_exact and rank (None where not computable), mean_exposure,
    max_exposure (if space_size), by_repetitions (if repetitions).
Examples:
    >>> metric = hf_dp.audit.load_metric("canary_exposure")
    >>> metric.compute(log_perplexity=[3.0, 9.1, 8.7, 10.2], canary_id=[0, 0, 0, 0], is_canary=[1, 0, 0, 0])
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class CanaryExposure(evaluate.Metric):
    """Canary exposure (Carlini et al. 2019) as an `evaluate` metric."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({
                "log_perplexity": datasets.Value("float64"),
                "canary_id": datasets.Value("int64"),
                "is_canary": datasets.Value("int64"),
            }),
            reference_urls=["https://arxiv.org/abs/1802.08232", "https://arxiv.org/abs/2110.05679"],
        )

    def _compute(self, log_perplexity, canary_id, is_canary, space_size=None, method="skewnorm", repetitions=None):
        lp = np.asarray(log_perplexity, dtype=np.float64)
        cid = np.asarray(canary_id, dtype=np.int64)
        flag = np.asarray(is_canary, dtype=np.int64).astype(bool)
        ids = sorted({int(k) for k in cid[flag]})
        if not ids:
            raise ValueError("No canary (is_canary=1) given.")
        if any(k < 0 for k in ids):
            raise ValueError("A canary must have canary_id >= 0 (-1 marks shared reference candidates).")
        rows = []
        for k in ids:
            own = lp[flag & (cid == k)]
            if own.size != 1:
                raise ValueError(f"canary_id {k} has {own.size} sequences with is_canary=1; expected exactly one.")
            ref = lp[~flag & ((cid == k) | (cid == -1))]
            exposure, info = exposure_by_distribution(float(own[0]), ref, method)
            rank = exact = None
            if space_size is not None and ref.size == int(space_size) - 1:
                rank = int(np.sum(ref < own[0])) + 1
                exact = exposure_from_rank(rank, int(space_size))
            r = None
            if repetitions is not None:
                r = int(repetitions[k] if not isinstance(repetitions, dict) else repetitions.get(k, repetitions.get(
                    str(k))))
            rows.append({"canary_id": k, "exposure": exposure, "exposure_exact": exact, "rank": rank,
                         "repetitions": r, "fit": info})
        out = {
            "canary_ids": ids,
            "exposure": [row["exposure"] for row in rows],
            "exposure_exact": [row["exposure_exact"] for row in rows],
            "rank": [row["rank"] for row in rows],
            "mean_exposure": float(np.mean([row["exposure"] for row in rows])),
        }
        if space_size is not None:
            out["max_exposure"] = math.log2(int(space_size))
        if repetitions is not None:
            out["by_repetitions"] = summarize_exposures(rows)
        return out
