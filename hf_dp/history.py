"""A model carries its privacy history (DESIGN invariant 13): training it again, by any trainer, composes with what
it already spent.

The released model is the value of every parameter. If any parameter of the model a new ``DPTrainer`` gets was
trained by an earlier ``DPTrainer`` (or is part of a model that was), the earlier mechanisms compose with the new run:
its accountant starts with their (σ, q, steps), ``target_epsilon`` budgets what is left, and ε in the logs,
``privacy_spent()``, ``dp_state.json`` and the card is the composed one. Composition needs no assumption on the data
sets (Dwork & Roth 2014, Thm 3.16; for the PRV / PLD accountants, Gopi et al. 2021 §2): a person in both data sets is
covered by the composed ε, a person in one only by less.

**Where the history lives.** One list of *run entries* (a run's own mechanisms, its δ, privacy unit, guarantee; one
entry per ``DPTrainer`` run, identified by ``run_id``), kept in two places:

* the model's config, ``config.hf_dp_privacy_history`` (every ``PretrainedConfig`` among the model's modules). The
  config is what travels with the weights without any hf_dp code on the other side: ``save_pretrained`` /
  ``from_pretrained`` (``config.json``), ``push_to_hub``, ``copy.deepcopy``, and the config object is shared by a
  ``PeftModel`` and its base, by the base under a trained ``PeftModel`` and by ``merge_and_unload()``'s result;
* every parameter object, attribute ``hf_dp_privacy_runs`` (``{run_id: entry}``): in-process identity, for models
  without a config and for a DP-trained module reused inside another model.

``dp_state.json`` (the run's full record, :class:`~hf_dp.record.PrivacyRecord`) holds the earlier entries and the
run id too, so ``resume_from_checkpoint`` continues the same run. A PEFT adapter saved alone
(``PeftModel.save_pretrained`` writes no ``config.json``) carries its history only in the ``dp_state.json`` the
trainer wrote beside it: :func:`attach_privacy_history` reads it onto the model loaded with
``PeftModel.from_pretrained``. What no in-model record can see: weights copied into a fresh model tensor by tensor
(``load_state_dict`` from a state dict), a model rebuilt from exported weights without its config.

Entries are plain JSON data; the trainer's own entry is a live dict updated at every step, so a model taken from an
interrupted ``train()`` (a re-run notebook cell) carries the steps it actually took.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import nn

from .accounting import MechanismRecord

__all__ = ["CONFIG_KEY", "PARAM_ATTR", "ModelHistory", "attach_privacy_history", "describe_earlier",
           "earlier_runs_message", "read_privacy_history"]

CONFIG_KEY = "hf_dp_privacy_history"
"""The config attribute (saved in ``config.json``) holding the list of run entries."""
PARAM_ATTR = "hf_dp_privacy_runs"
"""The parameter attribute (in-process only) holding ``{run_id: entry}``."""


# ------------------------------------------------------------------------------------------------- entries
def _malformed(where: str, why: str) -> ValueError:
    return ValueError(
        f"The model's privacy history ({where}) cannot be read: {why}. It was written by hf_dp when the model was "
        "DP-trained; without it the privacy this model already spent is unknown and the new run would under-report "
        f"ε. Restore the {CONFIG_KEY!r} entry of its config.json (or dp_state.json), or start from a model that was "
        "never DP-trained.")


def _check_entry(entry: Any, where: str) -> dict[str, Any]:
    """A validated copy of one run entry."""
    if not isinstance(entry, Mapping) or not isinstance(entry.get("run_id"), str):
        raise _malformed(where, f"an entry is not a mapping with a 'run_id': {entry!r}")
    mechanisms = entry.get("mechanisms")
    if not isinstance(mechanisms, Sequence) or isinstance(mechanisms, str):
        raise _malformed(where, f"run {entry.get('run_id')} has no list of 'mechanisms'")
    checked = []
    for m in mechanisms:
        try:
            rec = MechanismRecord(m["noise_multiplier"], m["sample_rate"], m["steps"])
        except (KeyError, TypeError, ValueError) as err:
            raise _malformed(where, f"run {entry['run_id']} has a malformed mechanism {m!r} ({err})") from err
        checked.append({"noise_multiplier": rec.noise_multiplier, "sample_rate": rec.sample_rate, "steps": rec.steps})
    out = copy.deepcopy(dict(entry))
    out["mechanisms"] = checked
    out["steps"] = sum(m["steps"] for m in checked)
    return out


def _entries_of(model: nn.Module) -> Iterable[tuple[dict[str, Any], str]]:
    """Every run entry the model carries, with where it was found (duplicates included)."""
    seen: set[int] = set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        history = getattr(config, CONFIG_KEY, None)
        if history is None:
            continue
        if not isinstance(history, Sequence) or isinstance(history, str):
            raise _malformed(f"config.{CONFIG_KEY}", f"expected a list of run entries, got {type(history).__name__}")
        for entry in history:
            yield entry, f"config.{CONFIG_KEY}"
    for param in model.parameters():
        runs = getattr(param, PARAM_ATTR, None)
        if isinstance(runs, Mapping):
            for entry in runs.values():
                yield entry, f"parameter attribute {PARAM_ATTR}"


def merge_entries(entries: Iterable[tuple[Any, str]]) -> list[dict[str, Any]]:
    """One validated entry per run id; where a run was seen at several step counts (a snapshot taken earlier, e.g. a
    deep copy, next to the live entry) the one with the most steps: a run's mechanisms only grow."""
    runs: dict[str, dict[str, Any]] = {}
    for entry, where in entries:
        checked = _check_entry(entry, where)
        old = runs.get(checked["run_id"])
        if old is None or checked["steps"] > old["steps"]:
            runs[checked["run_id"]] = checked
    return [r for r in runs.values() if r["steps"] > 0]


