"""Each example's loss depends on that example alone (DESIGN invariant 12): the counterfactual check.

Per-example clipping bounds one example's contribution to C only if the gradient the DP step computes for an example
is a function of that example alone. The first-step checks of ``clipping/engine.py`` compare an example in its
micro-batch with the same example *sliced out of the padded micro-batch*, which keeps the batch's shape: its padding
length, its padded positions, whatever the collator did across rows. Here the reference is the counterfactual — the
example as it would be had it been sampled alone: its raw features collated alone by the training collator (its own
length, padding and positions), run through the model's own forward and the step's per-example loss — compared with
what the DP step computes for it inside a real batch (:meth:`ClippingEngine.check_counterfactual`: the loss, the
clipped norm, and the full weighted sum of the per-example gradients).

It is compared on two batches, once per run, before the first update is released:

* the run's first micro-batch, as the DP step collated it (its rows' dataset indices travel with the batch under
  :data:`~hf_dp.clipping.step.INDEX_KEY`);
* a *hard* batch built from the training set: the shortest and the longest rows (by token count, among up to
  :data:`SCAN` rows spread over the set) and one in between, collated together by the training collator, so that a
  first batch of equal lengths cannot pass a model or collator that depends on the other rows' length or content.

**Why once per run is enough.** The check is about functions, not data: the collator and the model are the same
code at every step, so a dependence on the other rows (positions from the padded layout, a length-dependent rope
scaling, a collator that mixes rows) shows whenever the batch's rows differ in the property it reads — which the hard
batch makes as different as the training set allows (its shortest and its longest rows). What one run of the check
cannot see is a dependence that only some data exercises: a data-dependent branch that neither checked batch takes
(e.g. a threshold on the batch's length that the checked rows do not cross, or a collator that mixes rows only with
some probability or only for some tokens). The README ("An example's loss depends on that example alone") lists
these. Parameters only change by DP releases in between, which are post-processing.

**An example of several model rows** (a preference row: its chosen and rejected sequences at ``i`` and ``B + i``,
``hf_dp/preference.py``) is compared as one unit (``example_of_row``): its rows' losses summed, the hooks' norm of the
sum of its rows' gradients (the engine's units, cross terms included) and its share of the clipped sum, against the
example collated alone by the training collator (its ``k`` rows, their own padding).

Configurations where the dependence is known in advance are refused before training, with the way out
(:func:`check_known_dependences`): a rope scaling that rescales by the batch's largest position (``rope_type``
``"dynamic"`` / ``"longrope"``) when a batch can reach the length where it starts, and left padding with a model that
derives positions from the padded layout (its outputs at a left-padded row's tokens differ from the row's own).

Randomised collators (MLM masking) cannot be compared with a fresh collation alone: their draws differ. Randomness
is detected by collating the same rows under two seeds (torch, ``random`` and NumPy generators; the collator's own
generators are seeded too, and everything is restored afterwards, :func:`collator_state_kept`); then (a) the collator
must keep rows apart: with the same seed, a row's collated tensors may not change when the other rows are replaced by
each other (a cyclic shift keeps the padded shape, so per-position draws line up, as MLM's do), and (b) the model is
compared on each row of the batch with that row's own padding removed (the tokens its attention mask keeps), the same
random draw.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import random
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from .clipping.engine import ClippingEngine, train_without_dropout
from .clipping.rules import UnsupportedLayerError
from .clipping.step import INDEX_KEY, UNIT_KEY, StepHooks
from .peft_support import adapter_advice

__all__ = [
    "SCAN",
    "alone_rtol",
    "batch_dependent_rope",
    "check_collator_keeps_rows_apart",
    "check_examples_alone",
    "check_first_step_alone",
    "check_known_dependences",
    "collated_on_device",
    "collator_randomness",
    "collator_state_kept",
    "example_losses",
    "feature_length",
    "first_batch_features",
    "hard_batch",
    "hard_batch_indices",
    "is_left_padded",
    "longest_position",
    "longest_row",
    "rope_switch_length",
    "unpadded_row",
]

logger = logging.getLogger(__name__)

SCAN = 1024
"""Rows of the training set (evenly spaced) scanned for the hard batch's shortest and longest rows."""
MAX_CHECKED = 4
"""Examples of a checked batch compared alone (the shortest, the longest, the first and the last row)."""
BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")
"""``rope_type``\\ s whose frequencies depend on the largest position id in the batch (transformers'
``dynamic_rope_update``): dynamic NTK scaling grows with it, LongRoPE switches to its long factors beyond
``original_max_position_embeddings``."""

