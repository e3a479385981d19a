"""The unit the user thinks they have: training rows that look like fixed-length blocks of concatenated text.

DP-SGD protects whatever one privacy unit is: one row of ``train_dataset`` (``privacy_unit="example"``) or all rows
sharing a ``user_id_column`` value (``privacy_unit="user"``). transformers' ``run_clm.py`` / ``run_mlm.py``
(``group_texts``) concatenate all documents and cut the stream into blocks of ``block_size`` tokens *before* training:
each row is then a block, one document spans several blocks and one block holds parts of several documents. The
guarantee is per block; a document spread over k blocks is protected only as a group of k (group privacy: roughly
kε), and nothing about the rows says so. :func:`looks_grouped` recognises such rows, cheaply, from the columns
(the trainer warns once and the card says what one unit is); :func:`chunk_documents` is the way to document-level DP:
chunk *within* documents (never across) and train with ``privacy_unit="user"``, ``user_id_column`` the document id,
so that all chunks of one document are one unit (the user-level clipping of ``DPTrainer``: the document's
contribution is clipped to C as a whole).

The heuristic (:func:`looks_grouped`), on up to :data:`SAMPLE_ROWS` evenly spaced rows (first and last included):
every row has an ``input_ids`` token list, all of one length L ≥ 2, with no padding (no ``attention_mask`` zero; no
``pad_token_id`` when it differs from the EOS/BOS tokens that separate documents), and ``labels`` either absent (the
collator copies them, as ``DataCollatorForLanguageModeling`` does) or equal to ``input_ids`` (as ``group_texts``
writes them). Padded rows, rows of different lengths, classification labels and prompt-masked labels are not
grouped. It can be fooled: every document truncated to exactly L tokens looks grouped (then the unit really is one
document: declare it with ``privacy_unit="user"`` and a document-id column, which silences the check), and blocks
whose sampled rows differ in length are not recognised.

Rows that repeat other rows exactly (:func:`repeated_rows`: oversampling by concatenating a set with a part of itself,
``interleave_datasets(stopping_strategy="all_exhausted")``, duplicates in the source) make one example m rows, so it is
protected only as a group of m and each step can sample every copy (the budget spent on it m times, reported once).
Every stored row is read once at construction (a ``datasets.Dataset`` without its format or transform); the trainer
warns once and the card says so. Not scanned: ``datasets`` tables over 512 MiB, other data sets of over 20,000 rows,
rows holding objects with no exact key (PIL images); near-duplicates are not seen.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["REPEAT_SCAN_BYTES", "REPEAT_SCAN_ROWS", "SAMPLE_ROWS", "UnitDetail", "check_grouped_rows",
           "check_repeated_rows", "chunk_documents", "grouped_rows_detail", "looks_grouped", "repeated_rows"]

SAMPLE_ROWS = 256
"""Rows :func:`looks_grouped` reads (evenly spaced; all rows of a smaller data set)."""


def _tokens(value: Any) -> list[int] | None:
    """A flat list of ints, or None if ``value`` is not one (a nested list, a scalar, a string)."""
    if hasattr(value, "tolist") and callable(value.tolist):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not value:
        return None
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return None
    return list(value)


def _sample(n: int, k: int = SAMPLE_ROWS) -> list[int]:
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def looks_grouped(dataset: Any, pad_token_id: int | None = None, separator_ids: Sequence[int] = ()) -> int | None:
    """The block length L if ``dataset``'s rows look like fixed-length blocks of concatenated text, else None.

    Args:
        dataset: A map-style data set of mappings with ``input_ids`` (a ``datasets.Dataset``, a list of dicts, ...).
        pad_token_id: The tokenizer's pad id; a row holding it is padded (unless it is also a separator id).
        separator_ids: Token ids that separate documents inside a block (EOS, BOS): not evidence of padding.
    """
    try:
        n = len(dataset)
    except TypeError:
        return None
    if n < 2:
        return None
    pad = None if pad_token_id is None or pad_token_id in set(separator_ids) else int(pad_token_id)
    with torch.random.fork_rng(devices=[]):  # a data set whose rows are drawn at random does not shift the user's RNG
        rows = (dataset[i] for i in _sample(n))
        try:
            return _common_block_length(rows, pad)
        except (IndexError, KeyError, TypeError, ValueError):  # rows this heuristic cannot read: nothing to say
            return None


def _common_block_length(rows: Any, pad: int | None) -> int | None:
    length = None
    for row in rows:
        if not isinstance(row, Mapping) or "input_ids" not in row:
            return None
        ids = _tokens(row["input_ids"])
        if ids is None or len(ids) < 2 or (length is not None and len(ids) != length):
            return None
        length = len(ids)
        mask = row.get("attention_mask")
        if mask is not None:
            mask = _tokens(mask)
            if mask is None or any(m != 1 for m in mask):
                return None
        if pad is not None and pad in ids:
            return None
        labels = row.get("labels", row.get("label"))
        if labels is not None and _tokens(labels) != ids:
            return None
    return length


def grouped_rows_detail(block_length: int) -> str:
    """What the record and the card say of one unit when the rows look grouped (``privacy_unit_detail``)."""
    return (f"one row of {block_length} tokens; the rows look like fixed-length blocks of concatenated text (all "
            f"{block_length} tokens long, no padding, labels = input_ids, as transformers' run_clm.py group_texts "
            "writes them). If they were cut from a concatenation of documents, the guarantee protects one block, not "
            "one document: a document spread over k blocks is protected only as a group of k (group_privacy), and a "
            "block may hold parts of several documents. For document-level DP chunk within documents "
            "(hf_dp.units.chunk_documents) and train with privacy_unit='user', user_id_column=<document id>")


def check_grouped_rows(dataset: Any, tokenizer: Any = None, config: Any = None) -> tuple[str | None, str | None]:
    """Whether the rows of ``dataset`` look like ``run_clm``'s fixed-length blocks (:func:`looks_grouped`, with the
    pad and separator ids of ``tokenizer`` / the model's ``config``): ``(privacy_unit_detail, warning)``, both None
    when they do not. The trainer says the warning once per training set; the record and the card say the detail."""
    separators = {getattr(o, k, None) for o in (tokenizer, config) for k in ("eos_token_id", "bos_token_id")}
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(config, "pad_token_id", None)
    length = looks_grouped(dataset, pad if isinstance(pad, int) else None,
                           [t for t in separators if isinstance(t, int)])
    if length is None:
        return None, None
    msg = (f"hf_dp: the privacy unit is one row of the training set, and its rows look like fixed-length "
           f"blocks of concatenated text (every row {length} tokens, no padding, labels = input_ids: "
           "transformers' run_clm.py group_texts). If so, ε protects one block, not one document: a "
           "document spread over k blocks is protected only as a group of k. For document-level DP, chunk "
           "within documents (hf_dp.units.chunk_documents) and pass privacy_unit='user', "
           "user_id_column=<document id> (README, 'Document-level DP for language modelling'); if every "
           "row is already one whole document, the same settings say so and silence this warning. The "
           "card records the unit as a block.")
    return grouped_rows_detail(length), msg


# ---------------------------------------------------------------------- rows that repeat other rows
_SCALARS = {int, float, bool, str, bytes, type(None)}


class _Unhashable(Exception):
    """A row value :func:`_value_key` has no cheap exact key for (the duplicate check is then skipped)."""


def _value_key(value: Any) -> Any:
    """An exact, hashable key of one value of a row: tensors and arrays by dtype, shape and bytes; lists and tuples
    element by element; strings, numbers, booleans and None as they are."""
    if value is None or isinstance(value, (str, bytes, int, float, bool)):
        return value
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return ("tensor", str(value.dtype), tuple(value.shape), value.contiguous().view(-1).view(torch.uint8)
                .numpy().tobytes())
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, np.ascontiguousarray(value).tobytes())
    if isinstance(value, (list, tuple)):
        flat = tuple(value)
        if set(map(type, flat)) <= _SCALARS:  # token ids, the common case: the list is its own key
            return flat
        return tuple(_value_key(v) for v in value)
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _value_key(v)) for k, v in value.items()))
    raise _Unhashable(type(value).__name__)


REPEAT_SCAN_BYTES = 1 << 29
"""A ``datasets.Dataset`` is scanned for repeated rows when its stored table is at most this size (512 MiB: about 11 s
of CPU at construction; 200,000 rows of 128 int64 tokens with their masks are 294 MiB, 6 s)."""
REPEAT_SCAN_ROWS = 20_000
"""Any other data set (read by ``__getitem__``, which may load or tokenise) is scanned when it has at most this many
rows."""


def _is_hf_dataset(dataset: Any) -> bool:
    return callable(getattr(dataset, "with_format", None)) and hasattr(dataset, "column_names")


def _stored_rows(dataset: Any, batch: int = 1024) -> Iterator[Any]:
    """Every row of ``dataset`` as stored: a ``datasets.Dataset`` is read in batches without its format or transform
    (``with_format(None)``: a random ``set_transform`` augmentation would make every read differ); anything else
    by index."""
    if _is_hf_dataset(dataset):
        raw = dataset.with_format(None)
        for start in range(0, len(raw), batch):
            part = raw[start:start + batch]
            names = list(part)
            yield from (dict(zip(names, values)) for values in zip(*(part[n] for n in names)))
        return
    for i in range(len(dataset)):
        yield dataset[i]


def repeated_rows(dataset: Any) -> tuple[int, int, tuple[int, int]] | None:
    """``(repeats, most, (first, later))`` when rows of ``dataset`` repeat earlier rows exactly: ``repeats`` rows are
    copies of an earlier row, one row has ``most`` copies in all, and row ``later`` equals row ``first``; ``None``
    when every row is distinct, when a row holds a value with no cheap exact key (a PIL image, an object), or when
    the set is too large to read at construction (:data:`REPEAT_SCAN_BYTES`, :data:`REPEAT_SCAN_ROWS`). Every row is
    read once, as stored (1.0 s of CPU for 50,000 rows of 128 tokens)."""
    try:
        n = len(dataset)
    except TypeError:
        return None
    if _is_hf_dataset(dataset):
        size = getattr(getattr(dataset, "data", None), "nbytes", None)
        if not isinstance(size, int) or size > REPEAT_SCAN_BYTES:
            return None
    elif n > REPEAT_SCAN_ROWS:
        return None
    seen: dict[int, int] = {}  # the key's 64-bit hash -> the first row with it (a collision: ~N²/2⁶⁵, negligible)
    counts: dict[int, int] = {}
    example = None
    try:
        for i, row in enumerate(_stored_rows(dataset)):
            first = seen.setdefault(hash(_value_key(row)), i)
            if first != i:
                counts[first] = counts.get(first, 1) + 1
                example = example or (first, i)
            if i + 1 >= n:
                break
    except _Unhashable:
        return None
    if not counts:
        return None
    return sum(c - 1 for c in counts.values()), max(counts.values()), example


def check_repeated_rows(dataset: Any) -> tuple[str | None, str | None]:
    """Rows that repeat other rows exactly (oversampling by ``concatenate_datasets`` / ``ConcatDataset`` of a set
    with itself or a part of it, ``interleave_datasets(stopping_strategy="all_exhausted")``, duplicates in the
    source): ``(privacy_unit_detail, warning)``, both None when every row is distinct. The privacy unit is one row, so
    an example held in m rows is protected only as a group of m (group privacy: roughly mε; Dwork & Roth 2014,
    Thm. 2.2) and a step can sample it m times: the budget is spent on it m times and reported once."""
    found = repeated_rows(dataset)
    if found is None:
        return None, None
    repeats, most, (first, later) = found
    detail = (f"one row; {repeats} row(s) of the training set repeat another row exactly (up to {most} copies of one "
              f"row, e.g. row {later} equals row {first}): where they are copies of one example (oversampling), that "
              "example is protected only as a group of m for m copies (group_privacy); rows equal by chance (two "
              "people wrote the same text) are separate examples")
    msg = (f"hf_dp: {repeats} row(s) of the training set repeat another row exactly (row {later} equals row {first}; "
           f"up to {most} copies of one row), e.g. from oversampling (concatenate_datasets or ConcatDataset of a set "
           "with a part of itself, interleave_datasets(stopping_strategy='all_exhausted')). The privacy unit is one "
           f"row: if they are copies of one example, that example held in {most} rows is protected only as a group of "
           f"{most} (group_privacy(ε, δ, {most})), since each step can sample every copy; rows equal by chance (two "
           "people wrote the same text) are separate examples, each protected at ε. To protect each example at ε, "
           "keep one copy of each (weight "
           "examples through per_example_loss instead of repeating them), or pass privacy_unit='user' with "
           "user_id_column naming the original example. The card records it.")
    return detail, msg



class UnitDetail:
    """What one privacy unit of a training set is, checked once per training set (:func:`check_grouped_rows`,
    :func:`check_repeated_rows`) and kept for the record and the card (``privacy_unit_detail``) while that set is the
    one trained on."""

    def __init__(self) -> None:
        self._seen: tuple[int, str | None] | None = None  # (id of the data set, privacy_unit_detail)

    def check(self, dataset: Any, tokenizer: Any = None, config: Any = None, declared: bool = False) -> str | None:
        """The warning to say (once per training set), or None; ``declared``: the unit is declared by a user id
        column (``privacy_unit='user'``), nothing is checked."""
        if dataset is None or (self._seen is not None and self._seen[0] == id(dataset)):
            return None
        if declared:
            self._seen = (id(dataset), None)
            return None
        checks = [check_grouped_rows(dataset, tokenizer, config), check_repeated_rows(dataset)]
        details = [d for d, _ in checks if d is not None]
        self._seen = (id(dataset), "; ".join(details) if details else None)
        msgs = [m for _, m in checks if m is not None]
        return "\n".join(msgs) if msgs else None

    def detail(self, dataset: Any) -> str | None:
        """``privacy_unit_detail`` of ``dataset`` if it is the set last checked, else None."""
        if self._seen is None or dataset is None or self._seen[0] != id(dataset):
            return None
        return self._seen[1]


def chunk_documents(dataset: Any, block_size: int, document_id_column: str = "document_id",
                    columns: Sequence[str] = ("input_ids",), labels: bool = True,
                    carry_columns: Sequence[str] = ()) -> Any:
    """Splits every document (row) of ``dataset`` into chunks of at most ``block_size`` tokens, within the document
    only (a chunk never holds tokens of two documents; a document's last chunk may be shorter: the collator pads it),
    each chunk tagged with its document's id. Train on the result with ``privacy_unit="user"`` and
    ``user_id_column=document_id_column``: a document, all its chunks, is then one privacy unit.

    Args:
        dataset: A ``datasets.Dataset`` (or a list of dicts) with one document per row: tokenised ``columns``.
        block_size: Tokens per chunk.
        document_id_column: The id column to write (the row's index), or to keep if the data set has it already.
        columns: The token-aligned columns to split (``input_ids``, and e.g. ``attention_mask``).
        labels: Also write ``labels`` = the chunk's ``input_ids`` (causal LM).
        carry_columns: Per-document columns copied onto each of its chunks (e.g. an author id, for user units that
            are coarser than documents: every chunk of a document then belongs to the document's author).

    Returns:
        A data set of the same kind (``datasets.Dataset`` in, ``datasets.Dataset`` out), one chunk per row.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}.")
    rows = dataset if isinstance(dataset, list) else [dataset[i] for i in range(len(dataset))]
    out: dict[str, list] = {c: [] for c in columns}
    out[document_id_column] = []
    for c in carry_columns:
        out[c] = []
    if labels:
        out["labels"] = []
    for index, row in enumerate(rows):
        doc = row.get(document_id_column, index)
        tokens = {c: list(_tokens(row[c]) or []) for c in columns}
        n = len(tokens[columns[0]])
        for start in range(0, n, block_size):
            for c in columns:
                out[c].append(tokens[c][start:start + block_size])
            out[document_id_column].append(doc)
            for c in carry_columns:
                out[c].append(row[c])
            if labels:
                out["labels"].append(tokens[columns[0]][start:start + block_size])
    if isinstance(dataset, list):
        return [dict(zip(out, values)) for values in zip(*out.values())]
    from datasets import Dataset

    return Dataset.from_dict(out)