def read_privacy_history(model: nn.Module) -> list[dict[str, Any]]:
    """The earlier DP runs whose training ``model`` (any of its parameters, trainable or frozen) carries: a list of
    run entries (``run_id``, ``mechanisms`` [(σ, q, steps)], ``steps``, ``delta``, ``privacy_unit``, ...), copies.

    Raises:
        ValueError: If a history is present but malformed (never silently ignored).
    """
    return merge_entries(_entries_of(model))


def _aggregate(records: Iterable[Any]) -> dict[tuple[float, float], int]:
    counts: dict[tuple[float, float], int] = {}
    for r in records:
        sigma, q, n = ((r.noise_multiplier, r.sample_rate, r.steps) if isinstance(r, MechanismRecord)
                       else (r["noise_multiplier"], r["sample_rate"], r["steps"]))
        counts[(float(sigma), float(q))] = counts.get((float(sigma), float(q)), 0) + int(n)
    return counts


def _records(counts: Mapping[tuple[float, float], int]) -> list[MechanismRecord]:
    return [MechanismRecord(s, q, n) for (s, q), n in counts.items() if n > 0]


# ------------------------------------------------------------------------------------------------- the run's view
class ModelHistory:
    """What a ``DPTrainer`` run knows of its model's history: the earlier runs (inherited) and its own live entry.

    The run's accountant holds the earlier runs' mechanisms followed by its own; the run's own mechanisms are always
    the accountant's minus the earlier ones (:meth:`own_mechanisms`), so nothing is counted twice.

    Args:
        earlier: Entries of the earlier runs (:func:`read_privacy_history`).
        run_id: This run's id (a new one by default; a resumed run keeps its checkpoint's).
    """

    def __init__(self, earlier: Sequence[Mapping[str, Any]] = (), run_id: str | None = None):
        self.run_id = run_id or uuid.uuid4().hex
        self.earlier = [e for e in merge_entries((e, "dp_state.json") for e in earlier) if e["run_id"] != self.run_id]
        self.entry: dict[str, Any] = {"run_id": self.run_id, "mechanisms": [], "steps": 0}

    @classmethod
    def of_model(cls, model: nn.Module, run_id: str | None = None) -> ModelHistory:
        """The history ``model`` carries (its earlier runs), for a run with ``run_id`` (new by default)."""
        history = cls(run_id=run_id)
        history.earlier = [e for e in read_privacy_history(model) if e["run_id"] != history.run_id]
        return history

    # ------------------------------------------------------------------ the accountant
    @property
    def earlier_steps(self) -> int:
        return sum(e["steps"] for e in self.earlier)

    def earlier_mechanisms(self) -> list[MechanismRecord]:
        """The earlier runs' mechanisms, for the start of the run's accountant."""
        return _records(_aggregate(m for e in self.earlier for m in e["mechanisms"]))

    def own_mechanisms(self, accountant_history: Sequence[MechanismRecord]) -> list[MechanismRecord]:
        """This run's own steps: the accountant's history minus the earlier runs' (as counts per (σ, q))."""
        own = _aggregate(accountant_history)
        for key, n in _aggregate(m for e in self.earlier for m in e["mechanisms"]).items():
            own[key] = own.get(key, 0) - n
        if any(n < 0 for n in own.values()):
            raise RuntimeError("hf_dp: the accountant holds fewer steps than the model's earlier DP runs; its history "
                               "was replaced by something that does not start from them.")
        return _records(own)

    def refresh(self, model: nn.Module, accountant_history: Sequence[MechanismRecord]) -> list[MechanismRecord]:
        """Re-reads the model's earlier runs (another trainer may have trained it since this one was built) and
        returns the accountant history to continue from: the earlier runs' mechanisms and this run's own."""
        own = self.own_mechanisms(accountant_history)
        self.earlier = [e for e in read_privacy_history(model) if e["run_id"] != self.run_id]
        return self.earlier_mechanisms() + own

    # ------------------------------------------------------------------ the model
    def update(self, accountant_history: Sequence[MechanismRecord], **description: Any) -> dict[str, Any]:
        """Brings this run's live entry up to date (own mechanisms; ``description``: δ, unit, guarantee, ...)."""
        own = self.own_mechanisms(accountant_history)
        self.entry["mechanisms"] = [{"noise_multiplier": r.noise_multiplier, "sample_rate": r.sample_rate,
                                     "steps": r.steps} for r in own]
        self.entry["steps"] = sum(r.steps for r in own)
        self.entry.update({k: v for k, v in description.items() if v is not None})
        return self.entry

    def tag(self, model: nn.Module) -> None:
        """Writes the history (earlier runs and this run's live entry) onto ``model``: every config among its modules
        and every parameter. Cheap (one dict assignment per parameter tensor)."""
        entries = [*self.earlier, self.entry]
        ids = {e["run_id"] for e in entries}
        seen: set[int] = set()
        for module in model.modules():
            config = getattr(module, "config", None)
            if config is None or id(config) in seen or not hasattr(config, "to_dict"):
                continue
            seen.add(id(config))
            kept = [e for e in getattr(config, CONFIG_KEY, None) or [] if isinstance(e, Mapping)
                    and e.get("run_id") not in ids]  # runs of other parts of a composed model stay
            try:
                setattr(config, CONFIG_KEY, kept + entries)
            except (AttributeError, TypeError):  # a frozen custom config: the parameters still carry it
                continue
        for param in model.parameters():
            runs = getattr(param, PARAM_ATTR, None)
            if not isinstance(runs, dict):
                runs = {}
                try:
                    setattr(param, PARAM_ATTR, runs)
                except (AttributeError, TypeError):  # a tensor subclass without __dict__: the config still carries it
                    continue
            for e in entries:
                runs[e["run_id"]] = e

    # ------------------------------------------------------------------ what the record says
    def notes(self, privacy_unit: str, user_id_column: str | None) -> list[str]:
        """Why composing with the earlier runs does not give a strict guarantee, if it does not (``dp_guarantee``).

        * a different privacy unit (example vs user, or users keyed by another column): the accountant composes the
          mechanisms, but an example-level run says nothing per user without group privacy, and a user-level run
          bounds one example's change only as a change of one user (add/remove of a user is not replace-one);
        * an earlier run that was itself not strict (its notes carry over: the model still holds what it released).

        A different δ or accountant is not a reason: the mechanisms, not (ε, δ) pairs, are composed, and ε is
        computed for all of them at this run's δ.
        """
        out = []
        for e in self.earlier:
            unit, column = e.get("privacy_unit") or "example", e.get("user_id_column")
            if unit != privacy_unit or (unit == "user" and column != user_id_column):
                theirs = unit + (f" ({column})" if unit == "user" else "")
                ours = privacy_unit + (f" ({user_id_column})" if privacy_unit == "user" else "")
                out.append(f"continues from an earlier DP run of this model at another privacy unit ({theirs}, this "
                           f"run: {ours}): the composed ε is not a guarantee for either unit (convert with "
                           "group_privacy)")
            guarantee = str(e.get("dp_guarantee") or "strict")
            if guarantee != "strict":
                reasons = guarantee.split(":", 1)[1].strip() if ":" in guarantee else guarantee
                # Its own reasons only: the runs it continued from are in self.earlier too, each judged here.
                own = [r for r in reasons.split("; ") if not r.startswith("continues from an earlier DP run")]
                if own:
                    out.append("continues from an earlier DP run of this model whose guarantee was not strict ("
                               + ", ".join(own) + ")")  # one note: the card lists notes split at "; "
        return list(dict.fromkeys(out))

    def summary(self) -> dict[str, Any] | None:
        """What the record and the card say of the earlier runs (None when there are none)."""
        if not self.earlier:
            return None
        return {"runs": len(self.earlier), "steps": self.earlier_steps,
                "run_ids": [e["run_id"] for e in self.earlier]}