WAYS_OUT = (
    "Typical causes and ways out: left padding with a model that derives positions from the padded layout (use "
    "padding_side='right', or a collator that passes position_ids = attention_mask.cumsum(-1) - 1); a rope scaling "
    "that depends on the longest sequence of the batch (use a fixed scaling: rope_type 'linear', 'yarn' or "
    "'llama3'); a data collator that mixes rows, copies data between them, or whose padding changes an example's "
    "loss (make it treat every row on its own); a model or per_example_loss that normalises over the padded length "
    "or pools across the batch, or a per_example_loss that reads other rows' outputs (in-batch negatives) or divides "
    "by a count over the batch (compute each example's loss from its own row). (A collator that reorders the rows "
    "of a batch also fails this check.)"
)


# ---------------------------------------------------------------------- rows of the training set
def feature_length(feature: Any) -> int:
    """Token count of one raw training example: its attention mask's ones, else its ``input_ids``' length, else the
    total length of its sequence-valued fields (0 for anything else)."""
    if not isinstance(feature, Mapping):
        return 0
    mask = feature.get("attention_mask")
    if _size(mask):
        return int(sum(int(x) for x in _flat(mask)))
    if _size(feature.get("input_ids")):
        return _size(feature["input_ids"])
    return sum(_size(v) for v in feature.values())


def _size(v: Any) -> int:
    """The length of a sequence-valued field (its first axis), 0 for anything else."""
    if isinstance(v, (torch.Tensor, np.ndarray)):
        return int(v.shape[0]) if v.ndim >= 1 else 0
    return len(v) if isinstance(v, (list, tuple)) else 0


def _flat(v: Any) -> list:
    if isinstance(v, torch.Tensor):
        return v.reshape(-1).tolist()
    if isinstance(v, np.ndarray):
        return v.reshape(-1).tolist()
    return [y for x in v for y in (_flat(x) if isinstance(x, (list, tuple)) else [x])]


def hard_batch_indices(dataset: Any, size: int = 3, scan: int = SCAN) -> list[int]:
    """Dataset indices of a batch of rows of very different lengths: the shortest and the longest among up to
    ``scan`` rows evenly spaced over the set, and (``size`` > 2) rows of lengths in between. Distinct indices;
    fewer when the set is smaller."""
    n = len(dataset)
    if n == 0:
        return []
    picked = sorted({round(k * (n - 1) / max(min(scan, n) - 1, 1)) for k in range(min(scan, n))})
    lengths = [feature_length(dataset[i]) for i in picked]
    order = sorted(range(len(picked)), key=lambda k: (lengths[k], picked[k]))
    chosen = [order[0], order[-1]]
    for j in range(1, size - 1):
        chosen.append(order[(j * (len(order) - 1)) // (size - 1)])
    return list(dict.fromkeys(picked[k] for k in chosen))[:size]


# ---------------------------------------------------------------------- collators
@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """torch (CPU and CUDA), ``random`` and NumPy generators seeded with ``seed`` inside, restored on exit: the
    training run's random streams (a masking collator's draws, dropout) are not shifted by the checks."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


_GENERATORS = (torch.Generator, random.Random, np.random.Generator, np.random.RandomState)


def _own_generators(obj: Any, depth: int = 3) -> list:
    """Random generators a collator holds (its attributes, and theirs, ``depth`` levels down; e.g. the generator of
    ``DataCollatorForLanguageModeling(seed=...)`` inside the Trainer's column-removing wrapper)."""
    found: list = []
    seen: set[int] = set()

    def walk(o: Any, d: int) -> None:
        if id(o) in seen or d < 0:
            return
        seen.add(id(o))
        if isinstance(o, _GENERATORS):
            found.append(o)
            return
        if isinstance(o, (nn.Module, torch.Tensor, str, bytes, int, float)) or not hasattr(o, "__dict__"):
            return
        for v in vars(o).values():
            walk(v, d - 1)

    walk(getattr(obj, "__self__", obj), depth)  # a bound method: its object
    return found


def _state(g: Any) -> Any:
    if isinstance(g, torch.Generator):
        return g.get_state()
    if isinstance(g, np.random.Generator):
        return copy.deepcopy(g.bit_generator.state)
    return g.get_state() if isinstance(g, np.random.RandomState) else g.getstate()


def _set_state(g: Any, state: Any) -> None:
    if isinstance(g, torch.Generator):
        g.set_state(state)
    elif isinstance(g, np.random.Generator):
        g.bit_generator.state = copy.deepcopy(state)
    elif isinstance(g, np.random.RandomState):
        g.set_state(state)
    else:
        g.setstate(state)


@contextlib.contextmanager
def collator_state_kept(collate: Callable) -> Iterator[Callable[[], None]]:
    """Inside, the collator's own random generators (:func:`_own_generators`) can be rewound to their state at entry
    (the yielded callable); on exit they are restored to it, so the checks' extra collations leave the training run's
    draws unchanged. The global generators are handled by :func:`seeded`."""
    gens = _own_generators(collate)
    states = [_state(g) for g in gens]

    def rewind() -> None:
        for g, st in zip(gens, states):
            _set_state(g, st)

    try:
        yield rewind
    finally:
        rewind()


def _reseed(g: Any, seed: int) -> None:
    if isinstance(g, torch.Generator):
        g.manual_seed(seed)
    elif isinstance(g, np.random.Generator):
        g.bit_generator.state = type(g.bit_generator)(seed).state
    else:
        g.seed(seed)


def _collate_seeded(collate: Callable, features: list, seed: int) -> dict:
    """``collate(features)`` with the global generators and the collator's own generators seeded with ``seed`` (all
    restored afterwards)."""
    with collator_state_kept(collate), seeded(seed):
        for g in _own_generators(collate):
            _reseed(g, seed)
        return collate(list(features))


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and bool(
            torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, equal_nan=True, rtol=0, atol=0)))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b) if not isinstance(a, np.ndarray) else bool(np.array_equal(a, b))


