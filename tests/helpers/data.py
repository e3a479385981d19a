"""Small datasets (token, classification, seq2seq, causal LM, images, users), map-style rows of tensors, the
repository's paths, and the example scripts loaded as modules."""

from __future__ import annotations

from pathlib import Path

import torch
from datasets import Dataset
from torch.utils.data import Dataset as TorchDataset

from .models import VOCAB

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
SCRIPTS = REPO / "tests" / "scripts"


def token_dataset(n: int, num_labels: int, seq_len: int = 8, seed: int = 0) -> Dataset:
    """Token-level labels (-100 on padding and on a random half of tokens, like MLM masking)."""
    g = torch.Generator().manual_seed(seed)
    rows = {"input_ids": [], "attention_mask": [], "labels": []}
    for _ in range(n):
        length = int(torch.randint(3, seq_len + 1, (1,), generator=g))
        ids = torch.randint(2, VOCAB, (length,), generator=g).tolist()
        labels = [int(torch.randint(0, num_labels, (1,), generator=g)) if torch.rand(1, generator=g) < 0.5 else -100
                  for _ in ids]
        labels[0] = int(torch.randint(0, num_labels, (1,), generator=g))  # at least one labelled token
        pad = seq_len - length
        rows["input_ids"].append(ids + [0] * pad)
        rows["attention_mask"].append([1] * length + [0] * pad)
        rows["labels"].append(labels + [-100] * pad)
    return Dataset.from_dict(rows)


def seq2seq_dataset(n: int, seed: int = 0) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    rows = {"input_ids": [], "attention_mask": [], "labels": []}
    for _ in range(n):
        src = torch.randint(2, VOCAB, (6,), generator=g).tolist()
        length = int(torch.randint(2, 6, (1,), generator=g))
        tgt = torch.randint(2, VOCAB, (length,), generator=g).tolist() + [1]
        rows["input_ids"].append(src)
        rows["attention_mask"].append([1] * 6)
        rows["labels"].append(tgt + [-100] * (6 - len(tgt)))
    return Dataset.from_dict(rows)


def lm_dataset(n: int, seq_len: int = 10, seed: int = 0, pad_id: int = 0) -> Dataset:
    """Causal-LM examples of varying length, right-padded, labels -100 on padding."""
    g = torch.Generator().manual_seed(seed)
    rows = {"input_ids": [], "attention_mask": [], "labels": []}
    for _ in range(n):
        length = int(torch.randint(3, seq_len + 1, (1,), generator=g))
        ids = torch.randint(2, VOCAB, (length,), generator=g).tolist()
        pad = seq_len - length
        rows["input_ids"].append(ids + [pad_id] * pad)
        rows["attention_mask"].append([1] * length + [0] * pad)
        rows["labels"].append(ids + [-100] * pad)
    return Dataset.from_dict(rows)


def cls_dataset(n: int, num_labels: int, seq_len: int = 8, seed: int = 0, pad_id: int = 0) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    rows = {"input_ids": [], "attention_mask": [], "labels": []}
    for _ in range(n):
        length = int(torch.randint(3, seq_len + 1, (1,), generator=g))
        ids = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        pad = seq_len - length
        rows["input_ids"].append(ids + [pad_id] * pad)
        rows["attention_mask"].append([1] * length + [0] * pad)
        rows["labels"].append(int(torch.randint(0, num_labels, (1,), generator=g)))
    return Dataset.from_dict(rows)


class Rows(TorchDataset):
    """A map-style dataset of ready tensors (one example per row, no batch axis)."""

    def __init__(self, rows: list[dict[str, torch.Tensor]]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return dict(self.rows[i])


def decoder_data(n: int = 4) -> Dataset:
    """Causal-LM rows of up to 6 tokens (the zoo's decoders)."""
    return lm_dataset(n, seq_len=6)


def image_cls(n: int = 4, size: int = 8, labels: int = 3) -> list[dict[str, torch.Tensor]]:
    """Random float64 images (a list dataset: HF ``Dataset`` would hand back float32)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, size, size, generator=g, dtype=torch.float64)
    y = torch.randint(0, labels, (n,), generator=g)
    return [{"pixel_values": x[i], "labels": y[i]} for i in range(n)]


#: the author of each row of ``user_data``: 5 users, some with several rows
AUTHORS = ["ann", "bob", "bob", "cy", "ann", "dee", "bob", "eve", "ann", "cy", "bob", "dee"]


def user_data() -> Dataset:
    """Causal-LM rows with an ``author`` column (``AUTHORS``), for user-level DP."""
    data = lm_dataset(len(AUTHORS), seed=11)
    return data.add_column("author", AUTHORS)


def load_example(filename: str, name: str | None = None, folder: str = "examples"):
    """``examples/<filename>`` (or ``<folder>/<filename>``, e.g. ``benchmarks``) imported as a module (registered in
    ``sys.modules`` first: dataclasses resolve the module's annotations through it). The same module object on later
    calls with the same name."""
    import importlib.util
    import sys

    name = name or f"hf_dp_{folder.rstrip('s')}_" + filename.removesuffix(".py")
    if name in sys.modules:
        return sys.modules[name]
    path = EXAMPLES.parent / folder / filename
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def toy_rows(n: int, seq_len: int = 4) -> Rows:
    """Rows for ``helpers.Toy``: ``x`` (T, 3) float64, labels alternating 0 / 1."""
    g = torch.Generator().manual_seed(0)
    return Rows([{"x": torch.randn(seq_len, 3, generator=g, dtype=torch.float64), "labels": torch.tensor(i % 2)}
                 for i in range(n)])
