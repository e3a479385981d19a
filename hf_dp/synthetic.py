"""DP synthetic text: sample from a DP-fine-tuned causal LM, publish the samples with the generator's guarantee.

Yu et al. 2024, "Training Private and Efficient Language Models with Synthetic Data from LLMs"
(``/work/shared/papers/003_06dc38a508f7695a.txt``): DP-fine-tune a large causal LM on the private data (LoRA, DP-Adam,
PRV accounting; §3.1, App. A), generate synthetic texts from it by *unconditional* top-k sampling (top-k = 50, 200 or
∞; §4 and App. C find that top-k = ∞ hurts after DP fine-tuning), then train small models on the synthetic texts with
ordinary optimizers. Sampling only reads the DP model's parameters, so by the post-processing property of DP the
synthetic data set is (ε, δ)-DP with the generator's (ε, δ), however many texts are drawn (§1, §2).

* :func:`generate_synthetic_dataset` — batched ``model.generate`` (top-k / top-p / temperature), unconditional
  (from the start token) or from a prompt / list of prompts, a tqdm progress bar, reproducible by ``seed``; returns a
  :class:`datasets.Dataset` whose ``info.description`` records the sampling settings and the privacy record.
* :func:`write_dataset_card` — the data set's ``README.md`` (``huggingface_hub.DatasetCard``, template
  ``hf_dp/templates/dp_dataset_card.md``) whose ``differential_privacy`` metadata is the generator's record
  (:func:`hf_dp.cards.privacy_metadata` of its :class:`~hf_dp.record.PrivacyRecord`), unchanged, plus the sampling
  settings (``synthetic_data``).

Nothing here reads the private training data: given a ``DPTrainer`` as ``privacy``, only its accountant and settings
are read (N comes from ``len(train_dataset)``; no row is ever accessed). Prompts are published with the data and are
not protected: they must not come from the private data.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import datasets
import torch
from huggingface_hub import DatasetCard, DatasetCardData
from tqdm.auto import tqdm

from . import cards
from .record import PrivacyRecord, plain

__all__ = [
    "generate_synthetic_dataset",
    "resolve_privacy",
    "save_synthetic_dataset",
    "synthetic_info",
    "write_dataset_card",
]

_INFO_KEY = "hf_dp_synthetic"
_SEED_STRIDE = 1_000_003  # per-batch seeds seed * stride + batch index: batches do not depend on num_samples


def resolve_privacy(privacy: Any) -> dict[str, Any] | None:
    """The ``differential_privacy`` record from a record, a ``DPTrainer``, a ``dp_state.json`` or a model card.

    Args:
        privacy: ``None``; a mapping (a ``differential_privacy`` record, validated); a
            :class:`~hf_dp.record.PrivacyRecord`, or an object with a ``privacy_record()`` method (a ``DPTrainer``),
            read with :func:`hf_dp.cards.privacy_metadata` (no training example is read); a path to the generator's
            ``dp_state.json``; or a path to its model card or saved model directory
            (:func:`hf_dp.cards.privacy_report`).

    Raises:
        ValueError: For a malformed record or a card without privacy metadata.
        TypeError: For anything else.
    """
    if privacy is None:
        return None
    if isinstance(privacy, Mapping):
        problems = cards.record_problems(privacy)
        if problems:
            raise ValueError("Invalid differential_privacy record:\n  - " + "\n  - ".join(problems))
        return dict(privacy)
    if isinstance(privacy, PrivacyRecord):
        return cards.privacy_metadata(privacy)
    if callable(getattr(privacy, "privacy_record", None)):
        return cards.privacy_metadata(privacy.privacy_record())
    if isinstance(privacy, (str, os.PathLike)):
        if os.fspath(privacy).endswith(".json"):
            return cards.privacy_metadata(PrivacyRecord.load(privacy))
        return cards.privacy_report(privacy)
    raise TypeError(f"privacy must be a differential_privacy record, a PrivacyRecord, a DPTrainer or a card path, "
                    f"got {type(privacy)}.")


def _start_token_id(tokenizer: Any) -> int:
    for name in ("bos_token_id", "cls_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    raise ValueError("The tokenizer has no bos/cls/eos token to start unconditional generation from; pass a prompt.")


def _prompts(prompt: str | Sequence[str] | None, num_samples: int) -> list[str] | None:
    if prompt is None:
        return None
    if isinstance(prompt, str):
        return [prompt] * num_samples
    prompt = list(prompt)
    if not prompt or not all(isinstance(p, str) for p in prompt):
        raise ValueError("prompt must be None, a string or a non-empty list of strings.")
    return [prompt[i % len(prompt)] for i in range(num_samples)]  # cycled: sample i uses prompt i mod len


def _model_name(model: Any) -> str | None:
    base = getattr(model, "get_base_model", None)
    config = getattr(base() if callable(base) else model, "config", None)
    name = getattr(config, "_name_or_path", None)
    if not name or os.path.isabs(name) or os.path.isdir(name):
        return None  # a local path is not a public name (and would be published on the card)
    return name


def synthetic_info(dataset: datasets.Dataset) -> dict[str, Any]:
    """``{"differential_privacy": record or None, "sampling": settings}`` stored by :func:`generate_synthetic_dataset`.

    Raises:
        ValueError: If the data set was not produced by :func:`generate_synthetic_dataset`.
    """
    try:
        info = json.loads(dataset.info.description or "")[_INFO_KEY]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError("This data set carries no hf_dp synthetic-data record (not made by "
                         "generate_synthetic_dataset, or its info was replaced).") from err
    return info


@torch.no_grad()
def generate_synthetic_dataset(
    model: torch.nn.Module,
    tokenizer: Any,
    num_samples: int,
    prompt: str | Sequence[str] | None = None,
    *,
    max_new_tokens: int = 64,
    top_k: int | None = 50,
    top_p: float | None = 1.0,
    temperature: float = 1.0,
    batch_size: int = 32,
    seed: int = 0,
    privacy: Any = None,
    text_column: str = "text",
    progress: bool = True,
    **generate_kwargs: Any,
) -> datasets.Dataset:
    """Samples ``num_samples`` texts from a (DP-fine-tuned) causal LM, in batches, reproducibly.

    Unconditional generation (``prompt=None``, as in Yu et al. 2024) starts every sample from the tokenizer's start
    token (bos, else cls, else eos). With a prompt, the input is the start token followed by the prompt's tokens
    (``add_special_tokens=False``); a list of prompts is cycled over the samples; prompts are left-padded and only the
    newly generated tokens are returned. Generation stops at the eos token or after ``max_new_tokens``.

    Sample ``i`` depends only on (``seed``, ``batch_size``, ``i``) and the settings: each batch is drawn under its own
    seed inside ``torch.random.fork_rng``, so the caller's global RNG state is left untouched.

    Args:
        model: A causal LM (``transformers`` model or ``peft`` model; full or LoRA fine-tuned).
        tokenizer: Its tokenizer.
        num_samples: Number of texts.
        prompt: ``None`` (unconditional), one prompt, or a list of prompts (public text: prompts are not protected).
        max_new_tokens: Maximum generated tokens per text.
        top_k: Top-k sampling (Yu et al. use 50 or 200); ``None`` or 0 disables it (top-k = ∞).
        top_p: Nucleus sampling threshold; ``None`` or 1.0 disables it.
        temperature: Softmax temperature (> 0).
        batch_size: Texts per ``generate`` call.
        seed: Seed of the sampling (not a privacy parameter: sampling is post-processing).
        privacy: The generator's guarantee (see :func:`resolve_privacy`): a record, the ``DPTrainer`` that trained
            the model, or its model card / directory. Stored with the data and put on its card.
        text_column: Name of the text column.
        progress: Show a tqdm progress bar.
        **generate_kwargs: Passed to ``model.generate`` (e.g. ``repetition_penalty``, ``min_new_tokens``).

    Returns:
        A ``datasets.Dataset`` with ``text_column`` (and ``prompt`` when prompts are used); ``synthetic_info(ds)``
        gives the sampling settings and the privacy record.
    """
    if not (isinstance(num_samples, int) and num_samples > 0):
        raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}.")
    if not (isinstance(batch_size, int) and batch_size > 0):
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}.")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 or None: no top-k), got {top_k}.")
    record = resolve_privacy(privacy)
    prompts = _prompts(prompt, num_samples)
    start_id = _start_token_id(tokenizer)
    eos_id = getattr(tokenizer, "eos_token_id", None)
    if eos_id is None:
        eos_id = getattr(tokenizer, "sep_token_id", None)
    pad_id = getattr(tokenizer, "pad_token_id", None)
    if pad_id is None:
        pad_id = eos_id if eos_id is not None else start_id
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    texts: list[str] = []
    try:
        with tqdm(total=num_samples, desc="synthetic samples", unit="text", disable=not progress) as bar:
            for b, start in enumerate(range(0, num_samples, batch_size)):
                n = min(batch_size, num_samples - start)
                if prompts is None:
                    rows = [[start_id]] * batch_size
                else:
                    rows = [[start_id] + tokenizer(p, add_special_tokens=False)["input_ids"]
                            for p in prompts[start:start + n]]
                    rows += [rows[-1]] * (batch_size - n)  # a full batch always: sample i depends on i, not on N
                width = max(len(r) for r in rows)
                input_ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], device=device)
                attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
                fork_devices = [device.index or 0] if device.type == "cuda" else []
                with torch.random.fork_rng(devices=fork_devices):
                    torch.manual_seed(seed * _SEED_STRIDE + b)
                    out = model.generate(
                        input_ids=input_ids, attention_mask=attention_mask, do_sample=True,
                        top_k=top_k or 0, top_p=1.0 if top_p is None else top_p, temperature=temperature,
                        max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=eos_id, **generate_kwargs,
                    )
                for row in out[:n, width:].tolist():
                    if eos_id is not None and eos_id in row:
                        row = row[:row.index(eos_id)]
                    texts.append(tokenizer.decode(row, skip_special_tokens=True).strip())
                bar.update(n)
    finally:
        model.train(was_training)

    sampling = {
        "method": "sampling from the DP model (model.generate, do_sample=True)",
        "num_samples": num_samples,
        "prompt": prompt if prompt is None or isinstance(prompt, str) else list(prompt),
        "max_new_tokens": max_new_tokens,
        "top_k": top_k if top_k else None,
        "top_p": top_p,
        "temperature": temperature,
        "batch_size": batch_size,
        "seed": seed,
        "generator": _model_name(model),
        "generator_class": type(model).__name__,
        "start_token_id": start_id,
        "extra_generate_kwargs": plain(generate_kwargs) or None,
    }
    columns: dict[str, list[Any]] = {text_column: texts}
    if prompts is not None:
        columns["prompt"] = prompts
    description = json.dumps({_INFO_KEY: {"differential_privacy": record, "sampling": sampling}})
    return datasets.Dataset.from_dict(columns, info=datasets.DatasetInfo(description=description))


def _size_category(n: int) -> str:
    bounds = [(1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"), (1_000_000, "100K<n<1M"),
              (10_000_000, "1M<n<10M")]
    for bound, label in bounds:
        if n < bound:
            return label
    return "n>1T" if n > 10**12 else "10M<n<100M"


def write_dataset_card(dataset_dir: str | os.PathLike, privacy_metadata: Any, sampling_settings: Mapping[str, Any],
                       *, pretty_name: str | None = None, license: str | None = None,
                       language: str | Sequence[str] | None = None,
                       tags: Sequence[str] | None = None) -> DatasetCard:
    """Writes ``dataset_dir/README.md``: a dataset card carrying the generator's ``differential_privacy`` record.

    Sampling from a DP model is post-processing, so the record (same ε, δ, mechanism, privacy unit) is copied
    unchanged; the sampling settings go to the ``synthetic_data`` metadata and the card body. An existing README
    not written by hf_dp is merged, not overwritten. The card is validated before it is written.

    Args:
        dataset_dir: Directory of the synthetic data set (created if needed).
        privacy_metadata: The generator's record, the ``DPTrainer`` that trained it, or its model card / directory
            (see :func:`resolve_privacy`). Required: a synthetic data set without a guarantee gets no DP card.
        sampling_settings: The settings of :func:`generate_synthetic_dataset` (``synthetic_info(ds)["sampling"]``).
        pretty_name, license, language, tags: Dataset card metadata.

    Returns:
        The card written.

    Raises:
        ValueError: If ``privacy_metadata`` is missing or malformed.
    """
    dp = resolve_privacy(privacy_metadata)
    if dp is None:
        raise ValueError("write_dataset_card needs the generator's differential_privacy record (or its DPTrainer / "
                         "model card): without it the data set has no stated guarantee.")
    sampling = plain(dict(sampling_settings))
    num_samples = sampling.get("num_samples")
    out = Path(dataset_dir)
    out.mkdir(parents=True, exist_ok=True)
    if pretty_name is None:
        pretty_name = out.resolve().name or "DP synthetic text"
    synthetic = {"post_processing": True, **sampling}
    card_data = DatasetCardData(
        pretty_name=pretty_name,
        license=license,
        language=language,
        task_categories=["text-generation"],
        size_categories=[_size_category(int(num_samples))] if isinstance(num_samples, int) else None,
        tags=cards.merge_tags(["synthetic", "differential-privacy", "hf_dp"], tags),
        differential_privacy=dp,
        synthetic_data=synthetic,
    )
    rows = []
    for key, value in sampling.items():
        if key == "top_k" and value is None:
            value = "none (∞)"
        elif value is None:
            value = "—"
        elif isinstance(value, list):
            value = "; ".join(map(str, value[:5])) + (f"; ... ({len(value)} prompts)" if len(value) > 5 else "")
        rows.append((key, str(value).replace("|", "\\|").replace("\n", " ")))
    template_kwargs = cards.common_template_kwargs(dp)
    template_kwargs.update(pretty_name=pretty_name, num_samples=num_samples if num_samples is not None else "The",
                           generator=sampling.get("generator"), sampling_rows=rows)
    card = DatasetCard.from_template(card_data, template_str=cards.card_template(cards.DATASET_CARD_TEMPLATE),
                                     **template_kwargs)
    explicit = [k for k, v in (("license", license), ("language", language), ("pretty_name", pretty_name)) if v]
    explicit += ["synthetic_data", "size_categories", "task_categories"]
    return cards.write_card(out / "README.md", card, explicit)


def save_synthetic_dataset(dataset: datasets.Dataset, dataset_dir: str | os.PathLike, **card_kwargs: Any) -> Path:
    """Saves a data set from :func:`generate_synthetic_dataset` as ``data/train.jsonl`` plus its card.

    Args:
        dataset: The synthetic data set (its ``synthetic_info`` must hold a privacy record).
        dataset_dir: Target directory (a Hub-style dataset repo layout).
        **card_kwargs: Passed to :func:`write_dataset_card` (``pretty_name``, ``license``, ...).

    Returns:
        The directory.
    """
    info = synthetic_info(dataset)
    out = Path(dataset_dir)
    (out / "data").mkdir(parents=True, exist_ok=True)
    dataset.to_json(str(out / "data" / "train.jsonl"), lines=True, force_ascii=False)
    write_dataset_card(out, info["differential_privacy"], info["sampling"], **card_kwargs)
    return out