def collator_randomness(collate: Callable, features: list) -> str:
    """``"none"`` (the same rows always collate to the same batch), ``"seeded"`` (random, reproducible under the same
    seeds of torch / ``random`` / NumPy and of the collator's own generators) or ``"unseeded"`` (random, not
    reproducible: its randomness comes from somewhere else)."""
    first = _collate_seeded(collate, features, 0)
    if not _equal(first, _collate_seeded(collate, features, 0)):
        return "unseeded"
    return "none" if _equal(first, _collate_seeded(collate, features, 1)) else "seeded"


def first_batch_features(rows: Any, indices: Any, num: int, reads: int = 4) -> tuple[list, bool]:
    """The raw features of the first ``num`` rows of a batch, read again from the training set ``rows`` by their
    dataset ``indices``, and whether a read of those rows is random (``True``: two of ``reads`` reads, under seeds
    0, 1, ... of the torch / ``random`` / NumPy generators, differ). A dataset whose rows are drawn at each read (a
    ``set_transform`` / ``with_transform`` augmentation: random crops, flips, token replacement) gives the check
    other features than the batch was collated from: each example is then compared with its own row of the batch
    (the same draw), as for a random collator. A random transform that happens to give the same draw every time is
    read as not random, and then its re-read rows are what was trained."""
    picked = [int(i) for i in indices[:num]]
    draws = []
    for seed in range(reads):
        with seeded(seed):
            draws.append([rows[i] for i in picked])
    return draws[0], any(not _equal(draws[0], d) for d in draws[1:])


def check_collator_keeps_rows_apart(collate: Callable, features: list, rows: list[int] | None = None,
                                    example_of_row: Callable[[int], torch.Tensor] | None = None) -> None:
    """Row ``i`` of the collated batch may not change when the other rows are replaced by each other (a cyclic shift
    of the other rows: the same lengths, so the same padded shape and, under the same seed, the same per-position
    random draws), for each ``i`` in ``rows`` (default: all). Needs three rows or more; checks every tensor whose
    first axis is the batch.

    ``example_of_row(n)``: for a batch of ``n`` examples, the example each model row holds (``(rows,)``), when an
    example is several model rows (a preference row's chosen and rejected sequences at ``i`` and ``n + i``): the
    tensors whose first axis is the model rows are then compared on example ``i``'s rows."""
    b = len(features)
    if b < 3:
        return
    ids = None if example_of_row is None else example_of_row(b).cpu()
    base = _collate_seeded(collate, features, 0)
    for i in range(b) if rows is None else rows:
        others = [j for j in range(b) if j != i]
        shifted = list(features)
        for j, k in zip(others, others[1:] + others[:1]):
            shifted[j] = features[k]
        other = _collate_seeded(collate, shifted, 0)
        for key, v in base.items():
            w = other.get(key) if isinstance(other, Mapping) else None
            if not (isinstance(v, torch.Tensor) and isinstance(w, torch.Tensor) and v.dim() > 0
                    and v.shape == w.shape and (v.shape[0] == b or ids is not None and v.shape[0] == ids.shape[0])):
                continue
            own = i if v.shape[0] == b else (ids == i).to(v.device)
            if not _equal(v[own], w[own]):
                raise UnsupportedLayerError(
                    f"The data collator mixes rows: row {i}'s {key!r} changes when the other rows of its batch are "
                    "replaced by each other (same lengths, same random seed), so one example's data reaches another "
                    "example's loss (mixup-style augmentation, a token copied from a neighbouring row, a batch-level "
                    "statistic), which per-example clipping cannot bound. Use a collator that treats every row on "
                    "its own (random per-row masking, like MLM's, is fine)."
                )