def earlier_runs_message(history: ModelHistory, privacy_unit: str, user_id_column: str | None,
                         budgeted: bool) -> str | None:
    """What a trainer says (once, as a warning) when its model was already DP-trained: accounting continues from
    the earlier runs (``budgeted``: ``target_epsilon`` budgets what is left). None for a model never DP-trained."""
    if not history.earlier:
        return None
    unit_notes = history.notes(privacy_unit, user_id_column)
    return (f"hf_dp: this model was already trained with DP, {describe_earlier(history.earlier)}: "
            "privacy accounting continues from them. ε in the logs, privacy_spent(), dp_state.json and the card "
            "composes all of them"
            + (", and target_epsilon budgets what is left." if budgeted else ".")
            + (" Not strict: " + "; ".join(unit_notes) + "." if unit_notes else "")
            + " To start at ε = 0, start from a model that was never DP-trained (README, 'A model carries its "
            "privacy history').")


def describe_earlier(earlier: Sequence[Mapping[str, Any]] | None) -> str | None:
    """``"N earlier DP steps in k earlier runs"`` or None."""
    if not earlier:
        return None
    steps = sum(int(e.get("steps") or 0) for e in earlier)
    return f"{steps} earlier DP step{'s' * (steps != 1)} in {len(earlier)} earlier run{'s' * (len(earlier) != 1)}"


