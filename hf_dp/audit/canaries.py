"""Secret-sharer canaries and their exposure (Carlini et al. 2019; Li et al. 2022, App. M).

Carlini, Liu, Erlingsson, Kos & Song, "The Secret Sharer: Evaluating and Testing Unintended Memorization in Neural
Networks" (USENIX Security 2019) insert *canaries* — a fixed format such as ``"my secret number is ____"`` whose blank
is a random secret from a known space ``R`` — into the training data, and after training measure

    exposure(s) = log2 |R| − log2 rank(s),

where ``rank(s)`` is the position of the inserted secret when all candidates of ``R`` are sorted by the model's
log-perplexity ``Px(s) = −Σ_t log2 Pr(s_t | prefix, s_<t)`` (§4 of the paper). Exposure is ≈ 0–2 bits when the canary
looks like any other candidate and ``log2 |R|`` when it is the most likely one (then it "can likely be extracted", Li et
al. 2022, App. M). When ``R`` is too large to enumerate, the paper's *approximation by distribution modeling* fits a
skew-normal distribution to the log-perplexities of many *non-inserted* candidates and estimates
``exposure ≈ −log2 F(Px(s))`` with ``F`` the fitted CDF. Li et al. 2022 (App. M, Table 9) use this with ``V = 10``
random words of the GPT-2 vocabulary as the sub-vocabulary, secrets of about ``l = 5`` words (``|R| = V^l``), prefixes
whose ``<word>`` slots are also drawn from the sub-vocabulary, and repetition counts ``r ∈ {1, 10, 100}``.

This module builds such canaries for any Hugging Face tokenizer (or directly from token ids), inserts their ``r``
copies into a tokenized training set as ordinary rows (they go through the same Poisson sampling and per-example
clipping as every other example: under DP each copy is one privacy unit, so a canary repeated ``r`` times is protected
only at the group-privacy level ``r``), and computes both exposures for any causal LM.

Computation detail: the log-perplexities of all ``V`` candidates that share their first ``l − 1`` secret tokens come
from one forward pass (the model's next-token distribution at the last position), so the exact rank over ``|R| = V^l``
candidates costs ``V^(l−1)`` forward passes, and ``n`` reference candidates cost ``⌈n / V⌉``.
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from scipy import stats

__all__ = [
    "Canary",
    "CanarySet",
    "canary_exposure",
    "exposure_by_distribution",
    "exposure_from_rank",
    "make_canaries",
    "summarize_exposures",
]

_LN2 = math.log(2.0)


@dataclass(frozen=True)
class Canary:
    """One canary: ``prefix_ids`` (the format with its ``<word>`` slots filled) followed by the secret.

    ``repetitions`` is how many copies go into the training set; ``0`` makes a control canary that is never inserted
    (its exposure estimates the chance level, ≈ 0–2 bits).
    """

    prefix_ids: tuple[int, ...]
    secret_ids: tuple[int, ...]
    repetitions: int
    text: str | None = None


@dataclass
class CanarySet:
    """Canaries that share a sub-vocabulary ``subvocab_ids`` and a secret length (candidate space ``V^l``).

    A canary's token sequence is ``bos_ids + prefix_ids + secret_ids + eos_ids``; its log-perplexity is measured on
    the secret tokens only (the prefix is the same for all candidates of that canary, so the ranking is the same as with
    the whole sequence).
    """

    canaries: list[Canary]
    subvocab_ids: tuple[int, ...]
    secret_length: int
    bos_ids: tuple[int, ...] = ()
    eos_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    seed: int = 0
    subvocab_words: tuple[str, ...] | None = field(default=None)

    def __len__(self) -> int:
        return len(self.canaries)

    def __iter__(self) -> Iterator[Canary]:
        return iter(self.canaries)

    @property
    def space_size(self) -> int:
        """``|R| = V^l``: the number of candidate secrets per canary."""
        return len(self.subvocab_ids) ** self.secret_length

    @property
    def max_exposure(self) -> float:
        """``log2 |R|``: the exposure of a canary that ranks first among all candidates."""
        return self.secret_length * math.log2(len(self.subvocab_ids))

    @property
    def num_inserted_rows(self) -> int:
        """Number of training rows the canaries add (``Σ r``)."""
        return sum(c.repetitions for c in self.canaries)

    def context_ids(self, canary: Canary) -> list[int]:
        """The tokens before the secret: ``bos_ids + prefix_ids``."""
        return [*self.bos_ids, *canary.prefix_ids]

    def sequence(self, canary: Canary) -> list[int]:
        """The full token sequence of a canary as it is inserted: ``bos + prefix + secret + eos``."""
        return [*self.bos_ids, *canary.prefix_ids, *canary.secret_ids, *self.eos_ids]

    def training_rows(self, pad_to: int | None = None, pad_token_id: int | None = None) -> dict[str, list[list[int]]]:
        """``input_ids``/``attention_mask``/``labels`` for every inserted copy (``r`` rows per canary).

        Labels are the input ids with ``-100`` on padding. With ``pad_to`` the rows are right-padded to that length.
        """
        pad = self.pad_token_id if pad_token_id is None else pad_token_id
        rows: dict[str, list[list[int]]] = {"input_ids": [], "attention_mask": [], "labels": []}
        for canary in self.canaries:
            ids = self.sequence(canary)
            n_pad = 0
            if pad_to is not None:
                if len(ids) > pad_to:
                    raise ValueError(f"A canary has {len(ids)} tokens, more than pad_to={pad_to}.")
                n_pad = pad_to - len(ids)
                if n_pad and pad is None:
                    raise ValueError("Padding the canaries needs pad_token_id (or CanarySet.pad_token_id).")
            for _ in range(canary.repetitions):
                rows["input_ids"].append(ids + [pad] * n_pad)
                rows["attention_mask"].append([1] * len(ids) + [0] * n_pad)
                rows["labels"].append(ids + [-100] * n_pad)
        return rows

    def insert_into(self, dataset: Any, *, pad_to: int | str | None = "auto", pad_token_id: int | None = None,
                    text_column: str | None = "text") -> Any:
        """Return ``dataset`` (a tokenized ``datasets.Dataset``) with the canary copies appended as ordinary rows.

        Args:
            dataset: rows with ``input_ids``, ``attention_mask`` and ``labels``. Other columns are kept; the canary
                rows get ``None`` there, except ``text_column`` (if present), which gets the canary's text.
            pad_to: ``"auto"`` pads the canaries to the dataset's row length if all rows have the same length (a
                fixed-length dataset used with the default collator), else leaves them unpadded; an int pads to it.
            pad_token_id: padding id (default: the set's ``pad_token_id``).

        The order of rows does not matter under Poisson sampling (every row is in a batch independently).
        """
        import datasets

        missing = {"input_ids", "attention_mask", "labels"} - set(dataset.column_names)
        if missing:
            raise ValueError(f"insert_into needs a tokenized dataset; missing columns {sorted(missing)}.")
        if pad_to == "auto":
            lengths = {len(x) for x in dataset["input_ids"]}
            pad_to = lengths.pop() if len(lengths) == 1 else None
        rows: dict[str, list[Any]] = dict(self.training_rows(pad_to=pad_to, pad_token_id=pad_token_id))
        n = len(rows["input_ids"])
        texts = [c.text for c in self.canaries for _ in range(c.repetitions)]
        for col in dataset.column_names:
            if col not in rows:
                rows[col] = list(texts) if col == text_column else [None] * n
        extra = datasets.Dataset.from_dict({c: rows[c] for c in dataset.column_names}, features=dataset.features)
        return datasets.concatenate_datasets([dataset, extra])

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable description (to store next to a run and re-score it later)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CanarySet:
        """Inverse of :meth:`to_dict`."""
        d = dict(d)
        d["canaries"] = [Canary(tuple(c["prefix_ids"]), tuple(c["secret_ids"]), int(c["repetitions"]), c.get("text"))
                         for c in d["canaries"]]
        for k in ("subvocab_ids", "bos_ids", "eos_ids"):
            d[k] = tuple(d.get(k) or ())
        if d.get("subvocab_words") is not None:
            d["subvocab_words"] = tuple(d["subvocab_words"])
        return cls(**d)


# ----------------------------------------------------------------------------------------------------------------------
# Construction
# ----------------------------------------------------------------------------------------------------------------------
def _word_tokens(tokenizer: Any, min_chars: int = 3) -> list[tuple[int, str]]:
    """Token ids that are whole lower-case ASCII words which tokenize back to exactly that one token after a space."""
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    decoded = tokenizer.batch_decode([[i] for i in ids])
    cand = [(i, s.strip()) for i, s in zip(ids, decoded)]
    cand = [(i, w) for i, w in cand if len(w) >= min_chars and w.isascii() and w.isalpha() and w.islower()]
    if not cand:
        return []
    enc = tokenizer([" " + w for _, w in cand], add_special_tokens=False)["input_ids"]
    return [(i, w) for (i, w), e in zip(cand, enc) if list(e) == [i]]


def _find(haystack: Sequence[int], needle: Sequence[int]) -> int:
    n = len(needle)
    for start in range(len(haystack) - n + 1):
        if list(haystack[start:start + n]) == list(needle):
            return start
    return -1


def make_canaries(
    tokenizer: Any = None,
    *,
    repetitions: Sequence[int] = (0, 1, 10, 100),
    canaries_per_repetition: int = 1,
    subvocab: int | Sequence[str] | Sequence[int] = 10,
    secret_length: int = 5,
    prefix: str | Sequence[int | None] = "the secret of {} {} is",
    bos_ids: Sequence[int] | None = None,
    eos_ids: Sequence[int] | None = None,
    pad_token_id: int | None = None,
    seed: int = 0,
) -> CanarySet:
    """Build secret-sharer canaries (Carlini et al. 2019; the format of Li et al. 2022, App. M).

    Args:
        tokenizer: a Hugging Face tokenizer, or ``None`` to work on token ids directly (then ``subvocab`` must be a
            list of ids and ``prefix`` a list of ids with ``None`` marking a ``<word>`` slot).
        repetitions: one entry per group of canaries; ``canaries_per_repetition`` canaries are inserted ``r`` times each
            (``r = 0``: a control canary that is built and scored but never inserted).
        subvocab: the sub-vocabulary of secrets: an int ``V`` (sample ``V`` single-token lower-case words of the
            tokenizer's vocabulary, as Li et al. sample ``V = 10`` GPT-2 words), or explicit words / token ids.
        secret_length: ``l``, the number of sub-vocabulary tokens in a secret; ``|R| = V^l``.
        prefix: the format before the secret. ``{}`` (text) or ``None`` (ids) slots are filled per canary with
            sub-vocabulary words, distinct across canaries when there are enough combinations, so canaries do not share
            a context. The canary's text is ``prefix + " " + " ".join(secret words)``.
        bos_ids, eos_ids: tokens around ``prefix + secret`` in an inserted row. Default: what the tokenizer adds with
            ``add_special_tokens=True`` (e.g. ``[CLS]``/``[SEP]``; nothing for GPT-2); ``()`` without a tokenizer.
            Pass ``eos_ids=[tok.eos_token_id]`` if your training rows end with EOS.
        pad_token_id: padding for :meth:`CanarySet.insert_into` (default: the tokenizer's).
        seed: seeds the sub-vocabulary, the slots and the secrets (``numpy`` generator).

    Every canary's text is checked to tokenize to exactly ``prefix_ids + secret_ids``, so inserting the text into an
    untokenized corpus and inserting the ids are equivalent.
    """
    rng = np.random.default_rng(seed)
    if secret_length < 1:
        raise ValueError("secret_length must be at least 1.")
    words: list[str] | None = None
    if tokenizer is None:
        if isinstance(subvocab, int) or any(not isinstance(t, (int, np.integer)) for t in subvocab):
            raise ValueError("Without a tokenizer, subvocab must be a list of token ids.")
        if isinstance(prefix, str):
            raise ValueError("Without a tokenizer, prefix must be a list of token ids (None marks a <word> slot).")
        sub_ids = [int(t) for t in subvocab]
    else:
        if not isinstance(prefix, str):
            raise ValueError("With a tokenizer, prefix must be a string ({} marks a <word> slot).")
        if isinstance(subvocab, int):
            pool = _word_tokens(tokenizer)
            if len(pool) < subvocab:
                raise ValueError(f"The tokenizer has only {len(pool)} single-token words; asked for {subvocab}.")
            picked = sorted(rng.choice(len(pool), size=subvocab, replace=False).tolist())
            sub_ids = [pool[k][0] for k in picked]
            words = [pool[k][1] for k in picked]
        else:
            words = [str(w) for w in subvocab]
            sub_ids = []
            for w in words:
                ids = tokenizer(" " + w, add_special_tokens=False)["input_ids"]
                if len(ids) != 1:
                    raise ValueError(f"Sub-vocabulary word {w!r} is not a single token ({ids}).")
                sub_ids.append(int(ids[0]))
    if len(set(sub_ids)) != len(sub_ids) or len(sub_ids) < 2:
        raise ValueError("The sub-vocabulary needs at least 2 distinct tokens.")
    v = len(sub_ids)

    n_slots = prefix.count("{}") if isinstance(prefix, str) else sum(t is None for t in prefix)
    specs = [r for r in repetitions for _ in range(canaries_per_repetition)]
    if any(r < 0 for r in specs):
        raise ValueError("repetitions must be >= 0.")
    n = len(specs)
    # Distinct slot fillings (contexts) when possible, distinct secrets always.
    if n_slots and v**n_slots >= n:
        combos = rng.choice(v**n_slots, size=n, replace=False)
        slots = [[int(c) // v**k % v for k in range(n_slots)] for c in combos]
    else:
        slots = rng.integers(0, v, size=(n, n_slots)).tolist()
    if v**secret_length < n:
        raise ValueError(f"The candidate space V^l = {v**secret_length} is smaller than the number of canaries {n}.")
    secret_codes = rng.choice(v**secret_length, size=n, replace=False) if v**secret_length <= 2**62 else None
    canaries: list[Canary] = []
    bos_out: tuple[int, ...] | None = None if tokenizer is not None else tuple(bos_ids or ())
    eos_out: tuple[int, ...] | None = None if tokenizer is not None else tuple(eos_ids or ())
    for k, r in enumerate(specs):
        if secret_codes is not None:
            code = int(secret_codes[k])
            secret_idx = [code // v**j % v for j in range(secret_length)]
        else:  # pragma: no cover - astronomically large spaces
            secret_idx = rng.integers(0, v, size=secret_length).tolist()
        secret = tuple(sub_ids[j] for j in secret_idx)
        if tokenizer is None:
            it = iter(slots[k])
            prefix_ids = tuple(sub_ids[next(it)] if t is None else int(t) for t in prefix)
            canaries.append(Canary(prefix_ids, secret, int(r), None))
            continue
        assert words is not None and isinstance(prefix, str)
        prefix_text = prefix.format(*[words[j] for j in slots[k]])
        text = prefix_text + " " + " ".join(words[j] for j in secret_idx)
        prefix_ids = tuple(int(t) for t in tokenizer(prefix_text, add_special_tokens=False)["input_ids"])
        core = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if core != [*prefix_ids, *secret]:
            raise ValueError(
                f"The canary {text!r} does not tokenize as prefix + secret tokens ({core} vs "
                f"{[*prefix_ids, *secret]}); choose another prefix."
            )
        full = list(tokenizer(text, add_special_tokens=True)["input_ids"])
        start = _find(full, core)
        if start < 0:
            raise ValueError(f"Could not locate the canary tokens inside the tokenizer's output for {text!r}.")
        b, e = tuple(full[:start]), tuple(full[start + len(core):])
        if bos_out is None:
            bos_out, eos_out = b, e
        canaries.append(Canary(prefix_ids, secret, int(r), text))
    if tokenizer is not None:
        bos_out = tuple(bos_ids) if bos_ids is not None else bos_out
        eos_out = tuple(eos_ids) if eos_ids is not None else eos_out
        if pad_token_id is None:
            pad_token_id = tokenizer.pad_token_id
    if not bos_out and not any(c.prefix_ids for c in canaries):
        raise ValueError("A canary needs at least one token before the secret (a prefix or a BOS token).")
    return CanarySet(canaries=canaries, subvocab_ids=tuple(sub_ids), secret_length=secret_length,
                     bos_ids=tuple(bos_out or ()), eos_ids=tuple(eos_out or ()), pad_token_id=pad_token_id, seed=seed,
                     subvocab_words=tuple(words) if words is not None else None)


# ----------------------------------------------------------------------------------------------------------------------
# Scoring
# ----------------------------------------------------------------------------------------------------------------------
def _device(model: torch.nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover
        return torch.device("cpu")


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


@torch.no_grad()
def _score_heads(model: torch.nn.Module, context: Sequence[int], heads: torch.Tensor, subvocab: torch.Tensor,
                 batch_size: int) -> torch.Tensor:
    """Log-perplexities (bits) of the secrets ``head + [w]`` for every head (rows) and every ``w`` in the sub-vocab.

    ``heads`` is ``[M, l − 1]`` (``l − 1`` may be 0). Returns ``[M, V]`` in float64. Only the last ``l`` positions'
    logits are needed (``logits_to_keep`` when the model accepts it); normalisers are computed in float32.
    """
    device = _device(model)
    c = len(context)
    m, h = heads.shape
    ctx = torch.tensor(list(context), dtype=torch.long)
    sub = subvocab.to(device)
    keep = {"logits_to_keep": h + 1} if _accepts_logits_to_keep(model) else {}
    out = []
    for start in range(0, m, batch_size):
        part = heads[start:start + batch_size]
        ids = torch.cat([ctx.expand(part.shape[0], c), part], dim=1).to(device)
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **keep).logits
        lg = logits[:, -(h + 1):].float()  # positions c-1 .. c+h-1 predict the secret tokens c .. c+h
        lse = torch.logsumexp(lg, dim=-1).double()
        lp = -(lg[:, h][:, sub].double() - lse[:, h:h + 1])  # the last secret token, all V choices
        if h:
            head = lg[:, :h].gather(-1, ids[:, c:].unsqueeze(-1)).squeeze(-1).double() - lse[:, :h]
            lp = lp - head.sum(-1, keepdim=True)
        out.append((lp / _LN2).cpu())
    return torch.cat(out)


def exposure_from_rank(rank: int, space_size: int) -> float:
    """Carlini et al. 2019: exposure ``= log2 |R| − log2 rank`` (rank 1 = the most likely candidate)."""
    return math.log2(space_size) - math.log2(rank)


def exposure_by_distribution(canary_log_perplexity: float, reference_log_perplexities: Sequence[float] | np.ndarray,
                             method: str = "skewnorm") -> tuple[float, dict[str, Any]]:
    """Carlini et al. 2019, distribution modeling: exposure ≈ ``−log2 F(Px(canary))``, ``F`` fitted to non-inserted
    candidates.

    Args:
        canary_log_perplexity: ``Px`` of the inserted secret (bits).
        reference_log_perplexities: ``Px`` of many candidates that were *not* inserted.
        method: ``"skewnorm"`` (the paper's choice; maximum-likelihood fit with ``scipy.stats.skewnorm.fit``),
            ``"normal"``, or ``"empirical"`` (``−log2`` of the fraction of references at or below the canary, with
            ``+1`` smoothing: at most ``log2(n + 1)``).

    Returns ``(exposure, info)``; ``info`` has the fitted parameters and the method actually used (if the skew-normal
    log-CDF underflows in the far tail, the normal fit, whose log-CDF is accurate there, is used and said so).
    """
    ref = np.asarray(reference_log_perplexities, dtype=np.float64)
    x = float(canary_log_perplexity)
    if ref.size < 2:
        raise ValueError("The distribution model needs at least 2 reference candidates.")
    if method == "empirical":
        frac = (np.sum(ref <= x) + 1.0) / (ref.size + 1.0)
        return float(-math.log2(frac)), {"method": "empirical", "num_reference": int(ref.size)}
    mu, sd = float(ref.mean()), float(ref.std(ddof=1))
    sd = max(sd, 1e-12)
    normal_log_cdf = float(stats.norm.logcdf(x, loc=mu, scale=sd))
    if method == "normal":
        return -normal_log_cdf / _LN2, {"method": "normal", "loc": mu, "scale": sd, "num_reference": int(ref.size)}
    if method != "skewnorm":
        raise ValueError(f"Unknown method {method!r}: use 'skewnorm', 'normal' or 'empirical'.")
    a, loc, scale = stats.skewnorm.fit(ref)
    log_cdf = float(stats.skewnorm.logcdf(x, a, loc=loc, scale=scale))
    info = {"method": "skewnorm", "a": float(a), "loc": float(loc), "scale": float(scale),
            "num_reference": int(ref.size)}
    if not np.isfinite(log_cdf):
        info.update(method="normal (skew-normal log-CDF underflowed)", loc=mu, scale=sd)
        log_cdf = normal_log_cdf
    return max(-log_cdf / _LN2, 0.0), info


def _all_heads(v: int, h: int) -> torch.Tensor:
    if h == 0:
        return torch.zeros((1, 0), dtype=torch.long)
    return torch.tensor(list(itertools.product(range(v), repeat=h)), dtype=torch.long)


def canary_exposure(
    model: torch.nn.Module,
    canaries: CanarySet,
    *,
    num_reference: int = 2000,
    exact: bool | None = None,
    max_exact_forwards: int = 4096,
    method: str = "skewnorm",
    batch_size: int = 256,
    seed: int = 0,
    max_fit_reference: int | None = 20000,
) -> dict[str, Any]:
    """Exposure of every canary under a causal LM (Carlini et al. 2019; the Li et al. 2022, App. M protocol).

    Args:
        model: any Hugging Face causal LM (``model(input_ids, attention_mask).logits`` of shape ``[B, T, vocab]``).
        canaries: the :class:`CanarySet` that was inserted.
        num_reference: non-inserted candidates per canary for the distribution model, when the space is not
            enumerated (sampled uniformly over the first ``l − 1`` secret tokens; each draw contributes all ``V``
            completions of the last token).
        exact: enumerate all ``V^l`` candidates for the exact rank (``None``: when ``V^(l−1) <= max_exact_forwards``).
            With the full space enumerated, the distribution model is fitted to all non-inserted candidates.
        method: distribution model, see :func:`exposure_by_distribution`.
        batch_size: sequences per forward pass.
        seed: seeds the reference candidates and the fit subsample.
        max_fit_reference: fit the distribution model to at most this many references (a seeded random subsample;
            the maximum-likelihood fit costs about 3 s per 10^5 points). ``None``: all.

    Returns a JSON-serialisable dict: ``canaries`` (per canary: ``repetitions``, ``log_perplexity`` in bits,
    ``exposure`` (distribution model), ``exposure_exact`` and ``rank`` (or ``None``), ``text``), ``by_repetitions``
    (mean/std/n per ``r``, as Li et al. 2022 Table 9), and the settings (``space_size``, ``max_exposure``, ``method``).
    The distribution-model estimate is not capped at ``log2 |R|`` (Li et al. report values above it too); the exact
    exposure is at most ``log2 |R|``.
    The model is put in eval mode for scoring and restored afterwards.
    """
    v, length = len(canaries.subvocab_ids), canaries.secret_length
    h = length - 1
    if exact is None:
        exact = v**h <= max_exact_forwards
    sub = torch.tensor(canaries.subvocab_ids, dtype=torch.long)
    index = {t: i for i, t in enumerate(canaries.subvocab_ids)}
    rng = np.random.default_rng(seed)
    was_training = model.training
    model.eval()
    rows = []
    try:
        inserted_by_context: dict[tuple[int, ...], set[tuple[int, ...]]] = {}
        for c in canaries:
            if c.repetitions > 0:
                inserted_by_context.setdefault(c.prefix_ids, set()).add(c.secret_ids)
        for c in canaries:
            context = canaries.context_ids(c)
            secret_idx = [index[t] for t in c.secret_ids]
            # secrets that must not serve as "non-inserted" references: this canary's and any inserted in this context
            excluded = {tuple(index[t] for t in s) for s in inserted_by_context.get(c.prefix_ids, set())}
            excluded.add(tuple(secret_idx))
            rank = None
            if exact:
                heads = _all_heads(v, h)
                scores = _score_heads(model, context, sub[heads], sub, batch_size).numpy()
                flat = scores.reshape(-1)  # row-major: secret (i_0, ..., i_h) is at index sum_j i_j v^(h - j)
                codes = np.array([sum(i * v ** (h - j) for j, i in enumerate(s)) for s in excluded])
                own = float(flat[sum(i * v ** (h - j) for j, i in enumerate(secret_idx))])
                rank = int(np.sum(flat < own)) + 1
                keep = np.ones(flat.size, dtype=bool)
                keep[codes] = False
                reference = flat[keep]
            else:
                own_head = torch.tensor([secret_idx[:h]], dtype=torch.long)
                own = float(_score_heads(model, context, sub[own_head], sub, batch_size)[0, secret_idx[-1]])
                draws = max(1, math.ceil(num_reference / v))
                heads = torch.from_numpy(rng.integers(0, v, size=(draws, h))).long()
                scores = _score_heads(model, context, sub[heads], sub, batch_size).numpy()
                keep = np.ones(scores.shape, dtype=bool)
                for s in excluded:
                    match = (heads.numpy() == np.array(s[:h])).all(axis=1) if h else np.ones(draws, dtype=bool)
                    keep[match, s[-1]] = False
                reference = scores[keep]
            fit_ref = reference
            if max_fit_reference is not None and reference.size > max_fit_reference:
                fit_ref = rng.choice(reference, size=max_fit_reference, replace=False)
            exposure, info = exposure_by_distribution(own, fit_ref, method)
            rows.append({
                "repetitions": c.repetitions,
                "log_perplexity": own,
                "exposure": exposure,
                "exposure_exact": exposure_from_rank(rank, canaries.space_size) if rank is not None else None,
                "rank": rank,
                "num_reference": int(reference.size),
                "fit": info,
                "text": c.text,
            })
    finally:
        model.train(was_training)
    return {
        "method": method,
        "space_size": canaries.space_size,
        "max_exposure": canaries.max_exposure,
        "subvocab_size": v,
        "secret_length": length,
        "exact": bool(exact),
        "canaries": rows,
        "by_repetitions": summarize_exposures(rows),
    }


def summarize_exposures(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Mean ± std (``ddof=1``; 0 for one canary) of the exposures per repetition count, keyed by ``str(r)``."""
    out: dict[str, dict[str, Any]] = {}
    for r in sorted({int(row["repetitions"]) for row in rows}):
        group = [row for row in rows if int(row["repetitions"]) == r]
        fit = np.array([row["exposure"] for row in group], dtype=np.float64)
        entry: dict[str, Any] = {"n": len(group), "mean": float(fit.mean()),
                                 "std": float(fit.std(ddof=1)) if len(group) > 1 else 0.0}
        exact = [row["exposure_exact"] for row in group if row.get("exposure_exact") is not None]
        if len(exact) == len(group):
            ex = np.array(exact, dtype=np.float64)
            entry.update(mean_exact=float(ex.mean()), std_exact=float(ex.std(ddof=1)) if len(ex) > 1 else 0.0)
        out[str(r)] = entry
    return out
