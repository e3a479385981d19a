import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

# Tiny test models run far faster on one thread (thread start-up dominates, especially on a loaded machine).
torch.set_num_threads(1)