# ------------------------------------------------------------------------------------------------- public helper
def attach_privacy_history(model: nn.Module, source: Any) -> nn.Module:
    """Puts the privacy history of a saved DP run onto ``model``, so that a ``DPTrainer`` that trains it continues
    from it.

    For what carries no ``config.json``: a PEFT adapter saved alone and loaded with ``PeftModel.from_pretrained``
    (``attach_privacy_history(peft_model, adapter_dir)``), or weights copied into a fresh model with
    ``load_state_dict``. A model saved with ``save_pretrained`` carries its history in ``config.json`` already.

    Args:
        model: The model (its configs and parameters are tagged).
        source: A ``dp_state.json`` path, a directory holding one, or a :class:`~hf_dp.record.PrivacyRecord`.

    Returns:
        ``model``.
    """
    from .record import PrivacyRecord

    record = source if isinstance(source, PrivacyRecord) else PrivacyRecord.load(source)
    history = ModelHistory(record.earlier_runs or [], run_id=record.run_id)
    history.update(record.accountant.history, delta=record.delta, privacy_unit=record.privacy_unit,
                   user_id_column=record.user_id_column, num_examples=record.num_examples,
                   dp_guarantee=record.dp_guarantee)
    if history.entry["steps"] or history.earlier:
        history.tag(model)
    return model
