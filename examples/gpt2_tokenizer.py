"""The real GPT-2 byte-level BPE tokenizer, rebuilt offline from the ``gpt2.tiktoken`` asset of ``openai-whisper``.

No package ships GPT-2 weights or tokenizer files for ``transformers`` offline, but the ``openai-whisper`` sdist
(PyPI, MIT license, Copyright (c) 2022 OpenAI) contains ``whisper/assets/gpt2.tiktoken``: the 50,256 byte-level BPE
tokens of GPT-2 with their ranks, which *are* the GPT-2 ids. This module turns that file into a
``transformers.GPT2Tokenizer`` (``vocab.json`` with the 50,257 entries incl. ``<|endoftext|>`` = 50256, and the
50,000 merges recovered from the ranks), saves it with ``save_pretrained`` and caches it, so that
``AutoTokenizer.from_pretrained(gpt2_tokenizer_dir())`` works offline afterwards. The result is identical to the
original GPT-2 tokenizer (``"Hello world"`` -> ``[15496, 995]``; checked on all of *Pride and Prejudice* against
``tiktoken``, see ``shared/notes/LIBRARY_FACTS.md`` §2.3).

Where the asset comes from, in this order:

1. ``$HF_DP_GPT2_TIKTOKEN`` (a path to ``gpt2.tiktoken``);
2. an ``openai_whisper-*.tar.gz`` sdist already in the cache directory (e.g. put there by ``examples/setup_data.sh``);
3. ``python -m pip download --no-deps openai-whisper==20250625`` into the cache (803 kB; whisper is *not*
   installed — it would pull torch, numba, ...; only two files are extracted: the asset and the LICENSE).

Cache: ``$HF_DP_DATA_CACHE/gpt2_tokenizer`` (default ``~/.cache/hf_dp/data/gpt2_tokenizer``), next to the example
data of ``examples/data.py``. ``python examples/gpt2_tokenizer.py [VOCAB_SIZE ...]`` builds it and prints a check.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase

__all__ = ["FULL_VOCAB", "WHISPER_VERSION", "bpe_merges_from_ranks", "gpt2_tokenizer_dir", "load_gpt2_tokenizer",
           "read_tiktoken"]

WHISPER_VERSION = "20250625"
ASSET = "whisper/assets/gpt2.tiktoken"
ENV_ASSET = "HF_DP_GPT2_TIKTOKEN"
EOS = "<|endoftext|>"
FULL_VOCAB = 50257
_COMPLETE = ".hf_dp_complete"


def _cache_root() -> Path:
    root = Path(os.environ.get("HF_DP_DATA_CACHE") or Path.home() / ".cache" / "hf_dp" / "data").expanduser()
    return root / "gpt2_tokenizer"


def read_tiktoken(path: str | Path) -> dict[bytes, int]:
    """``{token bytes: rank}`` from a ``.tiktoken`` file (lines ``base64(bytes) rank``)."""
    ranks: dict[bytes, int] = {}
    for line in Path(path).read_text(encoding="ascii").splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters (``encoder.py`` of openai/gpt-2)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _split_by_lower_ranks(token: bytes, ranks: dict[bytes, int], max_rank: int) -> list[bytes]:
    """Byte-pair-merge ``token`` using only merges of rank < ``max_rank`` (tiktoken's ``bpe`` on one token)."""
    parts = [bytes([b]) for b in token]
    while True:
        best_i, best_rank = -1, max_rank
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best_i, best_rank = i, rank
        if best_i < 0:
            return parts
        parts[best_i:best_i + 2] = [parts[best_i] + parts[best_i + 1]]


def bpe_merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list, in rank order, that reproduces ``ranks``: each multi-byte token is the merge of the two
    parts that BPE with the lower-ranked tokens leaves it in."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = _split_by_lower_ranks(token, ranks, rank)
        if len(parts) != 2:
            raise ValueError(f"token {token!r} (rank {rank}) is not the merge of two lower-ranked tokens: {parts}")
        merges.append((parts[0], parts[1]))
    return merges


def _asset_from_sdist(sdist: Path, out_dir: Path) -> Path:
    """Extract ``gpt2.tiktoken`` and the LICENSE from a whisper sdist into ``out_dir``."""
    with tarfile.open(sdist) as tar:
        members = {m.name: m for m in tar.getmembers()}
        top = sdist.name[: -len(".tar.gz")]
        for name, target in ((f"{top}/{ASSET}", "gpt2.tiktoken"), (f"{top}/LICENSE", "WHISPER_LICENSE")):
            if name not in members:
                raise FileNotFoundError(f"{name} is not in {sdist}")
            src = tar.extractfile(members[name])
            assert src is not None
            (out_dir / target).write_bytes(src.read())
    return out_dir / "gpt2.tiktoken"


def _find_asset(cache: Path) -> Path:
    env = os.environ.get(ENV_ASSET)
    if env:
        return Path(env)
    sdists = sorted(cache.glob("openai_whisper-*.tar.gz"))
    if not sdists:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               "-d", str(cache), f"openai-whisper=={WHISPER_VERSION}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        sdists = sorted(cache.glob("openai_whisper-*.tar.gz"))
        if proc.returncode != 0 or not sdists:
            raise RuntimeError(
                f"Could not download the openai-whisper sdist (needed for GPT-2's gpt2.tiktoken): "
                f"`{' '.join(cmd)}` exited {proc.returncode}: {proc.stderr.strip()[-500:]}\n"
                f"Put openai_whisper-{WHISPER_VERSION}.tar.gz into {cache}, or set {ENV_ASSET}=/path/to/gpt2.tiktoken."
            )
    return _asset_from_sdist(sdists[-1], cache)


def gpt2_tokenizer_dir(vocab_size: int = FULL_VOCAB, cache: str | Path | None = None) -> Path:
    """Build (once) and return a directory that ``AutoTokenizer.from_pretrained`` loads as the GPT-2 tokenizer.

    ``vocab_size=50257`` is GPT-2's tokenizer. A smaller ``vocab_size`` V keeps GPT-2's first V − 1 BPE tokens
    (the 256 single bytes and the first V − 257 merges, in GPT-2's own merge order) plus ``<|endoftext|>`` = V − 1:
    the same byte-level BPE stopped earlier. Every text is still encodable (all bytes are tokens), the kept tokens
    keep their GPT-2 ids, texts just take a few more tokens; nothing is learned from any data set. It makes the
    tied embedding / LM head (V × d, the dominant cost of a small GPT-2) proportionally cheaper.
    """
    from transformers import GPT2Tokenizer

    if not 257 <= vocab_size <= FULL_VOCAB:
        raise ValueError(f"vocab_size must be in [257, {FULL_VOCAB}], got {vocab_size}.")
    root = Path(cache) if cache is not None else _cache_root()
    out = root / ("tokenizer" if vocab_size == FULL_VOCAB else f"tokenizer-{vocab_size}")
    if (out / _COMPLETE).is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    ranks = read_tiktoken(_find_asset(root))
    ranks = {token: rank for token, rank in ranks.items() if rank < vocab_size - 1}
    byte_encoder = _bytes_to_unicode()

    def as_text(b: bytes) -> str:
        return "".join(byte_encoder[x] for x in b)

    vocab = {as_text(token): rank for token, rank in ranks.items()}
    vocab[EOS] = len(ranks)  # 50256
    merges = [(as_text(a), as_text(b)) for a, b in bpe_merges_from_ranks(ranks)]
    # transformers 5: GPT2Tokenizer(vocab_file=..., merges_file=...) silently builds an empty tokenizer; pass the
    # vocabulary and merges themselves (LIBRARY_FACTS §2.3).
    tok = GPT2Tokenizer(vocab=vocab, merges=merges, unk_token=EOS, bos_token=EOS, eos_token=EOS,
                        add_prefix_space=False)
    tok.model_max_length = 1024
    if len(tok) != vocab_size or (vocab_size == FULL_VOCAB and tok("Hello world")["input_ids"] != [15496, 995]):
        raise RuntimeError(f"the rebuilt GPT-2 tokenizer is wrong: len {len(tok)}, "
                           f"'Hello world' -> {tok('Hello world')['input_ids']}")
    work = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=root))
    try:
        tok.save_pretrained(work)
        (work / "SOURCE.md").write_text(
            f"GPT-2 byte-level BPE rebuilt from whisper/assets/gpt2.tiktoken of the PyPI sdist openai-whisper "
            f"{WHISPER_VERSION} (MIT license, Copyright (c) 2022 OpenAI; see ../WHISPER_LICENSE) by "
            f"hf_dp's examples/gpt2_tokenizer.py.\n")
        (work / _COMPLETE).write_text(json.dumps({"vocab": len(vocab), "merges": len(merges)}) + "\n")
        if out.exists():
            shutil.rmtree(out)
        try:
            work.rename(out)
        except OSError:  # another process finished first
            if not (out / _COMPLETE).is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def load_gpt2_tokenizer(vocab_size: int = FULL_VOCAB, cache: str | Path | None = None) -> PreTrainedTokenizerBase:
    """The GPT-2 tokenizer (``AutoTokenizer`` from :func:`gpt2_tokenizer_dir`), with ``pad_token = eos_token``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gpt2_tokenizer_dir(vocab_size, cache))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Build (and cache) the GPT-2 tokenizer from openai-whisper's "
                                                 "gpt2.tiktoken, optionally truncated to the first VOCAB_SIZE tokens.")
    parser.add_argument("vocab_sizes", nargs="*", type=int, metavar="VOCAB_SIZE",
                        help=f"Vocabulary sizes to build (default: {FULL_VOCAB}, the full GPT-2 vocabulary).")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for size in parser.parse_args().vocab_sizes or [FULL_VOCAB]:
        tokenizer = load_gpt2_tokenizer(size)
        ids = tokenizer("Hello world")["input_ids"]
        print(f"{gpt2_tokenizer_dir(size)}: {type(tokenizer).__name__}, {len(tokenizer)} tokens, "
              f"eos={tokenizer.eos_token_id}, 'Hello world' -> {ids}")
