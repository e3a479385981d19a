import gc
import os
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(__file__))  # the shared testing module: `from helpers import ...`

import torch  # noqa: E402

# Tiny test models run far faster on one thread (thread start-up dominates, especially on a loaded machine).
torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="module")
def _fast_gc():
    """Every ``Trainer.train()`` starts with accelerate's ``free_memory()``, a full ``gc.collect()`` over everything
    the imports created (torch, transformers, trl, ...: ~0.5-1 s each time). At the start of each test module the
    garbage is collected once and what is alive then (imports, caches) is frozen, so those collections only scan the
    objects the tests create (~0.05 s). Nothing is unfrozen before the session ends: a later module's freeze would
    otherwise be undone."""
    gc.collect()
    gc.freeze()
    yield