def is_left_padded(batch: Mapping) -> bool:
    """Some row of ``batch["attention_mask"]`` (2-D) has a padding position before a kept one."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[1] < 2:
        return False
    m = mask.bool()
    return bool((~m[:, :-1] & m[:, 1:]).any())


def unpadded_row(batch: dict, labels: torch.Tensor, i: int, rows: int) -> tuple[dict, torch.Tensor]:
    """Row ``i`` of a collated batch as a batch of one, without its padding: every tensor whose first axis is the
    batch is cut to row ``i`` and, along the sequence axis of the 2-D attention mask, to the positions it keeps."""
    mask = batch.get("attention_mask")
    keep = mask[i].bool() if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == rows else None

    def cut(v: Any) -> Any:
        if not (isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows):
            return v
        r = v[i]
        if keep is not None and r.dim() >= 1 and r.shape[0] == keep.shape[0]:
            r = r[keep]
        return r[None]

    return {k: cut(v) for k, v in batch.items()}, cut(labels)


# ---------------------------------------------------------------------- refused from the configuration
def batch_dependent_rope(config: Any) -> str | None:
    """The ``rope_type`` of ``config`` (or of a sub-config, per layer type too) whose frequencies depend on the
    batch's longest position (:data:`BATCH_DEPENDENT_ROPE`), or ``None``. Reads ``rope_parameters`` (transformers 5)
    and ``rope_scaling`` (the older spelling, also kept as an alias)."""
    found = rope_switch_length(config)
    return None if found is None else found[0]


def rope_switch_length(config: Any) -> tuple[str, int | None] | None:
    """``(rope_type, L)`` for a batch-dependent rope scaling (:func:`batch_dependent_rope`): its frequencies are the
    configuration's own as long as the batch's largest position id + 1 is at most ``L`` (transformers'
    ``dynamic_rope_update``: dynamic NTK grows beyond the config's ``max_position_embeddings``; LongRoPE switches to
    its long factors beyond ``original_max_position_embeddings``); ``L`` is ``None`` when the config does not say."""
    seen: set[int] = set()

    def scan(cfg: Any) -> tuple[str, int | None] | None:
        if cfg is None or id(cfg) in seen:
            return None
        seen.add(id(cfg))
        for attr in ("rope_parameters", "rope_scaling"):
            params = _rope_params_in(getattr(cfg, attr, None))
            if params is not None:
                kind = params.get("rope_type", params.get("type"))
                limit = params.get("original_max_position_embeddings") if kind == "longrope" else None
                limit = limit or getattr(cfg, "original_max_position_embeddings", None) if kind == "longrope" else None
                limit = limit or getattr(cfg, "max_position_embeddings", None)
                return kind, None if limit is None else int(limit)
        for v in list(vars(cfg).values()) if hasattr(cfg, "__dict__") else []:
            if hasattr(v, "to_dict") and hasattr(v, "model_type"):  # a sub-config (text_config, decoder, ...)
                found = scan(v)
                if found:
                    return found
        return None

    return scan(config)


def _rope_params_in(params: Any) -> Mapping | None:
    if not isinstance(params, Mapping):
        return None
    kind = params.get("rope_type", params.get("type"))
    if isinstance(kind, str) and kind in BATCH_DEPENDENT_ROPE:
        return params
    for v in params.values():  # per layer type: {"full_attention": {...}, "sliding_attention": {...}}
        found = _rope_params_in(v)
        if found is not None:
            return found
    return None


def longest_position(dataset: Any, features: list, batch: Mapping) -> int:
    """The largest position count (max position id + 1) a batch of the training set can have: the training set's
    longest row (:func:`longest_row`) plus what the collator adds to a row (measured on ``batch``, the collated
    ``features``), at least ``batch``'s own."""
    if "position_ids" in batch and isinstance(batch["position_ids"], torch.Tensor):
        seen = int(batch["position_ids"].max()) + 1
    else:
        seen = max((int(v.shape[-1]) for k, v in batch.items() if k in ("input_ids", "attention_mask")
                    and isinstance(v, torch.Tensor) and v.dim() >= 1), default=0)
    return max(seen, longest_row(dataset) + max(seen - longest_row(features), 0))


