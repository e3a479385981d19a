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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["SAMPLE_ROWS", "UnitDetail", "check_grouped_rows", "chunk_documents", "grouped_rows_detail",
           "looks_grouped"]

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


class UnitDetail:
    """What one privacy unit of a training set is, checked once per training set (:func:`check_grouped_rows`) and
    kept for the record and the card (``privacy_unit_detail``) while that set is the one trained on."""

    def __init__(self) -> None:
        self._seen: tuple[int, str | None] | None = None  # (id of the data set, privacy_unit_detail)

    def check(self, dataset: Any, tokenizer: Any = None, config: Any = None, declared: bool = False) -> str | None:
        """The warning to say (once per training set), or None; ``declared``: the unit is declared by a user id
        column (``privacy_unit='user'``), nothing is checked."""
        if dataset is None or (self._seen is not None and self._seen[0] == id(dataset)):
            return None
        detail, msg = (None, None) if declared else check_grouped_rows(dataset, tokenizer, config)
        self._seen = (id(dataset), detail)
        return msg

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
