"""examples/dp_synthetic_data.py end to end with tiny settings: DP generator → synthetic data → small model."""

from __future__ import annotations

import json
import math

import torch
from helpers import load_example


def test_default_pipeline_runs_with_tiny_settings(tmp_path):
    script = load_example("dp_synthetic_data.py")
    args = script.SyntheticDataArguments(
        output_dir=str(tmp_path / "out"), cache_dir=str(tmp_path / "cache"), num_private=64, num_test=16,
        max_length=24, dp_batch_size=16, dp_epochs=1.0, generator_layers=1, generator_dim=16,
        generator_pretrain_steps=2, num_synthetic=16, small_dim=16, small_pretrain_steps=2, small_epochs=1.0,
    )
    threads = torch.get_num_threads()
    try:
        results = script.main(args)
    finally:
        torch.set_num_threads(threads)
    rows = results["rows"]
    trained_on = [(r["model"], r["trained on"]) for r in rows]
    for row in [("generator", "public text only"), ("generator", "real private data"), ("small", "public text only"),
                ("small", "real private data"), ("small", "synthetic data (non-private training)")]:
        assert row in trained_on, trained_on
    synthetic_row = next(r for r in rows if r["trained on"].startswith("synthetic"))
    assert "DP via generator" in synthetic_row["privacy"]
    assert 0 < results["epsilon"] <= 8.0 and results["delta"] == 1e-5
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in rows)
    out = tmp_path / "out"
    dataset_card = (out / "synthetic" / "README.md").read_text()
    assert "differential_privacy" in dataset_card and "top_k" in dataset_card
    assert "differential_privacy" in (out / "generator" / "README.md").read_text()
    saved = json.loads((out / "results.json").read_text())
    assert math.isclose(saved["epsilon"], results["epsilon"]) and len(saved["synthetic_examples"]) > 0