def longest_row(dataset: Any) -> int:
    """The longest ``input_ids`` of the training set (every row; columnar for a ``datasets.Dataset``), else the
    longest sequence-valued field (:func:`feature_length` without the attention mask)."""
    column = getattr(dataset, "column_names", None) or []
    if "input_ids" in column and hasattr(dataset, "data"):
        try:
            import pyarrow.compute as pc

            lengths = pc.list_value_length(dataset.data.column("input_ids"))
            if getattr(dataset, "_indices", None) is None:
                return int(pc.max(lengths).as_py() or 0)
        except Exception:  # noqa: BLE001 - not an Arrow list column: row by row below
            pass
    best = 0
    for i in range(len(dataset)):
        row = dataset[i]
        if isinstance(row, Mapping):
            best = max(best, _size(row.get("input_ids")) or feature_length(
                {k: v for k, v in row.items() if k != "attention_mask"}))
    return best


def check_known_dependences(net: nn.Module, batch: dict | None = None, labels: torch.Tensor | None = None,
                            forward: Callable[[dict, torch.Tensor], Any] | None = None, rtol: float = 1e-3,
                            longest: Callable[[], int] | None = None) -> None:
    """Refuse, before training, configurations whose per-example loss is known to depend on the other rows:

    * a rope scaling computed from the batch's largest position (``rope_type="dynamic"`` / ``"longrope"``): an
      example's rotary frequencies would depend on the longest row it was batched with — unless no batch can reach
      the length where the scaling starts (:func:`rope_switch_length`): ``longest()``, the largest position count a
      batch can have (the training set's longest row plus what the collator adds), is at most that length;
    * left padding (``batch``, collated by the training collator, has padding before tokens and no
      ``position_ids``) with a model whose outputs at a left-padded row's tokens differ from those of the same row
      without padding (``forward(batch, labels) -> model outputs``): its positions come from the padded layout, so
      an example's positions depend on the longest row of its batch (GPT-2 style absolute positions in
      transformers 5 are ``position_ids = cache_position`` unless given; rotary positions are relative and pass).
    """
    config = getattr(net, "config", None)
    found = rope_switch_length(config)
    reach = None if found is None or found[1] is None or longest is None else longest()
    if found is not None and (reach is None or reach > found[1]):
        kind, limit = found
        seen = "" if reach is None else f" (this training set's batches reach {reach} positions)"
        raise ValueError(
            f"rope_type={kind!r} in the model's config (rope_parameters / rope_scaling) rescales the rotary "
            f"frequencies from the largest position id of each batch once it exceeds {limit}{seen}, so an "
            "example's loss depends on the longest row it is batched with (and, for 'dynamic', on earlier batches: "
            "the scaled frequencies are kept), which per-example clipping cannot bound. Use a fixed rope scaling "
            "(rope_type 'linear', 'yarn' or 'llama3' with the factor you need, or 'default'), e.g. "
            "model.config.rope_parameters = {'rope_type': 'linear', 'factor': 2.0, 'rope_theta': ...} before "
            f"building the model; or truncate every row to at most {limit} tokens (padded batches included)."
        )
    if batch is None or labels is None or forward is None or "position_ids" in batch or not is_left_padded(batch):
        return
    rows = labels.shape[0]
    mask = batch["attention_mask"].bool()
    i = int((~mask[:, 0] & mask.any(1)).nonzero().flatten()[0]) if bool((~mask[:, 0] & mask.any(1)).any()) else 0
    padded = {k: v[i:i + 1] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows else v
              for k, v in batch.items()}
    alone, alone_labels = unpadded_row(batch, labels, i, rows)
    with seeded(0), torch.no_grad(), train_without_dropout(net):
        with_pad = _main_output(forward(padded, labels[i:i + 1]))
        without = _main_output(forward(alone, alone_labels))
    if with_pad is None or without is None:
        return
    if with_pad.dim() >= 2 and with_pad.shape[1] == mask.shape[1] and without.shape[1] == int(mask[i].sum()):
        with_pad = with_pad[:, mask[i]]  # the row's own tokens (a per-token output)
    if with_pad.shape != without.shape:
        return
    scale = max(float(without.abs().max()), 1e-12) if without.numel() else 1.0
    diff = float((with_pad - without).abs().max()) if without.numel() else 0.0
    if diff <= rtol * scale:
        return
    raise ValueError(
        f"Left padding with {type(net).__name__}: the model's outputs at example {i}'s tokens change by {diff:.3g} "
        "when it is left-padded in its batch (against the same row without padding), so the model derives positions "
        "from the padded layout (in transformers 5, GPT-2 style absolute positions are position_ids = cache_position "
        "unless given) "
        "and an example's positions depend on the longest row it is batched with, which per-example clipping "
        "cannot bound. Pad on the right (tokenizer.padding_side = 'right') or use a data collator that passes "
        "position_ids computed from the attention mask (position_ids = attention_mask.cumsum(-1) - 1, clamped at 0)."
    )


