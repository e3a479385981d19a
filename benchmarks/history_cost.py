"""Cost of the model's privacy history (hf_dp/history.py) and of the grouped-rows check (hf_dp/units.py), issue 22.

Per step the trainer updates its live run entry (``ModelHistory.update``) twice; at train start and end it writes the
history onto every config and parameter (``ModelHistory.tag``); at construction it reads it
(``read_privacy_history``) and checks the rows once (``looks_grouped``, 256 sampled rows). Run::

    PYTHONPATH=. python benchmarks/history_cost.py
"""

import time

from datasets import Dataset
from transformers import GPT2Config, GPT2LMHeadModel

from hf_dp.accounting import PrivacyAccountant
from hf_dp.history import ModelHistory, read_privacy_history
from hf_dp.units import looks_grouped


def main() -> None:
    model = GPT2LMHeadModel(GPT2Config())  # GPT-2 small: 124 M parameters, 148 tensors
    history = ModelHistory.of_model(model)
    acc = PrivacyAccountant()
    acc.step(1.0, 0.01, 500)
    start = time.perf_counter()
    for _ in range(1000):
        history.update(acc.history, delta=1e-5, privacy_unit="example", num_examples=1000)
    print(f"update (every step, x2):      {(time.perf_counter() - start):.4f} ms per call")
    start = time.perf_counter()
    for _ in range(20):
        history.tag(model)
    n = len(list(model.parameters()))
    print(f"tag (train start and end):    {(time.perf_counter() - start) / 20 * 1e3:.3f} ms ({n} tensors)")
    start = time.perf_counter()
    for _ in range(20):
        read_privacy_history(model)
    print(f"read (construction, train()): {(time.perf_counter() - start) / 20 * 1e3:.3f} ms")
    rows = [[1] * 1024] * 5000
    data = Dataset.from_dict({"input_ids": rows, "attention_mask": rows, "labels": rows})
    start = time.perf_counter()
    length = looks_grouped(data)
    print(f"looks_grouped (once), 5000 x 1024-token rows: {(time.perf_counter() - start) * 1e3:.1f} ms -> {length}")


if __name__ == "__main__":
    main()
