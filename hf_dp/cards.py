"""Privacy metadata in model cards: write it, validate it locally, read it back.

A DP model is only as useful as what its card says about the guarantee. This module turns a
:class:`~hf_dp.record.PrivacyRecord` (what ``DPTrainer.privacy_record()`` returns, or what ``dp_state.json`` holds:
:meth:`PrivacyRecord.load <hf_dp.record.PrivacyRecord.load>`) into a ``differential_privacy`` mapping of the card's
YAML metadata (a custom ``ModelCardData`` field, emitted as a nested mapping by ``huggingface_hub``) and a
plain-words card body, rendered from the Jinja template ``hf_dp/templates/dp_model_card.md`` with
``huggingface_hub.ModelCard.from_template``: the pattern of trl's ``generate_model_card`` (``trl/trainer/utils.py``,
template ``trl/templates/lm_model_card.md``). It never reads a trainer: what only the trainer knows and is not a
privacy fact (hyperparameters, evaluation metrics, tags of the model) comes in as plain keyword metadata.

* :func:`privacy_metadata` — the ``differential_privacy`` record: ε (PRV upper bound, Gopi, Lee & Wutschitz 2021,
  and RDP, Mironov 2017), δ, accountant and ``prv-accountant`` version, σ, q, sampling method, steps, epochs,
  expected batch size, N, C, clipping mode (and group thresholds), noise allocation, privacy unit, trained
  parameters (full / LoRA / prefix / prompt) and ``dp_guarantee``.
* :func:`create_model_card` — writes ``README.md``: the card body says what the guarantee covers and what it does
  not (pre-training data, hyperparameter tuning and model selection on private data, logged training loss, ...) and
  how to reproduce ε. The training loss is never written to the card. A README that ``peft`` wrote for an adapter
  is merged (its metadata and body are kept; the hf_dp block is inserted or replaced), never overwritten.
* :func:`card_from_dp_state` — the same card from ``dp_state.json`` alone (what a Hub user has).
* :func:`validate_card` — local validation (the Hub's ``/api/validate-yaml`` endpoint is unreachable offline):
  the YAML parses with ``ModelCard.load``, the required keys are present and have the right types, and
  ``base_model`` holds Hub ids only (a base model loaded from a local directory is named ``local files <name>`` in
  the body and the ``differential_privacy`` record instead).
* :func:`privacy_report` — reads the record back from a card, a README or a repo directory; refuses a card without
  one, loudly.

The same record, unchanged, is the ``differential_privacy`` metadata of DP synthetic data sets
(``hf_dp.synthetic.write_dataset_card``): sampling from a DP model is post-processing.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import re
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData
from huggingface_hub.repocard import RepoCard

from .record import (
    LOCAL_BASE_MODEL_PREFIX,
    PrivacyRecord,
    is_hub_model_id,
    name_base_models,
    package_version,
    plain,
    split_base_model,
)

__all__ = [
    "BLOCK_BEGIN",
    "BLOCK_END",
    "CARD_MARKER",
    "CARD_TAGS",
    "LOCAL_BASE_MODEL_PREFIX",
    "PHRASES_TEMPLATE",
    "REQUIRED_KEYS",
    "card_from_dp_state",
    "card_template",
    "create_model_card",
    "is_hub_model_id",
    "load_template",
    "privacy_metadata",
    "privacy_report",
    "render_model_card",
    "reproduce_epsilon_code",
    "validate_card",
]

logger = logging.getLogger(__name__)

CARD_MARKER = "<!-- hf_dp:card"
"""Starts the comment that marks a card written entirely by hf_dp (re-rendered in full at every save)."""
BLOCK_BEGIN = "<!-- hf_dp:begin -->"
BLOCK_END = "<!-- hf_dp:end -->"
"""The hf_dp block: the only part of a merged (e.g. peft-written) card that hf_dp replaces."""

_OWNED_KEYS = ("differential_privacy", "synthetic_data", "audit")
"""Metadata that hf_dp writes and replaces on every save (never carried over from an older card)."""
_RENDERED_KEYS = ("model-index", "model_name")
"""Metadata an hf_dp card re-renders from the run (never carried over from an older hf_dp card: stale evaluation
results, e.g. of a run that declared its evaluation data public, must not survive into this one's card)."""

CARD_TAGS: tuple[str, ...] = ("differential-privacy", "hf_dp")
"""Tags on every hf_dp card, besides ``dp-sgd`` or ``dp-adam``."""

MODEL_CARD_TEMPLATE = "dp_model_card.md"
DATASET_CARD_TEMPLATE = "dp_dataset_card.md"

_NUMBER = "number"
_INT = "int"
_STR = "str"
_MAP = "mapping"
_LIST = "list"

REQUIRED_KEYS: dict[str, str] = {
    "epsilon": _NUMBER,
    "epsilon_rdp": _NUMBER,
    "delta": _NUMBER,
    "accountant": _STR,
    "prv_accountant_version": _STR,
    "eps_error": _NUMBER,
    "noise_multiplier": _NUMBER,
    "sampling_rate": _NUMBER,
    "sampling": _STR,
    "steps": _INT,
    "epochs": _NUMBER,
    "expected_batch_size": _INT,
    "dataset_size": _INT,
    "per_sample_max_grad_norm": _NUMBER,
    "l2_sensitivity": _NUMBER,
    "clipping": _STR,
    "noise_allocation": _STR,
    "privacy_unit": _STR,
    "trained_parameters": _MAP,
    "mechanisms": _LIST,
    "optimizer": _STR,
    "dp_guarantee": _STR,
}
"""Keys every ``differential_privacy`` record must have, with their YAML types (checked by :func:`validate_card`)."""

_ACCOUNTANTS = ("prv", "rdp")
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
_SAMPLING = ("poisson", "shuffled")
_UNITS = ("example", "user")


# ------------------------------------------------------------------------------------------------------ helpers
PHRASES_TEMPLATE = "dp_card_phrases.md"
"""The words both card templates share (macros and variables over the record ``dp``), rendered in front of each."""


UNKNOWN = "unknown"
"""What the record says of a field an old ``dp_state.json`` (written before the record) does not hold."""
_NOT_RECORDED = "not recorded in this dp_state.json, written by an older hf_dp"


def card_template(name: str) -> str:
    """The Jinja source a card is rendered from: the shared phrases (:data:`PHRASES_TEMPLATE`, which output
    nothing) in front of the template ``name``."""
    return load_template(PHRASES_TEMPLATE) + load_template(name)


def load_template(name: str) -> str:
    """The text of a card template shipped inside the package (``hf_dp/templates/<name>``).

    Read through :mod:`importlib.resources`, so it works for editable and regular (wheel) installs alike; the
    repository's ``model_cards/`` directory holds links to the same files.
    """
    return resources.files("hf_dp").joinpath("templates", name).read_text(encoding="utf-8")


def _epsilons(record: PrivacyRecord, delta: float) -> tuple[float, float | None, float, str]:
    """(reported ε, PRV upper bound or None if PRV cannot compute it, RDP ε, accountant that produced the reported ε).

    The reported ε and its accountant are the record's (:meth:`PrivacyRecord.spent`, whose ``accountant_used`` names
    the accountant that actually produced the number, e.g. ``"pld (prv-accountant failed numerically)"``). Without
    that key: the configured accountant, or RDP when the PRV computation fails (labelled as such).
    """
    acc = record.accountant
    eps_rdp = float(acc.get_epsilon(delta, accountant="rdp"))
    try:
        eps_prv: float | None = float(acc.get_epsilon_bounds(delta)[2])
    except ValueError as err:  # PRV failed numerically
        logger.warning("hf_dp: PRV accounting failed (%s); the card reports which accountant produced ε.", err)
        eps_prv = None
    spent = None
    try:
        spent = record.spent(delta)
    except Exception as err:  # noqa: BLE001 - the card falls back to its own computation, said below
        logger.warning("hf_dp: the record's ε failed (%s); the card computes ε from the accountant.", err)
    if isinstance(spent, Mapping) and spent.get("accountant_used"):
        return float(spent["epsilon"]), eps_prv, eps_rdp, str(spent["accountant_used"])
    configured = str(record.accountant_name or "prv")
    if configured == "rdp":
        return eps_rdp, eps_prv, eps_rdp, "rdp"
    if eps_prv is None:
        return eps_rdp, eps_prv, eps_rdp, "rdp (prv-accountant failed numerically)"
    return eps_prv, eps_prv, eps_rdp, configured


def _aggregate_mechanisms(history: Sequence[Any]) -> list[dict[str, Any]]:
    """The accountant's history, equal (σ, q) merged, as the accountant composes them."""
    counts: dict[tuple[float, float], int] = {}
    for r in history:
        key = (float(r.noise_multiplier), float(r.sample_rate))
        counts[key] = counts.get(key, 0) + int(r.steps)
    return [{"noise_multiplier": s, "sampling_rate": q, "steps": n} for (s, q), n in counts.items() if n > 0]


class _Mech:
    """A mechanism of a run entry (a mapping) read as the accountant's records are (attributes)."""

    def __init__(self, m: Mapping[str, Any]):
        self.noise_multiplier, self.sample_rate, self.steps = m["noise_multiplier"], m["sample_rate"], m["steps"]


def _round(x: float | None, digits: int = 6) -> float | None:
    if x is None or not math.isfinite(x):
        return x
    return float(f"{x:.{digits}g}")


# ------------------------------------------------------------------------------------------------ the metadata
def _as_record(source: Any) -> PrivacyRecord:
    """The :class:`~hf_dp.record.PrivacyRecord` of ``source``: a record, or a run that produces one through a public
    ``privacy_record()`` method (``DPTrainer``; read once, never its internals)."""
    if isinstance(source, PrivacyRecord):
        return source
    make = getattr(source, "privacy_record", None)
    if callable(make):
        return make()
    raise TypeError(f"expected a PrivacyRecord (DPTrainer.privacy_record(), PrivacyRecord.load('dp_state.json')), "
                    f"got {type(source).__name__}")


def privacy_metadata(record: PrivacyRecord) -> dict[str, Any]:
    """The ``differential_privacy`` record of a run (a YAML-safe dict), from its :class:`~hf_dp.record.PrivacyRecord`.

    Reads the record only (its accountant and its description of the run), never a training example. Optional
    fields appear when the run has them: ``group_thresholds`` (group-wise clipping; the final thresholds for
    adaptive clipping) and ``adaptive_clipping``, the user-level settings (``user_id_column``, ...), ``base_model``
    (a Hub id, or ``"local files <name>"`` for a local directory).

    Args:
        record: The run's record, after at least one DP step (``DPTrainer.privacy_record()``, or
            ``PrivacyRecord.load("dp_state.json")``); a run with a ``privacy_record()`` method (a ``DPTrainer``)
            is read through that method.

    Returns:
        The mapping described in :data:`REQUIRED_KEYS` (plus optional keys): ``epsilon`` is the guarantee the record
        reports (its configured accountant; the PRV upper bound by default), ``epsilon_prv`` the PRV upper bound and
        ``epsilon_rdp`` the RDP bound, all at ``delta``; ``mechanisms`` lists the (σ, q, steps) phases the
        accountant composed, enough to recompute ε without hf_dp.

    Raises:
        ValueError: If no DP step has run yet (there is no guarantee to describe).
    """
    record = _as_record(record)
    acc = record.accountant
    steps = int(acc.steps)
    if steps == 0:
        raise ValueError("No DP step has been recorded yet: train before writing privacy metadata.")
    delta = float(record.delta)
    eps, eps_prv, eps_rdp, accountant_used = _epsilons(record, delta)
    C = float(record.per_sample_max_grad_norm)
    mechanisms = _aggregate_mechanisms(acc.history)
    group_thresholds = record.group_thresholds
    # L2 sensitivity of one step's summed clipped gradient: C (flat), ‖(C_1..C_K)‖ (groups; He et al. 2023 §3.3).
    sensitivity = C
    values = list(group_thresholds.values()) if isinstance(group_thresholds, Mapping) else group_thresholds
    if isinstance(values, list) and values and all(_is_number(v) for v in values):
        sensitivity = math.sqrt(sum(float(v) ** 2 for v in values))
    unit = str(record.privacy_unit or "example")

    rec: dict[str, Any] = {
        "epsilon": _round(eps),
        "epsilon_prv": _round(eps_prv),
        "epsilon_rdp": _round(eps_rdp),
        "delta": float(delta),
        "target_epsilon": plain(record.target_epsilon),
        "accountant": str(record.accountant_name),
        "accountant_used": accountant_used,
        "accountant_library": "prv-accountant",
        "prv_accountant_version": str(record.prv_accountant_version or acc.state_dict().get("prv_accountant_version")
                                      or package_version("prv-accountant")),
        "eps_error": float(acc.eps_error),
        "delta_error": float(acc.delta_error) if acc.delta_error is not None else float(delta) / 1000,
        "noise_multiplier": plain(record.noise_multiplier),
        "sampling_rate": float(record.sample_rate),
        "sampling": "poisson" if record.poisson_sampling else "shuffled",
        "steps": steps,
        "epochs": _round(sum(m["steps"] * m["sampling_rate"] for m in mechanisms), 4),
        "expected_batch_size": int(record.expected_batch_size),
        "dataset_size": int(record.num_examples),
        "per_sample_max_grad_norm": C,
        "l2_sensitivity": _round(sensitivity),
        "clipping": str(record.clipping),
    }
    if group_thresholds is not None:
        rec["group_thresholds"] = plain(group_thresholds)
    if record.adaptive_clipping is not None:
        rec["adaptive_clipping"] = plain(record.adaptive_clipping)
    rec["noise_allocation"] = str(record.noise_allocation or "global")
    rec["privacy_unit"] = unit
    if record.privacy_unit_detail:  # e.g. rows that look like fixed-length blocks of concatenated text (units.py)
        rec["privacy_unit_detail"] = str(record.privacy_unit_detail)
    if unit == "user":
        rec["user_id_column"] = None if record.user_id_column is None else str(record.user_id_column)
        for key in ("max_examples_per_user", "user_contribution"):
            value = getattr(record, key)
            if value is not None:
                rec[key] = plain(value)
        if record.num_rows is not None:  # rows (examples) of all users; dataset_size counts users
            rec["num_examples"] = int(record.num_rows)
    if record.example_description:  # what one example (row) is, e.g. a preference row of two sequences
        rec["example_description"] = str(record.example_description)
    # An old dp_state.json (before the record) does not say which parameters were trained, nor the optimizer.
    rec["trained_parameters"] = plain(record.trained_parameters or {"method": UNKNOWN})
    if record.base_model:  # what the guarantee does not cover: the base model's (non-private) pre-training
        rec["base_model"] = str(record.base_model)
    rec["mechanisms"] = mechanisms
    rec["optimizer"] = str(record.optimizer) if record.optimizer else f"{UNKNOWN} ({_NOT_RECORDED})"
    rec["dp_seed"] = {"fixed": "fixed (known seed: voids the guarantee)", "secret": "secret (drawn from the OS)"}.get(
        record.dp_seed, f"{UNKNOWN} ({_NOT_RECORDED})")
    if record.secure_mode:
        rec["noise_source"] = ("secure mode: a fresh 64-bit OS seed per step, 4 Gaussian draws per coordinate "
                               "(Holohan & Braghin 2021, §5.1, as Opacus' secure_mode)")
    else:
        rec["noise_source"] = "torch generator; per-step seeds derived from the run's seed"
    if record.earlier_runs:  # the model carried earlier DP training (history.py): composed into ε and the steps
        earlier = [dict(e) for e in record.earlier_runs if isinstance(e, Mapping)]
        earlier_steps = sum(int(e.get("steps") or 0) for e in earlier)
        rec["continues_from"] = {
            "runs": len(earlier),
            "steps": earlier_steps,
            "this_run_steps": steps - earlier_steps,
            "mechanisms": _aggregate_mechanisms([_Mech(m) for e in earlier for m in e.get("mechanisms") or []]),
            "privacy_units": sorted({str(e.get("privacy_unit") or "example") for e in earlier}),
        }
    rec["budget_exhausted"] = bool(record.budget_exhausted)
    rec["dp_guarantee"] = str(record.dp_guarantee)
    rec["hf_dp_version"] = str(record.hf_dp_version)
    return rec


# ------------------------------------------------------------------------------------------------ the card body
def reproduce_epsilon_code(dp: Mapping[str, Any]) -> str:
    """Python code that recomputes the record's ε with ``prv-accountant`` alone (PRV upper bound and RDP)."""
    delta = dp["delta"]
    prvs, steps = [], []
    for m in dp["mechanisms"]:
        if m["sampling_rate"] == 1.0:  # no subsampling: the plain Gaussian mechanism (as hf_dp's accountant)
            prvs.append(f"GaussianMechanism(noise_multiplier={m['noise_multiplier']!r})")
        else:
            prvs.append(f"PoissonSubsampledGaussianMechanism(sampling_probability={m['sampling_rate']!r}, "
                        f"noise_multiplier={m['noise_multiplier']!r})")
        steps.append(int(m["steps"]))
    prv_list = ",\n    ".join(prvs)
    return (
        f"# pip install prv-accountant=={dp.get('prv_accountant_version', '0.2.0')}\n"
        "from prv_accountant import GaussianMechanism, PoissonSubsampledGaussianMechanism, PRVAccountant\n"
        "from prv_accountant.other_accountants import RDP\n"
        "\n"
        f"prvs = [\n    {prv_list},\n]\n"
        f"steps = {steps!r}\n"
        f"delta = {delta!r}\n"
        f"acc = PRVAccountant(prvs=prvs, max_self_compositions=steps, eps_error={dp.get('eps_error', 0.01)!r}, "
        f"delta_error={dp.get('delta_error', delta / 1000)!r})\n"
        "eps_low, eps_estimate, eps_up = acc.compute_epsilon(delta=delta, num_self_compositions=steps)\n"
        f"print(eps_up)  # epsilon_prv = {dp.get('epsilon_prv')}\n"
        f"print(RDP(prvs=prvs).compute_epsilon(delta=delta, num_self_compositions=steps)[2])"
        f"  # epsilon_rdp = {dp.get('epsilon_rdp')}"
    )


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        x = float(x)
        if math.isinf(x):
            return "∞"
        return f"{x:.{digits}g}"
    return str(x)


def _guarantee_notes(dp: Mapping[str, Any]) -> list[str]:
    g = str(dp.get("dp_guarantee", ""))
    if g.startswith("not strict"):
        rest = g.split(":", 1)[1] if ":" in g else g
        return [n.strip() for n in rest.split(";") if n.strip()]
    return []


def common_template_kwargs(dp: Mapping[str, Any]) -> dict[str, Any]:
    """The data both card templates read besides the card metadata: the record ``dp`` and what their words
    (``templates/dp_card_phrases.md``) need that Jinja does not compute: number formatting, e^ε, the guarantee's
    notes as a list and the installed ``dp-accounting`` version (named when the PLD accountant produced ε)."""
    eps = dp.get("epsilon")
    if eps is None or not math.isfinite(float(eps)) or float(eps) > 700:
        exp_eps = "∞"
    else:
        e = math.exp(float(eps))
        exp_eps = f"{e:,.0f}" if 1e3 <= e < 1e9 else _fmt(e)
    return {
        "dp": dict(dp),
        "fmt": _fmt,
        "exp_eps_text": exp_eps,
        "guarantee_notes": _guarantee_notes(dp),
        "dp_accounting_version": package_version("dp-accounting") or "",
    }


def _versions(is_peft: bool) -> list[tuple[str, str]]:
    names = ["hf_dp", "prv-accountant", "transformers", "torch", "huggingface_hub", "datasets"]
    if is_peft:
        names.insert(2, "peft")
    return [(n, v) for n in names if (v := package_version(n)) is not None]


def _hub_base_models(value: Any, check_local: bool = True) -> Any:
    """``value`` of a YAML ``base_model`` field without the entries that are not Hub ids (None if none is left)."""
    if isinstance(value, str):
        return value if is_hub_model_id(value, check_local) else None
    if isinstance(value, list):
        kept = [v for v in value if is_hub_model_id(v, check_local)]
        return kept or None
    return None


def merge_tags(*groups: Sequence[str] | str | None) -> list[str]:
    out: list[str] = []
    for g in groups:
        if g is None:
            continue
        for t in [g] if isinstance(g, str) else g:
            if t and t not in out:
                out.append(str(t))
    return out


_TASK_PIPELINE = {"causal_lm": "text-generation", "seq2seq_lm": "text2text-generation", "masked_lm": "fill-mask",
                  "sequence_classification": "text-classification", "token_classification": "token-classification"}
_NOT_METRICS = ("runtime", "samples_per_second", "steps_per_second", "model_preparation_time", "epoch", "step")


def _eval_results(eval_metrics: Mapping[str, Any] | None, task: str, dataset_label: str | None,
                  dataset_id: str | None, eval_dataset_name: str | None = None, eval_dataset_type: str | None = None,
                  eval_dataset_split: str | None = None) -> list[EvalResult]:
    """``EvalResult``s of the latest evaluation (a log entry with ``eval_*`` metrics, without runtimes), for the
    card's ``model-index``; only called when the evaluation data is declared public."""
    if not eval_metrics:
        return []
    name = eval_dataset_name or (f"{dataset_label}, evaluation split" if dataset_label else "evaluation set")
    kind = eval_dataset_type or dataset_id or name
    out = []
    for key, value in eval_metrics.items():
        metric = str(key)[len("eval_"):]
        if not str(key).startswith("eval_") or metric.endswith(_NOT_METRICS) or not _is_number(value):
            continue
        out.append(EvalResult(task_type=task, dataset_type=kind, dataset_name=name, dataset_split=eval_dataset_split,
                              metric_type=metric, metric_name=metric, metric_value=_round(float(value))))
    return out


def _base_model(record: PrivacyRecord, explicit: Any = None) -> tuple[list[str], str | None]:
    """``(hub_ids, local)``: where the model was fine-tuned from. ``explicit`` (``finetuned_from`` / ``base_model``
    given by the caller: a name, a path, or a list of them) wins over the record's ``base_model``
    (:func:`hf_dp.record.name_base_models`)."""
    hub_ids, local = name_base_models(explicit)
    if hub_ids or local:
        return hub_ids, local
    return split_base_model(record.base_model)


def _optimizer_tag(record: PrivacyRecord) -> str:
    return "dp-adam" if str(record.optimizer or "").startswith("DP-Adam") else "dp-sgd"


def render_model_card(record: PrivacyRecord, model_name: str | None = None, dataset_name: str | None = None,
                      tags: Sequence[str] | str | None = None, *,
                      hyperparameters: Sequence[tuple[str, Any]] | None = None,
                      eval_metrics: Mapping[str, Any] | None = None, task: str | None = None,
                      **kwargs: Any) -> ModelCard:
    """Renders the full hf_dp model card of a run (template ``dp_model_card.md``) from its record, without writing it.

    Args:
        record: The run's :class:`~hf_dp.record.PrivacyRecord` (``DPTrainer.privacy_record()`` or
            ``PrivacyRecord.load("dp_state.json")``), or a run with public ``privacy_record()`` and
            ``card_inputs(tags)`` methods (a ``DPTrainer``): its record, and its plain card data for the
            ``tags``/``hyperparameters``/``eval_metrics``/``task`` not given here.
        model_name: Title of the card (default: ``"model"``).
        dataset_name: Name or Hub id of the private training data set (YAML ``datasets``).
        tags: Extra tags (``differential-privacy``, ``dp-sgd``/``dp-adam`` and ``hf_dp`` are always added).
        hyperparameters: ``(name, value)`` pairs for the "Training hyperparameters" section (public settings,
            never a metric computed on the data; ``DPTrainer.card_inputs()`` gathers them).
        eval_metrics: The latest evaluation log entry (``eval_*`` metrics); used only when the record says the
            evaluation data is public (``eval_data_is_public``).
        task: The trainer's task (``causal_lm``, ...), naming the task of the evaluation results.
        **kwargs: ``ModelCardData`` fields (``license``, ``language``, ``base_model``, ``pipeline_tag``, ...) and the
            names ``Trainer.create_model_card`` uses: ``finetuned_from`` (→ ``base_model``), ``dataset`` (→
            ``datasets``), ``tasks`` (→ ``pipeline_tag``), ``dataset_tags``/``dataset_args`` (ignored).
            Evaluation results go into ``model-index`` only when the record's ``eval_data_is_public`` (the
            ``eval_metrics``, or ``eval_results=[EvalResult, ...]`` if given), named by ``eval_dataset_name``,
            ``eval_dataset_type`` (a Hub id; default: the training ``datasets`` id) and ``eval_dataset_split``;
            without the flag they are left out (results on private data are not covered).
    """
    inputs = getattr(record, "card_inputs", None)
    if not isinstance(record, PrivacyRecord) and callable(inputs):  # a run (DPTrainer): its plain card data
        given = inputs(tags)
        tags = given.get("tags")
        hyperparameters = given.get("hyperparameters") if hyperparameters is None else hyperparameters
        eval_metrics = given.get("eval_metrics") if eval_metrics is None else eval_metrics
        task = given.get("task") if task is None else task
    record = _as_record(record)
    dp = privacy_metadata(record)
    opt_tag = _optimizer_tag(record)
    extra = dict(kwargs)
    finetuned_from = extra.pop("finetuned_from", None)
    hub_ids, base_model_local = _base_model(record, extra.pop("base_model", None) or finetuned_from)
    if hub_ids or base_model_local:
        dp["base_model"] = "; ".join([*hub_ids, *([base_model_local] if base_model_local else [])])
    base_model = hub_ids[0] if hub_ids else None  # the one the body links to
    dataset = extra.pop("dataset", None)
    datasets = extra.pop("datasets", None) or dataset or dataset_name
    if isinstance(datasets, str):
        datasets = [datasets]
    tasks = extra.pop("tasks", None)
    if tasks and "pipeline_tag" not in extra:
        extra["pipeline_tag"] = tasks if isinstance(tasks, str) else tasks[0]
    extra.pop("dataset_tags", None)
    extra.pop("dataset_args", None)
    given_results = extra.pop("eval_results", None)
    eval_names = {k: extra.pop(k, None) for k in ("eval_dataset_name", "eval_dataset_type", "eval_dataset_split")}
    is_peft = "peft" in dp["trained_parameters"]
    all_tags = merge_tags(list(CARD_TAGS[:1]) + [opt_tag] + list(CARD_TAGS[1:]), tags)
    if model_name is None:
        model_name = "model"
    dataset_label = ", ".join(datasets) if datasets else None
    if datasets and not all(_HUB_ID.match(d) for d in datasets):
        datasets = None  # the YAML `datasets` field takes Hub ids; a free-form name goes to the body only
    eval_results = None
    if record.eval_data_is_public:  # declared public or held out: model-index
        task_type = extra.get("pipeline_tag") or _TASK_PIPELINE.get(task) or "other"
        eval_results = given_results or _eval_results(eval_metrics, task_type, dataset_label,
                                                      datasets[0] if datasets else None, **eval_names)
        if eval_results:
            dp["evaluation_results"] = ("in model-index: evaluation data declared public or held out "
                                        "(eval_data_is_public=True), not covered by the guarantee")
    elif given_results:
        logger.warning("hf_dp: eval_results are left out of the card: the evaluation data is not declared public "
                       "(DPTrainingArguments(eval_data_is_public=True)); results on private data are not covered.")
    audit = plain(record.audit) if record.audit else {}
    if audit:  # empirical audits (issue 8): membership inference is computed on private members, not covered
        extra["audit"] = audit
    card_data = ModelCardData(
        eval_results=eval_results or None,
        base_model=(hub_ids if len(hub_ids) > 1 else base_model),
        datasets=datasets,
        library_name="peft" if is_peft else "transformers",
        model_name=model_name,
        tags=all_tags,
        differential_privacy=dp,
        **extra,
    )
    template_kwargs = common_template_kwargs(dp)
    template_kwargs.update(
        model_name=model_name,
        base_model=base_model,
        base_model_local=base_model_local,
        dataset_name=dataset_label,
        optimizer_tag=opt_tag,
        is_peft=is_peft,
        load_best_model_at_end=bool(record.load_best_model_at_end),
        reproduce_code=reproduce_epsilon_code(dp),
        eval_results=[(r.metric_type, _fmt(r.metric_value, 4)) for r in eval_results or []],
        eval_dataset=(eval_results[0].dataset_name if eval_results else None),
        audit=audit,
        hyperparameters=list(hyperparameters or []),
        versions=_versions(is_peft),
    )
    return ModelCard.from_template(card_data, template_str=card_template(MODEL_CARD_TEMPLATE), **template_kwargs)


def _block(text: str) -> str:
    """The hf_dp block (markers included) of a card body."""
    start, end = text.index(BLOCK_BEGIN), text.index(BLOCK_END) + len(BLOCK_END)
    return text[start:end]


def _splice_block(existing: str, block: str) -> str:
    """Replaces the hf_dp block of ``existing``; inserts it before the first ``##`` heading if there is none."""
    if BLOCK_BEGIN in existing and BLOCK_END in existing:
        start, end = existing.index(BLOCK_BEGIN), existing.index(BLOCK_END) + len(BLOCK_END)
        return existing[:start] + block + existing[end:]
    lines = existing.split("\n")
    seen_title = False
    for i, line in enumerate(lines):
        if line.startswith("# "):
            seen_title = True
        elif line.startswith("## ") and (seen_title or i > 0):
            return "\n".join(lines[:i] + [block, ""] + lines[i:])
    return existing.rstrip("\n") + "\n\n" + block + "\n"


def _merge_into(existing: RepoCard, ours: RepoCard, explicit_keys: Sequence[str]) -> RepoCard:
    """``existing`` with hf_dp's metadata and block added: its own metadata and body are kept."""
    data = existing.data.to_dict()
    new = ours.data.to_dict()
    for key in _OWNED_KEYS:  # hf_dp's own records: always the current ones
        data.pop(key, None)
        if key in new:
            data[key] = new[key]
    data["tags"] = merge_tags(data.get("tags"), new.get("tags"))
    for key in ("base_model", "datasets", "license", "language", "pipeline_tag", *explicit_keys):
        if new.get(key) not in (None, "", []) and (key in explicit_keys or data.get(key) in (None, "", [])):
            data[key] = new[key]
    text = _splice_block(existing.text, _block(ours.text))
    if ours.data.get("model_name"):  # peft's placeholder title
        text = text.replace("# Model Card for Model ID\n", f"# {ours.data.get('model_name')}\n", 1)
    merged_yaml = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    return type(ours)(f"---\n{merged_yaml}---\n{text}")


def _carry_over(existing: RepoCard, ours: RepoCard) -> RepoCard:
    """``ours`` plus the metadata of ``existing`` that ``ours`` does not set (e.g. a license given earlier)."""
    data = ours.data.to_dict()
    old = existing.data.to_dict()
    changed = False
    for key, value in old.items():
        if key not in (*_OWNED_KEYS, *_RENDERED_KEYS) and data.get(key) in (None, "", []) and \
                value not in (None, "", []):
            data[key] = value
            changed = True
    tags = merge_tags(data.get("tags"), old.get("tags"))
    if tags != data.get("tags"):
        data["tags"], changed = tags, True
    if not changed:
        return ours
    return type(ours)(f"---\n{yaml.safe_dump(data, sort_keys=False, allow_unicode=True)}---\n{ours.text}")


def _is_full_hf_dp_card(card: RepoCard) -> bool:
    return CARD_MARKER in card.text and card.data.get("library_name") != "peft"


def write_card(path: Path, card: RepoCard, explicit_keys: Sequence[str]) -> RepoCard:
    """Writes ``card`` to ``path``, merging with an existing README that hf_dp did not write in full."""
    if path.is_file():
        existing = type(card).load(path)
        tags = existing.data.get("tags") or []
        if _is_full_hf_dp_card(existing):
            card = _carry_over(existing, card)  # ours: re-rendered in full, keeping metadata set earlier
        elif "generated_from_trainer" in tags and BLOCK_BEGIN not in existing.text:
            # transformers' TrainingSummary card for this run: it reports the training loss (private); replace it.
            logger.info("hf_dp: replacing the transformers-generated card %s (it reports the training loss).", path)
        else:
            card = _merge_into(existing, card, explicit_keys)
    card = _without_local_base_model(card)
    card = _canonical(card)
    validate_card(card)
    card.save(path)
    return card


def _without_local_base_model(card: RepoCard) -> RepoCard:
    """``card`` without the YAML ``base_model`` entries that are local paths.

    They come from a README written by someone else (peft writes ``base_model: <config._name_or_path>``, a local
    directory when the base model was loaded from one) or from an older card. The card's hf_dp block and its
    ``differential_privacy`` record already name such a base model as ``local files <name>``.
    """
    data = card.data.to_dict()
    if "base_model" not in data:
        return card
    kept = _hub_base_models(data["base_model"])
    if kept == data["base_model"]:
        return card
    logger.info("hf_dp: dropping base_model %r from the card metadata: not a Hub model id (a local path).",
                data["base_model"])
    if kept is None:
        del data["base_model"]
    else:
        data["base_model"] = kept
    return type(card)(f"---\n{yaml.safe_dump(data, sort_keys=False, allow_unicode=True)}---\n{card.text}")


_LAST_KEYS = ("audit", "synthetic_data", "differential_privacy")


def _canonical(card: RepoCard) -> RepoCard:
    """The card with its metadata keys in a fixed order (sorted; the hf_dp mappings last), so rewrites are stable."""
    data = card.data.to_dict()
    ordered = {k: data[k] for k in sorted(data) if k not in _LAST_KEYS}
    ordered.update({k: data[k] for k in _LAST_KEYS if k in data})
    return type(card)(f"---\n{yaml.safe_dump(ordered, sort_keys=False, allow_unicode=True)}---\n{card.text}")


def create_model_card(record: PrivacyRecord, output_dir: str | os.PathLike, model_name: str | None = None,
                      dataset_name: str | None = None, tags: Sequence[str] | str | None = None,
                      **kwargs: Any) -> ModelCard:
    """Writes ``output_dir/README.md``: the model card with the ``differential_privacy`` metadata.

    A card written by hf_dp is re-rendered in full. A README written by someone else — in particular the one
    ``peft`` writes next to an adapter (``library_name: peft``) — is merged: its metadata and body are kept, the
    ``differential_privacy`` mapping and the tags are added, and the hf_dp block (between ``<!-- hf_dp:begin -->``
    and ``<!-- hf_dp:end -->``) is inserted or replaced. The card is validated (:func:`validate_card`) before it is
    written. ``DPTrainer`` calls this on the processes that save, with its record and ``card_inputs()``.

    Args:
        record: The run's :class:`~hf_dp.record.PrivacyRecord`, or a ``DPTrainer`` (as for :func:`render_model_card`).
        output_dir: Where to write.
        model_name: Title of the card (default: the name of ``output_dir``).
        dataset_name, tags, **kwargs: As for :func:`render_model_card`.

    Returns:
        The card written.
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if model_name is None:
        model_name = out.name or None
    card = render_model_card(record, model_name=model_name, dataset_name=dataset_name, tags=tags, **kwargs)
    explicit = [k for k in ("license", "language", "base_model", "pipeline_tag") if kwargs.get(k)]
    if kwargs.get("finetuned_from"):
        explicit.append("base_model")
    if dataset_name or kwargs.get("dataset") or kwargs.get("datasets"):
        explicit.append("datasets")
    return write_card(out / "README.md", card, explicit)


def card_from_dp_state(path: str | os.PathLike, output_dir: str | os.PathLike | None = None,
                       **metadata: Any) -> ModelCard:
    """The model card of a run from its ``dp_state.json`` alone (what a Hub user downloads next to the weights).

    The ``differential_privacy`` metadata is the one the trainer wrote (same keys, same values: the record is the
    run's); what the file does not hold (hyperparameters, evaluation metrics, tags of the model, license, ...) can be
    given as ``metadata`` (see :func:`render_model_card`). The card is validated; with ``output_dir`` it is written
    there (merged with an existing README, as :func:`create_model_card` does).

    Args:
        path: ``dp_state.json``, or a directory holding it (a saved model or checkpoint).
        output_dir: Where to write ``README.md`` (default: return the card without writing it).
        **metadata: ``model_name``, ``dataset_name``, ``tags``, ``license``, ... as for :func:`render_model_card`.
    """
    record = PrivacyRecord.load(path)
    if output_dir is not None:
        return create_model_card(record, output_dir, **metadata)
    card = render_model_card(record, **metadata)
    validate_card(card)
    return card


# ------------------------------------------------------------------------------------------- validate / read back
def _load_any(path_or_card: Any, card_cls: type[RepoCard] = ModelCard) -> tuple[RepoCard, str]:
    """(card, description) from a card object, card text, a README path or a directory holding README.md."""
    if isinstance(path_or_card, RepoCard):
        text = str(path_or_card)
        label = f"{type(path_or_card).__name__} object"
        try:  # the YAML round trip: what would be written must parse back
            return type(path_or_card)(text), label
        except Exception as err:
            raise ValueError(f"{label}: its metadata does not parse back from YAML: {err}") from err
    if isinstance(path_or_card, str) and path_or_card.lstrip().startswith("---"):
        try:
            return card_cls(path_or_card), "card text"
        except Exception as err:
            raise ValueError(f"card text: the YAML metadata does not parse: {err}") from err
    path = Path(path_or_card)
    if path.is_dir():
        path = path / "README.md"
    if not path.is_file():
        raise FileNotFoundError(f"No model card at {path} (expected a README.md, or a directory holding one).")
    try:
        return card_cls.load(path), str(path)
    except Exception as err:
        raise ValueError(f"{path}: the YAML metadata does not parse: {err}") from err


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and not (isinstance(x, float) and math.isnan(x))


def _check_type(kind: str, x: Any) -> bool:
    if kind == _NUMBER:
        return _is_number(x)
    if kind == _INT:
        return isinstance(x, int) and not isinstance(x, bool)
    if kind == _STR:
        return isinstance(x, str)
    if kind == _MAP:
        return isinstance(x, Mapping)
    if kind == _LIST:
        return isinstance(x, list)
    raise AssertionError(kind)  # pragma: no cover


def record_problems(dp: Any) -> list[str]:
    if not isinstance(dp, Mapping):
        return [f"`differential_privacy` must be a mapping, got {type(dp).__name__}"]
    problems = []
    for key, kind in REQUIRED_KEYS.items():
        if key not in dp:
            problems.append(f"missing key `differential_privacy.{key}`")
        elif not _check_type(kind, dp[key]):
            problems.append(f"`differential_privacy.{key}` must be a {kind}, got {dp[key]!r}")
    if problems:
        return problems

    def bad(key: str, why: str) -> None:
        problems.append(f"`differential_privacy.{key}` {why}, got {dp[key]!r}")

    for key in ("epsilon", "epsilon_rdp", "noise_multiplier", "epochs"):
        if dp[key] < 0:
            bad(key, "must be >= 0")
    if dp.get("epsilon_prv") is not None and not (_is_number(dp["epsilon_prv"]) and dp["epsilon_prv"] >= 0):
        bad("epsilon_prv", "must be a number >= 0 or null")
    if not 0 < dp["delta"] < 1:
        bad("delta", "must be in (0, 1)")
    if not 0 < dp["sampling_rate"] <= 1:
        bad("sampling_rate", "must be in (0, 1]")
    for key in ("per_sample_max_grad_norm", "l2_sensitivity", "eps_error"):
        if not dp[key] > 0:
            bad(key, "must be > 0")
    for key in ("expected_batch_size", "dataset_size"):
        if dp[key] <= 0:
            bad(key, "must be > 0")
    if dp["steps"] < 0:
        bad("steps", "must be >= 0")
    if dp["accountant"] not in _ACCOUNTANTS:
        bad("accountant", f"must be one of {_ACCOUNTANTS}")
    if "accountant_used" in dp and not isinstance(dp["accountant_used"], str):
        bad("accountant_used", "must be a string (the accountant that produced `epsilon`)")
    if dp["sampling"] not in _SAMPLING:
        bad("sampling", f"must be one of {_SAMPLING}")
    if dp["privacy_unit"] not in _UNITS:
        bad("privacy_unit", f"must be one of {_UNITS}")
    elif dp["privacy_unit"] == "user" and not isinstance(dp.get("user_id_column"), str):
        problems.append("`differential_privacy.user_id_column` (a string) is required when privacy_unit is 'user'")
    if not (dp["dp_guarantee"] == "strict" or dp["dp_guarantee"].startswith("not strict")):
        bad("dp_guarantee", "must be 'strict' or start with 'not strict'")
    tp = dp["trained_parameters"]
    if not isinstance(tp.get("method"), str):
        problems.append(f"`differential_privacy.trained_parameters.method` must be a str, got {tp.get('method')!r}")
    count_ok = isinstance(tp.get("count"), int) and not isinstance(tp.get("count"), bool) and tp["count"] >= 0
    if not count_ok and not (tp.get("method") == UNKNOWN and tp.get("count") is None):  # old dp_state.json
        problems.append(f"`differential_privacy.trained_parameters.count` must be an int >= 0, got {tp.get('count')!r}")
    total = 0
    for i, m in enumerate(dp["mechanisms"]):
        ok = (isinstance(m, Mapping) and _is_number(m.get("noise_multiplier")) and m["noise_multiplier"] >= 0
              and _is_number(m.get("sampling_rate")) and 0 < m["sampling_rate"] <= 1
              and isinstance(m.get("steps"), int) and m["steps"] >= 0)
        if not ok:
            problems.append(f"`differential_privacy.mechanisms[{i}]` must be a mapping with noise_multiplier >= 0, "
                            f"sampling_rate in (0, 1] and integer steps >= 0, got {m!r}")
        else:
            total += m["steps"]
    if not problems and total != dp["steps"]:
        problems.append(f"`differential_privacy.steps` ({dp['steps']}) differs from the steps of its mechanisms "
                        f"({total})")
    return problems


def validate_card(path_or_card: Any) -> None:
    """Local validation of a card's privacy metadata (the Hub's YAML validation endpoint needs the network).

    Checks that the YAML metadata parses (``ModelCard.load`` for files; a ``str(card)`` round trip for card objects),
    that it has a ``differential_privacy`` mapping with every key of :data:`REQUIRED_KEYS` of the right type and in
    range (δ in (0, 1), q in (0, 1], ...), that the mechanisms add up to the steps, that the tags include
    ``differential-privacy``, and that ``base_model`` (if set) holds Hub model ids, not local paths (which the Hub's
    validation rejects). Works for model cards and for hf_dp's synthetic-data dataset cards.

    Args:
        path_or_card: A ``ModelCard``/``DatasetCard``, card text (starting with ``---``), a README path, or a
            directory holding ``README.md``.

    Raises:
        ValueError: Listing everything that is wrong.
        FileNotFoundError: If there is no card at the path.
    """
    card, label = _load_any(path_or_card)
    data = card.data.to_dict()
    problems = _privacy_problems(data)
    if "base_model" in data and _hub_base_models(data["base_model"], check_local=False) != data["base_model"]:
        problems.append(f"`base_model` must be Hub model ids ('name' or 'namespace/name'), got "
                        f"{data['base_model']!r}: a local path renders as a broken link and fails the Hub's metadata "
                        "validation (hf_dp names a local base model as 'local files <name>' in the card body)")
    if problems:
        raise ValueError(f"Invalid hf_dp card ({label}):\n  - " + "\n  - ".join(problems))


def _privacy_problems(data: Mapping[str, Any]) -> list[str]:
    """What is wrong with the privacy metadata (``differential_privacy``, tags, ``synthetic_data``) of a card."""
    problems = []
    if "differential_privacy" not in data:
        problems.append("no `differential_privacy` metadata")
    else:
        problems += record_problems(data["differential_privacy"])
    tags = data.get("tags") or []
    if not isinstance(tags, list) or "differential-privacy" not in tags:
        problems.append(f"tags must include 'differential-privacy', got {tags!r}")
    if "synthetic_data" in data and not isinstance(data["synthetic_data"], Mapping):
        problems.append(f"`synthetic_data` must be a mapping, got {data['synthetic_data']!r}")
    return problems


def privacy_report(card_or_repo_dir: Any) -> dict[str, Any]:
    """The ``differential_privacy`` record of a model or dataset card written by hf_dp.

    Args:
        card_or_repo_dir: A local repo directory (holding ``README.md``), a README path, card text, or a
            ``ModelCard``/``DatasetCard``.

    Returns:
        A copy of the record (ε, δ, mechanism, privacy unit, trained parameters, ``dp_guarantee``, ...).

    Raises:
        ValueError: If the card has no privacy metadata (the model's guarantee is then unknown: hf_dp does not
            guess), or if the metadata is malformed (see :func:`validate_card`).
        FileNotFoundError: If there is no card at the path.
    """
    card, label = _load_any(card_or_repo_dir)
    data = card.data.to_dict()
    if "differential_privacy" not in data:
        raise ValueError(
            f"{label} has no `differential_privacy` metadata: it was not written by hf_dp (or the metadata was "
            "removed), so nothing is known about a privacy guarantee for this model. Do not assume one."
        )
    problems = _privacy_problems(data)  # the privacy metadata only: e.g. a local `base_model` does not hide it
    if problems:
        raise ValueError(f"Invalid hf_dp card ({label}):\n  - " + "\n  - ".join(problems))
    return dict(data["differential_privacy"])