def _main_output(outputs: Any) -> torch.Tensor | None:
    """The model's main output (``logits``, else the first tensor it returns), in float64."""
    out = getattr(outputs, "logits", None)
    if out is None:
        out = outputs.get("logits") if isinstance(outputs, Mapping) else None
    if out is None and isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], torch.Tensor):
        out = outputs[0]
    if out is None and hasattr(outputs, "to_tuple"):
        first = outputs.to_tuple()[:1]
        out = first[0] if first and isinstance(first[0], torch.Tensor) else None
    return None if out is None else out.detach().double()


# ---------------------------------------------------------------------- the counterfactual comparison
def check_examples_alone(engine: ClippingEngine, net: nn.Module, features: list, batch: dict, labels: torch.Tensor,
                         *, collate: Callable[[list], dict], collate_alone: Callable[[list], dict],
                         prepare: Callable[[dict], tuple[dict, torch.Tensor]],
                         run: Callable[[dict, torch.Tensor, torch.Tensor | None], torch.Tensor],
                         segment_ids: Callable[[dict], torch.Tensor | None], rtol: float = 1e-3,
                         what: str = "", example_of_row: Callable[[int], torch.Tensor] | None = None,
                         random_rows: bool = False) -> None:
    """Compare what the DP step computes for the examples of ``batch`` with each example alone.

    Args:
        features: the raw features of the batch's examples, in row (or packed segment) order.
        batch, labels: the batch on the device, as the DP step runs it (labels popped).
        collate: the training collator (to detect randomness and check that it keeps rows apart).
        collate_alone: how an example sampled alone is collated (the training collator; trl's unpacked collator
            for packed rows).
        prepare: a collated batch -> (model inputs on the device, labels).
        run: ``(batch, labels, segments) -> per-example losses``, the DP step's loss (its loss context, model inputs
            and ``per_example_loss``).
        segment_ids: the packed-row layout of a batch (``None`` when every row is one example).
        what: names the batch in the error.
        example_of_row: when an example is a unit of several model rows (a preference row: its chosen and rejected
            sequences at ``i`` and ``n + i``), ``n -> (rows,)``: the example each model row of a batch of ``n``
            examples holds. ``run``'s per-row losses are then summed per example, and the example's norm and
            gradient are those of the sum over its rows (``ClippingEngine.check_counterfactual``'s ``units``); its
            alone counterpart is the example collated alone (its ``k`` rows).
        random_rows: ``features`` were read again from a training set whose rows are random at each read
            (:func:`first_batch_features`): not what ``batch`` was collated from, so each example is compared with
            its own row of the batch, padding removed (the same draw), as under a random collator.
    """
    segments = segment_ids(batch)
    rows = labels.shape[0]
    ids = None
    if example_of_row is None:
        num = rows if segments is None else int(segments.max()) + 1
    else:
        if segments is not None:
            raise ValueError("hf_dp: packed rows whose examples are several model rows are not supported.")
        num = len(features)
        ids = example_of_row(num).to(labels.device)
        if ids.shape != (rows,) or num == 0 or not torch.equal(torch.unique(ids).cpu(), torch.arange(num)):
            raise RuntimeError(f"hf_dp: {num} examples do not cover the {rows} model rows of the batch as "
                               f"example_of_row says (internal error).")
    if len(features) != num or num == 0:
        raise RuntimeError(f"hf_dp: {len(features)} raw examples for a batch of {num} examples (internal error).")

    def per_example(losses: torch.Tensor, of_row: torch.Tensor | None, n: int) -> torch.Tensor:
        """Per-row losses summed per example (an example of several model rows), else as they are."""
        if of_row is None:
            return losses
        return losses.new_zeros(n).index_add(0, of_row.to(losses.device), losses)

    def run_examples(b: dict, lab: torch.Tensor, seg: torch.Tensor | None, n: int) -> torch.Tensor:
        return per_example(run(b, lab, seg), None if example_of_row is None else example_of_row(n), n)

    lengths = [feature_length(f) for f in features]
    order = sorted(range(num), key=lambda k: (lengths[k], k))
    chosen = list(dict.fromkeys([order[0], order[-1], 0, num - 1]))[:MAX_CHECKED]
    randomness = collator_randomness(collate, features)
    if segments is None and randomness != "unseeded":
        check_collator_keeps_rows_apart(collate, features, chosen, example_of_row)
    if random_rows and randomness == "none":
        randomness = "rows"
        logger.info("hf_dp: the training set's rows are random at each read (a transform): the first micro-batch's "
                    "examples are compared with their own rows of the batch, padding removed (the same draw).")
    if randomness == "none":
        def alone_run(i: int) -> Callable[[], torch.Tensor]:
            def go() -> torch.Tensor:
                b1, l1 = prepare(collate_alone([features[i]]))
                return run_examples(b1, l1, segment_ids(b1), 1)
            return go
    elif example_of_row is not None:
        logger.warning("hf_dp: the data collator is random: the examples of several model rows (preference rows) "
                       "were not compared with the same examples alone (only checked to keep rows apart).")
        return
    elif segments is None:
        def alone_run(i: int) -> Callable[[], torch.Tensor]:  # the same random draw, without the batch's padding
            def go() -> torch.Tensor:
                b1, l1 = unpadded_row(batch, labels, i, rows)
                return run(b1, l1, None)
            return go
    else:
        logger.warning("hf_dp: the packing collator is random: the packed examples were not compared with the same "
                       "examples alone.")
        return
    if randomness == "unseeded":
        logger.warning("hf_dp: the data collator is random and its randomness does not follow the torch / random / "
                       "NumPy seeds: hf_dp could not check that it keeps rows apart (only the model, on each row "
                       "without its padding).")
    alone = {i: alone_run(i) for i in chosen}
    try:
        with collator_state_kept(collate_alone), seeded(0), train_without_dropout(net), adapter_advice(net):
            engine.check_counterfactual(lambda: run_examples(batch, labels, segments, num), rows, num, alone,
                                        rtol=rtol, segments=segments, what=what, units=ids)
    except UnsupportedLayerError as err:
        layout = ""
        if segments is None and is_left_padded(batch):
            layout = (" The batch is left-padded" + ("" if "position_ids" in batch else " and carries no position_ids")
                      + ". Left padding does this when positions come from the padded layout, or, for a causal LM "
                      "whose first token is labelled, because the last padding position then predicts the first "
                      "token, a loss term the example alone does not have: pad on the right (or pass position_ids "
                      "from the attention mask and set the first token's label to -100).")
        if segments is not None:
            layout = (" The batch is packed (padding-free rows): if the model does not keep packed examples apart at "
                      "these lengths, train with packing=False and padding_free=False.")
        random_note = "" if randomness == "none" else (
            f" The {'training set' if randomness == 'rows' else 'collator'} is random: each example was compared "
            "with its own row of the batch, padding removed (the same random draw).")
        raise UnsupportedLayerError(f"{err}{layout}{random_note} {WAYS_OUT}") from err


