"""benchmarks/utility.py's last-iterate settings (issue 25, session 11): ``sched`` and ``ema`` join the run keys
without changing any earlier key, and a DP run with ``ema`` ends with its trainable weights set to the normalised
exponential moving average of the iterates — checked against the average written out from the recorded iterates,
with DPTrainer's released-state guard active (the swap is declared post-processing). And the optimizer of a key
(session 13): ``sgd`` trains with SGD (momentum 0.9), an unknown name is refused (it trained AdamW silently)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from helpers import load_example
from transformers import BertConfig, TrainerCallback

from hf_dp import DPTrainer, DPTrainingArguments

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "utility.py"


@pytest.fixture(scope="module")
def bench():
    return load_example("utility.py", "hf_dp_benchmark_utility", folder="benchmarks")


def test_keys_old_unchanged_new_round_trip_bad_refused(bench, tmp_path):
    old = "lora|8.0|clip|adam|head_lr=0.1|lr=0.01|batch=512|max_steps=32"
    assert bench.key(bench.parse_key(old)) == old
    new = old + "|sched=linear|ema=0.9"
    run = bench.parse_key(new)
    assert (run["sched"], run["ema"]) == ("linear", 0.9) and bench.key(run) == new
    assert bench.common_args(tmp_path, "lora", 0.01, 1.0, 0, run)["lr_scheduler_type"] == "linear"
    assert bench.common_args(tmp_path, "lora", 0.01, 1.0, 0, bench.parse_key(old))["lr_scheduler_type"] == "constant"
    assert bench.last_iterate_callbacks(bench.parse_key(old)) == []
    with pytest.raises(ValueError, match="constant is the default"):
        bench.parse_key(old + "|sched=constant")
    with pytest.raises(ValueError, match=r"ema is the moving average's decay, in \(0, 1\)"):
        bench.parse_key(old + "|ema=1")


class Iterates(TrainerCallback):
    def __init__(self) -> None:
        self.weights: list[torch.Tensor] = []

    def on_step_end(self, args, state, control, model=None, **kw):
        self.weights.append(model.classifier.weight.detach().clone().double())


def test_dp_run_ends_at_the_normalised_average_of_its_iterates(bench, tmp_path):
    config = BertConfig(hidden_size=4, num_labels=2, num_hidden_layers=1, num_attention_heads=1,
                        intermediate_size=4, vocab_size=8)
    torch.manual_seed(0)
    model = bench.FeatureClassifierForSequenceClassification(config)
    rows = bench.Rows([{"features": torch.randn(4), "labels": i % 2} for i in range(16)])
    ema, seen = bench.WeightEMA(0.5), Iterates()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, per_sample_max_grad_norm=1.0,
                                   per_device_train_batch_size=8, max_steps=3, learning_rate=0.1,
                                   lr_scheduler_type="constant", use_cpu=True, report_to="none", save_strategy="no",
                                   dp_seed=0, disable_tqdm=True, dp_self_check=False)
        trainer = DPTrainer(model=model, args=args, train_dataset=rows, data_collator=bench.collate,
                            callbacks=[ema, seen])
        trainer.train()
    w = seen.weights  # w_1, w_2, w_3 (the EMA's on_step_end and this one's see the same weights)
    assert len(w) == 3 and not torch.equal(w[1], w[2])
    expected = (0.25 * w[0] + 0.5 * w[1] + w[2]) / 1.75  # Σ d^(T−t) w_t / Σ d^(T−t), d = 0.5, T = 3
    torch.testing.assert_close(model.classifier.weight.detach().double(), expected, rtol=1e-6, atol=1e-7)


def test_sgd_key_trains_with_sgd_and_an_unknown_optimizer_is_refused(bench, tmp_path):
    config = BertConfig(hidden_size=4, num_labels=2, num_hidden_layers=1, num_attention_heads=1,
                        intermediate_size=4, vocab_size=8)
    g = torch.Generator().manual_seed(0)
    part = {"features": list(torch.randn(128, 4, generator=g)), "labels": [i % 2 for i in range(128)]}
    cache = {"config": config.to_dict(), "train": part, "test": part}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for key, optimizer in (("head|8.0|clip|sgd|lr=0.3|batch=64|max_steps=2", "SGD"),
                               ("head|inf|-|sgd|lr=0.3|batch=64|max_steps=2", "SGD"),
                               ("head|8.0|clip|adam|lr=0.3|batch=64|max_steps=2", "AdamW")):
            record = bench.run_one(cache, bench.parse_key(key), tmp_path / optimizer, 0, 1.0)
            assert record["optimizer"] == optimizer and set(record["optimizer_group_lrs"]) == {0.3}
        with pytest.raises(ValueError, match="unknown optim 'adamw'"):
            bench.run_one(cache, bench.parse_key("head|8.0|clip|adamw|lr=0.3"), tmp_path / "x", 0, 1.0)
