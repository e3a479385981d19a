"""What DP preference training shares (``hf_dp/dpo.py``, ``hf_dp/reward.py``): **the privacy unit is one preference
row**, a prompt with a chosen and a rejected completion, although the model sees it as two sequences.

trl collates B rows into ``2B`` sequences, the B chosen ones first, then the B rejected ones (row ``i`` at ``i`` and
``B + i``). The loss of a row, ``L_r = ℓ(s(chosen_r), s(rejected_r))``, is a nonlinear function of a score of each of
its two sequences (the summed completion log-probabilities for DPO, the reward for a reward model). One backward of
``Σ_r L_r`` gives every sequence's output gradients ``∂L_r/∂s · ∂s/∂(outputs)`` — the chain rule's term through that
sequence — so the gradient of row ``r`` is the sum of the per-sequence gradients of its two sequences,
``∇L_r = G_chosen + G_rejected`` (the model runs every sequence independently: no layer mixes the rows of a batch,
which the first-step checks prove). The clipping engine clips exactly such sums: its privacy units
(``ClippingEngine.record(units=)``, built for user-level DP) are here the rows — each sequence carries its row's id —
or, with ``privacy_unit="user"``, the users, each sequence carrying its row's user. The norm is that of the whole
row's (user's) gradient, cross terms between its sequences included, and the clipped sum adds ``c_r ∇L_r``.

Poisson sampling draws rows (users), so ``N``, ``q`` and the expected batch count rows (users), never sequences.
The loss hands the engine one value per sequence (the row's loss on its chosen sequence, 0 on its rejected one: only
the sum is back-propagated); the logged loss and the count of non-finite examples count rows, each once
(``StepPieces.rows_per_example``). The first-step checks of the per-sequence machinery (batch axes, hooks against
autograd, a sequence's gradient in its batch equal to its gradient alone) run on a per-sequence score, the ``s`` the
row's loss is a function of: its gradient is what the chain rule combines.

**A row's loss is its own** (DESIGN invariant 12, ``hf_dp/counterfactual.py``): once per run, before the first
update, each row of the first micro-batch and of a batch of the training set's shortest and longest rows is compared
with the same row collated alone by the training collator (one row, two sequences) — its loss, the hooks' norm of its
gradient (both sequences together) and the clipped sum — so a collator that mixes rows (through tokens, masks, margins
or any batch statistic) or a model whose scores depend on the batch's padding or other rows is refused before anything
is released. :class:`PairedRows` also checks, on every batch, that sequences ``i`` and ``B + i`` hold exactly row
``i``'s tokens.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from .arguments import DPTrainingArguments
from .clipping.step import micro_batch_bounds
from .guarantee import check_batch_rows
from .trainer import DPTrainer

__all__ = ["PairedRows", "PreferencePairsDP", "dp_config"]


def dp_config(config_class: type, args: Any, trainer_name: str) -> Any:
    """``args`` as ``config_class`` (a trl config + ``DPTrainingArguments``): upgrades ``DPTrainingArguments`` (as trl
    upgrades ``TrainingArguments``); anything else is refused with what to pass."""
    if isinstance(args, config_class):
        return args
    if isinstance(args, DPTrainingArguments):
        names = {f.name for f in dataclasses.fields(config_class) if f.init}
        values = {k: v for k, v in args.to_dict().items() if k in names}
        values["hub_token"] = args.hub_token  # to_dict hides it
        return config_class(**values)
    raise TypeError(
        f"{trainer_name} needs {config_class.__name__}(target_epsilon=... or noise_multiplier=..., ...) (or "
        f"DPTrainingArguments), got {type(args).__name__}."
    )


class PairedRows:
    """The training collator, checked: ``B`` rows become ``2B`` sequences, row ``i``'s chosen sequence at ``i`` and
    its rejected one at ``B + i``, each holding exactly the tokens the row gives it (``expected(feature)``), and the
    batch gets the ``labels`` the DP step needs (``labels(batch, B)``).

    A collator that reorders, drops, merges or truncates differently would mix two rows' data in one privacy unit, so
    any mismatch stops training with the reason.
    """

    def __init__(self, collator, expected, labels):
        self.collator = collator
        self.expected = expected
        self.labels = labels

    def __call__(self, features: list) -> dict:
        batch = self.collator(features)
        b = len(features)
        ids = batch.get("input_ids") if hasattr(batch, "get") else None
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 2 * b:
            shape = None if not isinstance(ids, torch.Tensor) else tuple(ids.shape)
            raise ValueError(
                f"hf_dp: the data collator turned {b} preference rows into input_ids of shape {shape}; a preference "
                f"row is one privacy unit of two sequences, so the batch must hold 2 × {b} padded sequences (trl's "
                "DataCollatorForPreference: the chosen sequences, then the rejected ones). Use trl's default collator."
            )
        mask = batch.get("attention_mask")
        for i, feature in enumerate(features):
            chosen, rejected = self.expected(feature)
            for seq, tokens in ((i, chosen), (b + i, rejected)):
                got = ids[seq] if mask is None else ids[seq][mask[seq].bool()]
                if got.tolist() != list(tokens):
                    which = "chosen" if seq < b else "rejected"
                    raise ValueError(
                        f"hf_dp: sequence {seq} of the collated batch is not row {i}'s {which} sequence (its tokens "
                        "differ from the row's): each row's two sequences must be at i and B + i, as trl's "
                        "DataCollatorForPreference puts them, or a privacy unit would hold another row's data. Use "
                        "trl's default collator."
                    )
        batch["labels"] = self.labels(batch, b)
        return batch


logger = logging.getLogger(__name__)


class PreferencePairsDP(DPTrainer):
    """``DPTrainer``'s DP step with one preference row (two sequences) as the privacy unit (see the module's doc).

    Subclasses (``DPDPOTrainer``, ``DPRewardTrainer``) give the per-row loss (:meth:`pair_losses`), the per-sequence
    score of the first-step checks (:meth:`sequence_scores`), the tokens of a row's two sequences
    (:meth:`expected_sequences`), the labels of a collated batch (:meth:`pair_labels`), the keys of a batch that are
    not model inputs (:attr:`non_model_keys`) and anything a micro-batch needs besides its rows
    (:meth:`micro_batch_extras`).
    """

    non_model_keys: frozenset[str] = frozenset()
    example_description = ("one preference row: a prompt with its chosen and its rejected completion, whose two "
                           "sequences' gradients are clipped together as one unit")

    # ------------------------------------------------------------------ what a subclass gives
    def pair_losses(self, outputs: Any, labels: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        """``(2m,)`` for a micro-batch of ``m`` rows: row ``r``'s loss at ``r``, 0 at ``m + r``."""
        raise NotImplementedError

    def sequence_scores(self, outputs: Any, labels: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        """``(n,)``: the score of each sequence that the row's loss is a function of."""
        raise NotImplementedError

    def expected_sequences(self, feature: dict) -> tuple[list[int], list[int]]:  # pragma: no cover - abstract
        """The tokens of a row's chosen and rejected sequences, as the collator must give them."""
        raise NotImplementedError

    def pair_labels(self, batch: dict, num_rows: int) -> torch.Tensor:  # pragma: no cover - abstract
        """``labels`` of a collated batch of ``2·num_rows`` sequences (one row per sequence)."""
        raise NotImplementedError

    def micro_batch_extras(self, micro: dict, labels: torch.Tensor) -> dict:
        """Per-sequence tensors a micro-batch carries besides the collated ones (e.g. reference log-probs)."""
        return {}

    # ------------------------------------------------------------------ wiring into DPTrainer
    def _build_clipping(self) -> None:
        """``DPTrainer``'s, then the per-row loss (every rebuild would otherwise restore the model head's default)."""
        super()._build_clipping()
        self.per_example_loss = self.pair_losses
        self.check_pairs_supported()

    def check_pairs_supported(self) -> None:
        """Refuse a DP step that cannot clip a row's two sequences as one unit: FSDP2's two-pass ghost clipping
        clips each model row (sequence) on its own."""
        if self._fsdp is not None:
            raise ValueError(
                f"{type(self).__name__} is not supported under FSDP: its two-pass ghost clipping clips each sequence "
                "on its own, not a preference row's two sequences together. Use DDP (accelerate launch --multi_gpu) "
                "or one process."
            )

    def _step_pieces(self):
        """The DP step's pieces, with the unit layout of paired sequences (:meth:`pair_unit_layout`); a row (two
        sequences) is one example of the logged loss and of the non-finite count."""
        return dataclasses.replace(super()._step_pieces(), unit_layout=self.pair_unit_layout, rows_per_example=2)

    def pair_unit_layout(self, units: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per sequence: its unit ``0..U-1`` (the row, or the row's user) and its weight in the unit's gradient —
        none (1) for a row; ``1/n_u`` for a user's mean over their ``n_u`` rows (``user_contribution="mean"``),
        each row counted once although it has two sequences."""
        local = torch.unique(units, return_inverse=True)[1]
        if not self.user_level or self.args.user_contribution == "sum":
            return local, None
        rows = torch.bincount(local).double() / 2  # each row of the micro-batch has its two sequences there
        return local, 1.0 / rows[local]

    def _micro_batches(self, inputs: dict, labels: torch.Tensor, units: torch.Tensor | None = None):
        """A chunk of ``B`` rows (``2B`` sequences) split into micro-batches of at most
        ``per_device_train_batch_size`` rows (memory only), each ``[chosen of its rows; rejected of its rows]``, with
        its sequences' unit ids; a user's rows are never split. Per-row tensors (``B`` long) are sliced by row."""
        seqs = labels.shape[0]
        if seqs % 2:
            raise ValueError(f"A batch of preference pairs must have an even number of sequences, got {seqs}.")
        rows = seqs // 2
        size = max(1, self._train_batch_size or self.args.per_device_train_batch_size)
        if units is None:
            row_units = torch.arange(rows, device=labels.device)
        else:
            if units.shape[0] != rows:
                raise ValueError(f"{units.shape[0]} unit ids for {rows} preference rows.")
            row_units = units.to(labels.device)
        bounds = micro_batch_bounds(rows, size, units)  # a user's rows are never split
        out = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            seq_index = torch.cat([torch.arange(a, b), torch.arange(rows + a, rows + b)]).to(labels.device)

            def part(v: Any, a=a, b=b, seq_index=seq_index) -> Any:
                if not isinstance(v, torch.Tensor) or v.dim() == 0:
                    return v
                if v.shape[0] == seqs:
                    return v[seq_index.to(v.device)]
                if v.shape[0] == rows:
                    return v[a:b]
                return v

            micro = {k: part(v) for k, v in inputs.items()}
            micro_labels = labels[seq_index]
            micro.update(self.micro_batch_extras(micro, micro_labels))
            unit = row_units[a:b]
            out.append((micro, micro_labels, torch.cat([unit, unit])))
        return out

    def _model_inputs(self, model, inputs: dict, labels: torch.Tensor) -> dict:
        kept = {k: v for k, v in inputs.items() if k not in self.non_model_keys}
        return {**super()._model_inputs(model, kept, labels), "use_cache": False}

    def _check_batch_rows(self, num_examples: int, batch: dict) -> None:
        """Two sequences per sampled row (:class:`PairedRows` has checked which are whose)."""
        check_batch_rows(2 * num_examples, {k: v for k, v in batch.items() if k not in self.non_model_keys})

    def _self_check(self, net: torch.nn.Module, micro: dict, labels: torch.Tensor) -> None:
        """``DPTrainer``'s first-step checks of the per-sequence gradients, on the per-sequence scores
        (:meth:`sequence_scores`) whose gradients the row's loss combines by the chain rule; then the counterfactual
        check of each row's loss (:meth:`_check_examples_alone`)."""
        loss = self.per_example_loss
        self.per_example_loss = self.sequence_scores
        try:
            self._first_step_checks(net, micro, labels)
        finally:
            self.per_example_loss = loss
        self._check_examples_alone(net, micro, labels)

    @staticmethod
    def rows_of_pairs(num_rows: int) -> torch.Tensor:
        """The preference row each of the ``2·num_rows`` sequences of a collated batch holds: ``[0..B-1, 0..B-1]``."""
        return torch.arange(num_rows).repeat(2)

    def _alone_layout(self) -> dict:
        """Once per run, before the first update (DESIGN invariant 12), ``DPTrainer``'s counterfactual check compares
        each preference row's loss, the hooks' norm of its gradient (both sequences together) and the clipped sum, as
        the DP step computes them in its batch, with those of the row collated alone by the same collator (one row,
        two sequences): the unit is two model rows (:meth:`rows_of_pairs`), and each collated batch gets the step's
        :meth:`micro_batch_extras` (DPO's reference log-probs). A collator that mixes rows, or a model whose score of a
        sequence depends on the batch's padding or on the other rows, is refused with the reason."""
        return {"extras": self.micro_batch_extras, "example_of_row": self.rows_of_pairs}

    def get_train_dataloader(self):
        """``DPTrainer``'s Poisson loader over rows, its collator checked and labelled by :class:`PairedRows`."""
        collator = self.data_collator
        self.data_collator = PairedRows(collator, self.expected_sequences, self.pair_labels)
        try:
            return super().get_train_dataloader()
        finally:
            self.data_collator = collator

    def privacy_record(self, *args: Any, **kwargs: Any):
        """``DPTrainer``'s record, saying what one example (row) is."""
        return dataclasses.replace(super().privacy_record(*args, **kwargs),
                                   example_description=self.example_description)