# ------------------------------------------------------------------ the trainer's first-step wiring
# What DPTrainer runs at the first step (``_check_examples_alone``), through the DP step's hooks
# (``clipping.step.StepHooks``): the batch on the device, the loss context, the model's inputs and the per-example loss
# exactly as the DP step uses them.
def alone_rtol(net: nn.Module, low_precision: bool) -> float:
    """Relative tolerance of the counterfactual comparisons: rounding differs between a batch and an example alone
    (other shapes, other kernels), by far less than this in each precision (``low_precision``: bf16 / fp16)."""
    if low_precision:
        return 5e-2
    dtype = next((p.dtype for p in net.parameters() if p.is_floating_point()), torch.float32)
    return 1e-5 if dtype == torch.float64 else 1e-3


def collated_on_device(hooks: StepHooks, raw: dict) -> tuple[dict, torch.Tensor]:
    """A collated batch on the device without hf_dp's row tags: ``(inputs, labels)``."""
    batch = hooks.prepare_inputs(raw)
    batch.pop(UNIT_KEY, None)
    batch.pop(INDEX_KEY, None)
    return batch, batch.pop("labels")


def example_losses(hooks: StepHooks, net: nn.Module, batch: dict, labels: torch.Tensor,
                   segments: torch.Tensor | None = None) -> torch.Tensor:
    """Per-example losses of a batch exactly as the DP step computes them (loss context, model inputs,
    ``per_example_loss``; per packed example with ``segments``)."""
    with hooks.loss_context():
        return hooks.example_losses(net, batch, labels, **({} if segments is None else {"segments": segments}))


