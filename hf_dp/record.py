"""``PrivacyRecord``: the one description of a DP run's guarantee, produced by the trainer and read by everything else.

A record is a frozen description of the run (δ, σ, q, N, C, clipping, privacy unit, sampling, accountant, noise
source, trained parameters, optimizer, base model, guarantee notes, ...) plus the run's live
:class:`~hf_dp.accounting.PrivacyAccountant` (its history is the composed mechanisms). ``DPTrainer.privacy_record()``
builds one; the logs (:meth:`PrivacyRecord.log_fields`), ``privacy_spent()`` (:meth:`PrivacyRecord.spent`),
``dp_state.json`` (:meth:`PrivacyRecord.to_dict`), the model card and the dataset card of synthetic data
(``hf_dp.cards.privacy_metadata``) and the audit reports all read it, so they cannot disagree::

    DPTrainer ──privacy_record()──▶ PrivacyRecord ──▶ log() · privacy_spent() · dp_state.json · cards · audits
                                          ▲
    dp_state.json ──PrivacyRecord.load()──┘   (resume, or a Hub user rendering and validating the card)

ε is computed in one place, :meth:`PrivacyRecord.epsilon`: the configured accountant (PRV upper bound by default,
Gopi, Lee & Wutschitz 2021) on a discretisation sized for exactly the steps taken. The helpers at the end describe
what only the trainer sees (trained parameters, optimizer, base model) as plain data for the record.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import numbers
import os
import re
from collections.abc import Mapping, Sequence
from importlib import metadata as _metadata
from typing import Any

from .accounting import PrivacyAccountant

__all__ = ["LOCAL_BASE_MODEL_PREFIX", "PrivacyRecord", "describe_optimizer", "describe_trained_parameters",
           "is_hub_model_id", "name_base_models", "plain"]

_PEFT_METHODS = {"LORA": "lora", "PREFIX_TUNING": "prefix", "PROMPT_TUNING": "prompt", "P_TUNING": "p-tuning"}


# ------------------------------------------------------------------------------------------------------ helpers
def package_version(dist: str) -> str | None:
    try:
        return _metadata.version(dist)
    except _metadata.PackageNotFoundError:
        return None


def _hf_dp_version() -> str:
    return package_version("hf_dp") or "unknown"


def plain(x: Any) -> Any:
    """Converts tensors, numpy scalars/arrays, enums, sets and tuples into YAML-safe Python values."""
    if isinstance(x, enum.Enum):  # before str: transformers' ExplicitEnum subclasses str
        return plain(x.value)
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, numbers.Integral):
        return int(x)
    if isinstance(x, numbers.Real):
        return float(x)
    if hasattr(x, "tolist") and callable(x.tolist):  # torch.Tensor, numpy arrays and scalars
        return plain(x.tolist())
    if hasattr(x, "item") and callable(x.item):
        return plain(x.item())
    if isinstance(x, Mapping):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (set, frozenset)):
        return sorted((plain(v) for v in x), key=str)
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return str(x)




def _old_dp_seed(state: Mapping[str, Any]) -> str:
    """``dp_seed`` of a ``dp_state.json`` written before the record held it: its guarantee notes said "fixed dp_seed"
    whenever the seed was known (``DPTrainer.dp_guarantee_notes``), so a file with notes and without that one had a
    secret seed; a file without ``dp_guarantee`` does not say (``"unknown"``)."""
    guarantee = state.get("dp_guarantee")
    if not isinstance(guarantee, str):
        return "unknown"
    return "fixed" if "fixed dp_seed" in guarantee else "secret"


# ------------------------------------------------------------------------------------------------- the record
@dataclasses.dataclass(frozen=True)
class PrivacyRecord:
    """A DP run's guarantee: a frozen description of the run plus its live accountant.

    The description is a snapshot (``DPTrainer.privacy_record()`` takes a new one whenever it is read); the
    accountant is the trainer's own object, so ε, the steps and the mechanisms are always the current ones.

    Attributes:
        accountant: The run's :class:`~hf_dp.accounting.PrivacyAccountant` (its history: the composed (σ, q, steps)).
        delta: δ of the reported guarantee.
        noise_multiplier: σ of the run (the accounted one; adaptive clipping splits it, ``adaptive_clipping``).
        sample_rate: q = expected batch size / N.
        num_examples: N, the number of privacy units (examples, or users with ``privacy_unit="user"``).
        expected_batch_size: q·N.
        per_sample_max_grad_norm: C.
        target_epsilon: The budget, if the run targeted one.
        clipping: Clipping mode (``flat``, ``per_layer``, ...).
        poisson_sampling: Poisson sampling (else shuffled fixed-size batches: ε is heuristic).
        accountant_name: The configured accountant (``prv`` or ``rdp``).
        noise_allocation: How noise is spread over clipping groups (``global`` for flat clipping).
        group_thresholds: ``{group: C_k}`` (final ones for adaptive clipping), or None for flat clipping.
        adaptive_clipping: Adaptive clipping settings and noise split (Andrew et al. 2021, Prop. 3.1), or None.
        group_clipping: The group clipper's state (thresholds, released fractions), restored on resume.
        privacy_unit: ``example`` or ``user``.
        user_id_column, max_examples_per_user, user_contribution: User-level DP settings (None at example level).
        num_rows: Rows (examples) of all users, with ``privacy_unit="user"``.
        example_description: What one example (row of the training set) is when it is not one model input, e.g. a
            preference row of two sequences (``hf_dp/preference.py``); None for a plain row.
        secure_mode: Noise from fresh OS entropy per step (Holohan & Braghin 2021, §5.1).
        dp_seed: ``"secret"`` (drawn from the OS) or ``"fixed"`` (a known seed: voids the guarantee); ``"unknown"``
            for an old ``dp_state.json`` that does not say.
        trained_parameters: Which parameters were trained (:func:`describe_trained_parameters`).
        optimizer: ``"DP-Adam (AdamW)"``, ``"DP-SGD (SGD)"``, ... (:func:`describe_optimizer`).
        base_model: Where the model was fine-tuned from: Hub ids and/or ``local files <name>``, ``"; "``-joined.
        dp_guarantee: ``"strict"`` or ``"not strict: <reasons>"``.
        load_best_model_at_end: The checkpoint was selected on evaluation metrics.
        budget_exhausted: Training stopped because the budget was spent.
        eval_data_is_public: Evaluation results may be published (declared public or held out).
        audit: Empirical audits (``hf_dp.audit.audit_report``), or None.
        run_id: This run's id (``hf_dp.history``): a resumed run keeps it.
        earlier_runs: The earlier DP runs of the model this run continued from (``hf_dp.history`` run entries: their
            own mechanisms, δ, privacy unit, guarantee); the accountant already holds their mechanisms.
        privacy_unit_detail: What one privacy unit is, where the rows are not what the user may think (e.g. fixed-length
            blocks of concatenated text, ``hf_dp.units``), or None.
        prv_accountant_version, hf_dp_version: Versions the record was made with.
    """

    accountant: PrivacyAccountant = dataclasses.field(repr=False)
    delta: float | None
    noise_multiplier: float | None
    sample_rate: float
    num_examples: int | None
    expected_batch_size: int | None
    per_sample_max_grad_norm: float
    target_epsilon: float | None = None
    clipping: str = "flat"
    poisson_sampling: bool = True
    accountant_name: str = "prv"
    noise_allocation: str = "global"
    group_thresholds: Any = None
    adaptive_clipping: dict[str, Any] | None = None
    group_clipping: dict[str, Any] | None = None
    privacy_unit: str = "example"
    user_id_column: str | None = None
    max_examples_per_user: int | None = None
    user_contribution: str | None = None
    num_rows: int | None = None
    example_description: str | None = None
    secure_mode: bool = False
    dp_seed: str = "secret"
    trained_parameters: dict[str, Any] | None = None
    optimizer: str | None = None
    base_model: str | None = None
    dp_guarantee: str = "strict"
    load_best_model_at_end: bool = False
    budget_exhausted: bool = False
    eval_data_is_public: bool = False
    audit: dict[str, Any] | None = None
    run_id: str | None = None
    earlier_runs: list[dict[str, Any]] | None = None
    privacy_unit_detail: str | None = None
    prv_accountant_version: str | None = None
    hf_dp_version: str = dataclasses.field(default_factory=_hf_dp_version)

    # ------------------------------------------------------------------ ε: the one place it is computed
    @property
    def steps(self) -> int:
        """DP steps taken (read live from the accountant)."""
        return int(self.accountant.steps)

    def _epsilon(self, delta: float | None = None) -> tuple[float, str | None]:
        """(ε at ``delta``, the accountant that produced it), on a discretisation sized for exactly the steps taken."""
        exact = self.accountant.copy()
        exact.planned_steps = None  # not the cheaper run-sized discretisation: the same computation as calibration
        eps = exact.get_epsilon(self.delta if delta is None else float(delta))
        return float(eps), exact.accountant_used

    def epsilon(self, delta: float | None = None) -> float:
        """ε spent so far at ``delta`` (default: the record's δ): the configured accountant's upper bound (PRV by
        default, Gopi et al. 2021; PLD, then RDP, where prv-accountant fails numerically), computed for exactly the
        steps taken. Every report (logs, ``privacy_spent()``, ``dp_state.json``, cards) reads ε from here."""
        return self._epsilon(delta)[0]

    def spent(self, delta: float | None = None) -> dict[str, Any]:
        """What ``DPTrainer.privacy_spent()`` returns: ε at δ, the accountant that produced it, and the mechanism."""
        delta = self.delta if delta is None else delta
        eps, used = self._epsilon(delta)
        return {
            "epsilon": eps,
            "delta": delta,
            "accountant": self.accountant_name,
            "accountant_used": used,
            "steps": self.steps,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "per_sample_max_grad_norm": self.per_sample_max_grad_norm,
            "poisson_sampling": self.poisson_sampling,
            "dp_guarantee": self.dp_guarantee,
        }

    def log_fields(self, final: bool = False) -> dict[str, Any]:
        """What ``DPTrainer.log()`` adds to a training log: ε (4 decimals) and δ; at the end of training
        (``final``, the Trainer's ``train_runtime`` log) also the steps taken and the accountant that produced ε."""
        eps, used = self._epsilon()
        fields: dict[str, Any] = {"epsilon": round(eps, 4), "delta": self.delta}
        if final:
            fields.update(dp_steps=self.steps, dp_accountant=used)
        return fields

    # ------------------------------------------------------------------ dp_state.json
    def to_dict(self) -> dict[str, Any]:
        """The content of ``dp_state.json`` (JSON-safe): the keys resume reads, plus everything a card needs."""
        eps, used = self._epsilon() if self.steps else (0.0, None)
        state = {
            "accountant": self.accountant.state_dict(),
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "per_sample_max_grad_norm": self.per_sample_max_grad_norm,
            "num_examples": self.num_examples,
            "target_epsilon": self.target_epsilon,
            "target_delta": self.delta,
            "poisson_sampling": self.poisson_sampling,
            "clipping": self.clipping,
            "accountant_name": self.accountant_name,
            "epsilon": eps,
            "expected_batch_size": self.expected_batch_size,
            "accountant_used": used,
            "dp_guarantee": self.dp_guarantee,
            "noise_allocation": self.noise_allocation if self.clipping != "flat" else None,
            "group_clipping": self.group_clipping,
            "secure_mode": self.secure_mode,  # noise.py: fresh OS entropy per step, 4-draw Gaussian
            "eval_data_is_public": self.eval_data_is_public,  # release.py / cards.py: eval results published
        }
        if self.prv_accountant_version is not None:
            state["accountant"]["prv_accountant_version"] = self.prv_accountant_version
        state.update({  # since the PrivacyRecord (issue 16): dp_state.json alone renders the card
            "group_thresholds": self.group_thresholds,
            "adaptive_clipping": self.adaptive_clipping,
            "privacy_unit": self.privacy_unit,
            "user_id_column": self.user_id_column,
            "max_examples_per_user": self.max_examples_per_user,
            "user_contribution": self.user_contribution,
            "num_rows": self.num_rows,
            "example_description": self.example_description,
            "dp_seed": self.dp_seed,
            "trained_parameters": self.trained_parameters,
            "optimizer": self.optimizer,
            "base_model": self.base_model,
            "load_best_model_at_end": self.load_best_model_at_end,
            "budget_exhausted": self.budget_exhausted,
            "audit": self.audit,
            "hf_dp_version": self.hf_dp_version,
        })
        state.update({  # issue 22: the model's privacy history (hf_dp/history.py) and what one unit is (units.py)
            "run_id": self.run_id,
            "earlier_runs": self.earlier_runs or None,
            "privacy_unit_detail": self.privacy_unit_detail,
        })
        return plain(state)

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> PrivacyRecord:
        """The record of a ``dp_state.json`` (:meth:`to_dict`); files written before the record (without its new
        keys) load too, with the defaults of a flat-clipping, example-level run where a key is missing."""
        if not isinstance(state, Mapping) or "accountant" not in state:
            raise ValueError("Not a dp_state.json record (no 'accountant').")
        acc_state = state["accountant"]
        accountant = PrivacyAccountant(accountant=acc_state.get("accountant", state.get("accountant_name", "prv")),
                                       eps_error=acc_state.get("eps_error", 0.01))
        accountant.load_state_dict(dict(acc_state))
        clipping = state.get("clipping") or "flat"
        group_clipping = state.get("group_clipping")
        thresholds = state.get("group_thresholds")
        if thresholds is None and isinstance(group_clipping, Mapping):  # older files: from the clipper's state
            names, values = group_clipping.get("groups"), group_clipping.get("thresholds")
            if isinstance(names, list) and isinstance(values, list) and len(names) == len(values):
                thresholds = dict(zip(names, values))
        delta = state.get("target_delta")
        return cls(
            accountant=accountant,
            delta=None if delta is None else float(delta),  # (resume needs only the accountant, σ, q and C)
            noise_multiplier=state["noise_multiplier"],
            sample_rate=float(state["sample_rate"]),
            num_examples=state.get("num_examples"),
            expected_batch_size=state.get("expected_batch_size"),
            per_sample_max_grad_norm=float(state["per_sample_max_grad_norm"]),
            target_epsilon=state.get("target_epsilon"),
            clipping=clipping,
            poisson_sampling=bool(state.get("poisson_sampling", True)),
            accountant_name=state.get("accountant_name") or accountant.accountant,
            noise_allocation=state.get("noise_allocation") or "global",
            group_thresholds=thresholds,
            adaptive_clipping=state.get("adaptive_clipping"),
            group_clipping=group_clipping,
            privacy_unit=state.get("privacy_unit") or "example",
            user_id_column=state.get("user_id_column"),
            max_examples_per_user=state.get("max_examples_per_user"),
            user_contribution=state.get("user_contribution"),
            num_rows=state.get("num_rows"),
            example_description=state.get("example_description"),
            secure_mode=bool(state.get("secure_mode", False)),
            dp_seed=state.get("dp_seed") or _old_dp_seed(state),
            trained_parameters=state.get("trained_parameters"),
            optimizer=state.get("optimizer"),
            base_model=state.get("base_model"),
            dp_guarantee=state.get("dp_guarantee") or "strict",
            load_best_model_at_end=bool(state.get("load_best_model_at_end", False)),
            budget_exhausted=bool(state.get("budget_exhausted", False)),
            eval_data_is_public=bool(state.get("eval_data_is_public", False)),
            audit=state.get("audit"),
            run_id=state.get("run_id"),
            earlier_runs=state.get("earlier_runs") or None,
            privacy_unit_detail=state.get("privacy_unit_detail"),
            prv_accountant_version=acc_state.get("prv_accountant_version"),
            hf_dp_version=state.get("hf_dp_version") or "unknown",
        )

    def save(self, path: str | os.PathLike) -> None:
        """Writes :meth:`to_dict` as JSON (``dp_state.json``)."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    @classmethod
    def load(cls, path: str | os.PathLike) -> PrivacyRecord:
        """The record of a ``dp_state.json`` file, or of a directory holding one (a checkpoint, a saved model)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "dp_state.json")
        with open(path) as f:
            return cls.from_dict(json.load(f))


# ------------------------------------------------------------------------------- what only the trainer sees
def describe_optimizer(optimizer: Any, optim: Any = None) -> str:
    """``"DP-Adam (AdamW)"`` / ``"DP-SGD (SGD)"``: the torch optimizer (unwrapped from accelerate's), or ``optim``."""
    opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the torch optimizer
    name = type(opt).__name__ if opt is not None else str(plain(optim))
    label = "DP-Adam" if "adam" in name.lower() else "DP-SGD"
    return f"{label} ({name})"


def describe_trained_parameters(model: Any, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Which parameters were trained (and hence are covered): full / partial / LoRA / prefix / prompt, and counts.

    Args:
        model: The (unwrapped) model.
        params: The parameters the clipping engine clips (default: those with ``requires_grad``).
    """
    if not params:
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    seen: set[int] = set()
    count = 0
    for p in params.values():
        if id(p) not in seen:
            seen.add(id(p))
            count += p.numel()
    total = sum(p.numel() for p in model.parameters())  # parameters() deduplicates tied weights
    info: dict[str, Any] = {"count": int(count), "total": int(total), "tensors": len(seen)}
    peft_configs = getattr(model, "peft_config", None)
    if isinstance(peft_configs, Mapping) and peft_configs:
        active = getattr(model, "active_adapter", None)
        if isinstance(active, (list, tuple)):
            active = active[0] if active else None
        cfg = peft_configs.get(active) if active in peft_configs else next(iter(peft_configs.values()))
        peft_type = str(plain(getattr(cfg, "peft_type", "unknown"))).upper()
        info["method"] = _PEFT_METHODS.get(peft_type, peft_type.lower())
        peft: dict[str, Any] = {"peft_type": peft_type, "peft_version": package_version("peft")}
        for key in ("r", "lora_alpha", "lora_dropout", "target_modules", "num_virtual_tokens", "modules_to_save",
                    "use_rslora", "use_dora", "prefix_projection", "task_type"):
            value = getattr(cfg, key, None)
            if value is not None and value is not False:
                peft[key] = plain(value)
        info["peft"] = peft
    else:
        info["method"] = "full" if count == total else "partial"
    return info


_GENERIC_DIR_NAMES = frozenset({"model", "models", "weights", "pretrained", "checkpoint", "final", "snapshot", "hf",
                                 "transformers", "base", "base_model", "output", "outputs"})
"""Directory names too generic to name a local base model alone (the parent is added: ``pkg/model``)."""
LOCAL_BASE_MODEL_PREFIX = "local files "
"""How a base model loaded from a local directory is named in the card body and the ``differential_privacy``
record (``base_model: local files <name>``); the YAML ``base_model`` field only takes Hub ids."""


def is_hub_model_id(name: Any, check_local: bool = True) -> bool:
    """Whether ``name`` can go into the YAML ``base_model`` field: a Hub repo id (``name`` or ``namespace/name``,
    :func:`huggingface_hub.utils.validate_repo_id`), not a path (absolute, ``./``, ``~``).

    With ``check_local`` (when a card is written), a name that exists as a local file or directory is not a Hub id
    either (trl's rule: that is what ``from_pretrained`` loaded). :func:`hf_dp.cards.validate_card` checks the syntax
    only, so its verdict does not depend on the current directory.
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(name, str) or not name or os.path.isabs(name) or name.startswith(("~", ".")):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return not (check_local and os.path.exists(name))


def _local_model_name(path: str) -> str:
    """A short name for a local base model directory (its last component; with the parent if that is generic)."""
    parts = [p for p in re.split(r"[\\/]+", os.path.expanduser(path).strip()) if p not in ("", ".", "..")]
    if not parts:
        return "(unnamed)"
    name = parts[-1]
    if name.lower() in _GENERIC_DIR_NAMES and len(parts) > 1:
        name = f"{parts[-2]}/{name}"
    return name


def _names(value: Any) -> list[str]:
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    values = [os.fspath(v) if isinstance(v, os.PathLike) else v for v in values]
    return [v for v in values if isinstance(v, str) and v.strip()]


def name_base_models(value: Any) -> tuple[list[str], str | None]:
    """``(hub_ids, local)`` for base model names or paths (a name, a path, or a list of them).

    Valid Hub ids (:func:`is_hub_model_id`) are returned in ``hub_ids``, for the YAML ``base_model`` field and the
    Hub link; anything else names local files and is returned as ``local`` (``"local files <name>"``, for the card
    body and the privacy record), never as ``base_model``: a local path there renders as a broken Hub link and fails
    the Hub's metadata validation.
    """
    found = _names(value)
    hub_ids = [n for n in found if is_hub_model_id(n)]
    local = [LOCAL_BASE_MODEL_PREFIX + _local_model_name(n) for n in found if not is_hub_model_id(n)]
    return hub_ids, "; ".join(local) or None


def model_base_model(model: Any) -> str | None:
    """Where ``model`` was fine-tuned from, as the record's ``base_model``: the PEFT config's
    ``base_model_name_or_path``, else ``config._name_or_path`` (:func:`name_base_models`, ``"; "``-joined)."""
    found: list[str] = []
    peft_configs = getattr(model, "peft_config", None)
    if isinstance(peft_configs, Mapping):
        found = _names([getattr(c, "base_model_name_or_path", None) for c in peft_configs.values()])[:1]
    if not found:
        found = _names(getattr(getattr(model, "config", None), "_name_or_path", None))
    hub_ids, local = name_base_models(found)
    return "; ".join([*hub_ids, *([local] if local else [])]) or None


def split_base_model(base_model: str | None) -> tuple[list[str], str | None]:
    """The record's ``base_model`` string back into ``(hub_ids, local)``."""
    parts = [p.strip() for p in (base_model or "").split(";") if p.strip()]
    hub_ids = [p for p in parts if not p.startswith(LOCAL_BASE_MODEL_PREFIX)]
    local = [p for p in parts if p.startswith(LOCAL_BASE_MODEL_PREFIX)]
    return hub_ids, "; ".join(local) or None


def latest_eval_metrics(log_history: Sequence[Mapping[str, Any]] | None) -> dict[str, Any] | None:
    """The latest log entry with ``eval_*`` metrics (a trainer's ``state.log_history``), or None."""
    latest = None
    for entry in log_history or []:
        if any(str(k).startswith("eval_") for k in entry):
            latest = entry
    return None if latest is None else dict(latest)