def hard_batch(rows: Any, collate: Callable, size: int, hooks: StepHooks) -> tuple[list, dict, torch.Tensor] | None:
    """Rows of very different lengths from the training set ``rows`` (the shortest, the longest and one between,
    :func:`hard_batch_indices`), collated together by the training collator, on the device: ``(raw features,
    batch, labels)``; ``None`` with fewer than two rows. The run's random draws are not shifted."""
    if len(rows) < 2:
        return None
    features = [rows[int(i)] for i in hard_batch_indices(rows, size=size)]
    if len(features) < 2:
        return None
    with torch.random.fork_rng(devices=[]), collator_state_kept(collate):  # the run's own draws are not shifted
        batch, labels = collated_on_device(hooks, collate(list(features)))
    return features, batch, labels


def check_first_step_alone(engine: ClippingEngine, hooks: StepHooks, net: nn.Module, micro: dict,
                           labels: torch.Tensor, collate: Callable, collate_alone: Callable,
                           features: list | None, hard: tuple[list, dict, torch.Tensor] | None, rtol: float,
                           extras: Callable[[dict, torch.Tensor], dict] | None = None,
                           example_of_row: Callable[[int], torch.Tensor] | None = None,
                           random_rows: bool = False) -> None:
    """Once per run, before the first update: each example's loss and gradient, as the DP step computes them in its
    batch, equal those of the example collated alone (:func:`check_examples_alone`), on the first micro-batch (its
    raw ``features``; ``None``: they could not travel with the batch) and on the ``hard`` batch
    (:func:`hard_batch`). Once is enough: the collator and the model are the same functions at every step, and the
    hard batch makes the rows' lengths as different as the training set allows (the module's docstring).

    ``extras(batch, labels)``: inputs the DP step adds to each collated micro-batch (DPO's reference log-probs,
    ``hf_dp/preference.py``), added to the hard batch and to each example alone; ``example_of_row``: an example of
    several model rows (a preference row, :func:`check_examples_alone`); ``random_rows``: the first micro-batch's
    ``features`` were read again from rows that are random at each read (:func:`first_batch_features`)."""

    def prepare(raw: dict) -> tuple[dict, torch.Tensor]:
        batch, lab = collated_on_device(hooks, raw)
        if extras is not None:
            batch.update(extras(batch, lab))
        return batch, lab

    common = dict(collate=collate, collate_alone=collate_alone, prepare=prepare,
                  run=lambda b, lab, seg: example_losses(hooks, net, b, lab, seg), segment_ids=hooks.segment_ids,
                  rtol=rtol, example_of_row=example_of_row)
    if hard is not None and extras is not None:
        hard[1].update(extras(hard[1], hard[2]))
    if features is not None:
        check_examples_alone(engine, net, features, micro, labels, **common, what=" (the first micro-batch)",
                             random_rows=random_rows)
    else:
        logger.warning("hf_dp: the first micro-batch was not compared with its examples alone (the training set's "
                       "rows are not dicts, so their indices cannot travel with the batch); only the batch of the "
                       "training set's shortest and longest rows is.")
    if hard is not None:
        check_examples_alone(engine, net, hard[0], hard[1], hard[2], **common,
                             what=" (a batch of the training set's shortest and longest rows)")
    logger.info("hf_dp: each example's loss and gradient in its batch equal the example's alone (%s).",
                " and ".join(w for w, done in (("first micro-batch", features is not None),
                                               ("shortest and longest rows", hard is not None)) if done))
