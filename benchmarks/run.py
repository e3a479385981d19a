#!/usr/bin/env python
"""Speed and memory of DP training against non-private training and Opacus, side by side (issue 4).

For one model shape, ONE process builds every method on identical initial weights and identical data, then runs
them interleaved (method order rotated every repeat) through their real training loops:

* ``nonprivate``          HF ``Trainer`` (model's own batch loss), ``trainer.train(max_steps=...)``;
* ``flat``, ``per_layer``, ``adaptive_per_layer``
                          ``hf_dp.DPTrainer`` with that ``clipping`` mode, ``trainer.train(max_steps=...)``;
* ``opacus_ghost``, ``opacus_hooks``
                          Opacus 1.6 ``PrivacyEngine.make_private(grad_sample_mode=...)`` on the same model, batches
                          and optimizer (AdamW), a plain loop (forward, per-sample loss, backward, DP optimizer step).

Step time = one optimizer step (forward + backward + clipping + noise + optimizer step + zero_grad), measured from
``on_step_begin`` to ``on_step_end`` of a ``TrainerCallback`` (the batch is already fetched), and around the same
work in the Opacus loop, by two clocks: wall time and the process's CPU time (with one intra-op thread, the CPU
default, the latter does not count time spent waiting for a core that other jobs hold). The first ``train()`` call
of each method starts with ``--warmup`` untimed steps; DPTrainer's runtime self-check (``dp_self_check``) runs at the
first step of that call only and is reported separately ("first step"). Batches have a fixed size
(``poisson_sampling=False`` for DPTrainer and Opacus) and fixed length (random tokens, no padding), so every method
does identical work per step.

Peak memory:
* CPU: one subprocess per method (``--child``). A ``TorchDispatchMode`` records the bytes of every live CPU tensor
  storage (created by an aten op, freed when its storage dies), i.e. what an allocator's "max allocated" would report:
  parameters, buffers, gradients, optimizer state, activations and temporaries. The peak over the measured steps is
  reported, together with the growth of the peak RSS over its value after model creation (coarser: includes
  allocator caching; ``VmHWM`` on Linux).
* GPU: ``torch.cuda.max_memory_allocated`` in the timing process (other methods' models offloaded to CPU), reset at
  the first measured step of each run; and a binary search for the largest batch each method fits (``--max-batch``,
  one subprocess per probe, GPU only).

``--profile`` times the phases of a step (hf_dp's functions wrapped in ``torch.profiler.record_function`` ranges,
benchmark-side) and prints torch.profiler op tables. GPT-2 shapes come tied (GPT-2's layout) or untied
(``--untied``; Opacus's ghost clipping refuses tied parameters).

Run ``python benchmarks/run.py --help``; the commands behind RESULTS.md are listed in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
import weakref
from dataclasses import asdict, dataclass, replace
from typing import Any

# Import this checkout's hf_dp when run as `python benchmarks/run.py` (the script's directory, not the repository root,
# is on sys.path then).
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

ALL_METHODS = ("nonprivate", "flat", "per_layer", "adaptive_per_layer", "opacus_ghost", "opacus_hooks")
DP_MODES = ("flat", "per_layer", "adaptive_per_layer")


# ====================================================================== shapes
@dataclass(frozen=True)
class Shape:
    """A model layout and a batch shape. ``arch``: ``gpt2`` (causal LM, HF Conv1D, tied wte/lm_head), ``llama``
    (causal LM, nn.Linear, RMSNorm, untied head) or ``bert`` (sequence classification)."""

    name: str
    arch: str
    layers: int
    width: int
    heads: int
    vocab: int
    seq_len: int
    batch_size: int
    num_labels: int = 2
    tied: bool = True  # gpt2: lm_head shares wte (GPT-2's layout); Opacus's ghost clipping refuses tied parameters
    accum: int = 1  # gradient accumulation steps: a logical batch of batch_size × accum examples per optimizer step

    @property
    def task(self) -> str:
        return "classification" if self.arch == "bert" else "causal_lm"


PRESETS: dict[str, list[Shape]] = {
    # A few minutes on 2 shared CPU cores: narrow (256) models, for checking the harness.
    "cpu-quick": [
        Shape("gpt2-4x256-T128-B8", "gpt2", 4, 256, 4, 50257, 128, 8),
        Shape("bert-4x256-cls-T128-B8", "bert", 4, 256, 4, 30522, 128, 8),
    ],
    # What RESULTS.md records for this CPU (about 40 min on 2 shared cores): the GPT-2-small and BERT-base layouts
    # (768 wide, 12 heads, full vocabularies, T=128) cut to 4 layers, batch 8. GPT-2 twice: with its tied
    # wte/lm_head, and untied so that Opacus's ghost clipping (which refuses tied parameters) can run on it.
    "cpu": [
        Shape("gpt2-4x768-T128-B8", "gpt2", 4, 768, 12, 50257, 128, 8),
        Shape("gpt2-4x768-T128-B8-untied", "gpt2", 4, 768, 12, 50257, 128, 8, tied=False),
        Shape("bert-4x768-cls-T128-B8", "bert", 4, 768, 12, 30522, 128, 8),
    ],
    # Issue 17's CPU targets: a BERT-like 4×256 classifier (vocab 8192) at B = 32, and the GPT-2 layouts of "cpu".
    "issue17": [
        Shape("bert-4x256-v8192-cls-T128-B32", "bert", 4, 256, 4, 8192, 128, 32),
        Shape("gpt2-4x768-T128-B8", "gpt2", 4, 768, 12, 50257, 128, 8),
        Shape("gpt2-4x768-T128-B8-untied", "gpt2", 4, 768, 12, 50257, 128, 8, tied=False),
    ],
    # Issue 17's scaling table (fixed per-step cost vs per-example cost): the BERT-like 4×256 classifier at
    # B ∈ {8, 32, 128 = 4 × 32 by gradient accumulation} and T ∈ {64, 256}.
    "scaling": [
        Shape(f"bert-4x256-v8192-cls-T{t}-B{b * a}" + (f"-accum{a}" if a > 1 else ""), "bert", 4, 256, 4, 8192, t, b,
              accum=a)
        for t in (64, 256) for b, a in ((8, 1), (32, 1), (32, 4))
    ],
    # The layouts (GPU).
    "gpu": [
        Shape("gpt2-small-T128", "gpt2", 12, 768, 12, 50257, 128, 16),
        Shape("gpt2-small-T128-untied", "gpt2", 12, 768, 12, 50257, 128, 16, tied=False),
        Shape("gpt2-small-T512", "gpt2", 12, 768, 12, 50257, 512, 8),
        Shape("gpt2-small-T512-untied", "gpt2", 12, 768, 12, 50257, 512, 8, tied=False),
        Shape("bert-base-cls-T128", "bert", 12, 768, 12, 30522, 128, 32),
    ],
}


def build_model(shape: Shape, seed: int = 0) -> torch.nn.Module:
    """A random-init model of the shape, dropout off (identical work across methods and steps)."""
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )

    torch.manual_seed(seed)
    if shape.arch == "gpt2":
        cfg = GPT2Config(n_layer=shape.layers, n_embd=shape.width, n_head=shape.heads, vocab_size=shape.vocab,
                         n_positions=max(1024, shape.seq_len), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         tie_word_embeddings=shape.tied)
        model = GPT2LMHeadModel(cfg)
    elif shape.arch == "llama":
        cfg = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.width, intermediate_size=4 * shape.width,
                          num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                          num_key_value_heads=shape.heads, max_position_embeddings=max(1024, shape.seq_len),
                          tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model = LlamaForCausalLM(cfg)
    elif shape.arch == "bert":
        cfg = BertConfig(vocab_size=shape.vocab, hidden_size=shape.width, num_hidden_layers=shape.layers,
                         num_attention_heads=shape.heads, intermediate_size=4 * shape.width,
                         max_position_embeddings=max(512, shape.seq_len), hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0, num_labels=shape.num_labels)
        model = BertForSequenceClassification(cfg)
    else:
        raise ValueError(f"unknown arch {shape.arch!r}")
    model.train()
    return model


class ListDataset(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict[str, torch.Tensor]]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


def make_dataset(shape: Shape, num_batches: int = 4, seed: int = 1) -> ListDataset:
    """``num_batches × batch_size × accum`` fixed-length examples of random tokens (no padding)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_batches * shape.batch_size * shape.accum):
        ids = torch.randint(0, shape.vocab, (shape.seq_len,), generator=gen)
        row = {"input_ids": ids, "attention_mask": torch.ones(shape.seq_len, dtype=torch.long)}
        if shape.task == "classification":
            row["labels"] = torch.randint(0, shape.num_labels, (), generator=gen)
        else:
            row["labels"] = ids.clone()
        rows.append(row)
    return ListDataset(rows)


# ====================================================================== timing helpers
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimes:
    """Step durations of one run (wall clock and this process's CPU time, user + system): the first ``warmup`` steps
    are kept apart.

    With one intra-op thread (the CPU default) the process's CPU time is the work the step did, whatever else runs on
    the machine; its wall time also includes waiting for a core (other users' jobs), so on a shared machine the CPU
    time ratio is the more stable one.
    """

    def __init__(self, device: torch.device, warmup: int, reset_peak_at_measured: bool):
        self.device = device
        self.warmup = warmup
        self.reset_peak = reset_peak_at_measured and device.type == "cuda"
        self.warm: list[float] = []
        self.measured: list[float] = []
        self.measured_cpu: list[float] = []
        self._t0 = 0.0
        self._c0 = 0.0

    def begin(self) -> None:
        if self.reset_peak and len(self.warm) == self.warmup and not self.measured:
            _sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        _sync(self.device)
        self._c0 = time.process_time()
        self._t0 = time.perf_counter()

    def end(self) -> None:
        _sync(self.device)
        dt = time.perf_counter() - self._t0
        dc = time.process_time() - self._c0
        if len(self.warm) < self.warmup:
            self.warm.append(dt)
        else:
            self.measured.append(dt)
            self.measured_cpu.append(dc)


def _timer_callback_cls():
    from transformers import TrainerCallback

    class TimerCallback(TrainerCallback):
        """on_step_begin → on_step_end of every optimizer step (batch already fetched; includes optimizer step,
        scheduler, zero_grad and the other callbacks' on_step_end, e.g. DPTrainer's budget check)."""

        def __init__(self):
            self.times: StepTimes | None = None

        def on_step_begin(self, args, state, control, **kwargs):
            if self.times is not None:
                self.times.begin()

        def on_step_end(self, args, state, control, **kwargs):
            if self.times is not None:
                self.times.end()

    return TimerCallback


# ====================================================================== runners
class Runner:
    method: str
    model: torch.nn.Module

    def run(self, times: StepTimes, steps: int) -> None:
        raise NotImplementedError

    def optimizer_states(self) -> list[dict]:
        return []

    def to(self, device: torch.device) -> None:
        """Move model and optimizer state (GPU timing: keep only the active method on the device)."""
        self.model.to(device)
        for state in self.optimizer_states():
            for k, v in list(state.items()):
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    state[k] = v.to(device)


class TrainerRunner(Runner):
    """HF ``Trainer`` (nonprivate) or ``hf_dp.DPTrainer`` (a clipping mode), driven by ``trainer.train()``."""

    def __init__(self, method: str, model: torch.nn.Module, dataset, shape: Shape, device: torch.device,
                 outdir: str, lr: float, dp_self_check: bool = True):
        from transformers import Trainer, TrainingArguments, default_data_collator

        self.method = method
        self.model = model
        common = dict(
            output_dir=os.path.join(outdir, method), per_device_train_batch_size=shape.batch_size,
            gradient_accumulation_steps=shape.accum, max_steps=1, learning_rate=lr, lr_scheduler_type="constant",
            warmup_steps=0, weight_decay=0.0, optim="adamw_torch", max_grad_norm=0.0, logging_strategy="no",
            save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True, seed=0,
            dataloader_num_workers=0, use_cpu=device.type == "cpu", remove_unused_columns=True,
        )
        from transformers.trainer_callback import PrinterCallback, ProgressCallback

        self.callback = _timer_callback_cls()()
        if method == "nonprivate":
            args = TrainingArguments(**common)
            self.trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=default_data_collator,
                                   callbacks=[self.callback])
        else:
            from hf_dp import DPTrainer, DPTrainingArguments

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                args = DPTrainingArguments(
                    **common, clipping=method, noise_multiplier=1.0, per_sample_max_grad_norm=1.0,
                    poisson_sampling=False, dp_seed=0, accountant="rdp", dp_self_check=dp_self_check,
                )
                self.trainer = DPTrainer(model=model, args=args, train_dataset=dataset,
                                         data_collator=default_data_collator, callbacks=[self.callback])
        for cb in (PrinterCallback, ProgressCallback):  # no per-run metric prints
            self.trainer.remove_callback(cb)

    def run(self, times: StepTimes, steps: int) -> None:
        self.trainer.args.max_steps = steps
        self.callback.times = times
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.trainer.train()
        finally:
            self.callback.times = None
        if self.method != "nonprivate":
            # The checks run once per training run, at its first step (reported separately as "first step"). The
            # harness calls train() once per repeat, and DPTrainer.train() re-arms the always-on first-step check
            # (ClippingEngine.first_step_check: several forwards and a backward) for every call, which would land in
            # the first timed step of every later repeat. Later calls skip the checks (the model did not change).
            self.trainer.args.dp_self_check = False
            self.trainer._self_check = self._skip_self_check

    def _skip_self_check(self, *args, **kwargs) -> None:
        self.trainer._self_checked = True

    def optimizer_states(self) -> list[dict]:
        opt = self.trainer.optimizer
        opt = getattr(opt, "optimizer", opt)
        return list(opt.state.values()) if opt is not None else []


class OpacusRunner(Runner):
    """Opacus 1.6 on the same model and batches: ``make_private(grad_sample_mode=...)``, its own DP optimizer step.

    Inputs: the same ``input_ids``/``attention_mask``/``labels``, plus ``position_ids`` (and ``token_type_ids`` for
    BERT) materialised as ``(B, T)``: Opacus needs per-example inputs for the position embedding's per-sample
    gradient (LIBRARY_FACTS §6: with the models' default ``(1, T)`` ids its grad_sample has batch dimension 1).
    """

    def __init__(self, method: str, model: torch.nn.Module, dataset, shape: Shape, device: torch.device, lr: float):
        from opacus import PrivacyEngine
        from transformers import default_data_collator

        if shape.accum > 1:
            raise NotImplementedError("gradient accumulation is not benchmarked for Opacus (virtual steps)")

        self.method = method
        self.shape = shape
        self.device = device
        mode = method.split("_", 1)[1]
        model.to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        loader = torch.utils.data.DataLoader(dataset, batch_size=shape.batch_size, shuffle=True, drop_last=True,
                                             collate_fn=default_data_collator)
        self.criterion = torch.nn.CrossEntropyLoss()
        engine = PrivacyEngine(accountant="rdp")
        kwargs = dict(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
                      max_grad_norm=1.0, poisson_sampling=False, grad_sample_mode=mode)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if mode == "ghost":
                self.model, self.optimizer, self.dp_criterion, self.loader = engine.make_private(
                    criterion=self.criterion, **kwargs)
            else:
                self.model, self.optimizer, self.loader = engine.make_private(**kwargs)
                self.dp_criterion = None
        self._iter = iter(())

    def _next_batch(self) -> dict[str, torch.Tensor]:
        try:
            batch = next(self._iter)
        except StopIteration:
            self._iter = iter(self.loader)
            batch = next(self._iter)
        b, t = batch["input_ids"].shape
        # contiguous: Opacus's ghost embedding norm calls input_ids.view(-1, 1), which fails on an expand()ed view.
        batch["position_ids"] = torch.arange(t).expand(b, t).contiguous()
        if self.shape.arch == "bert":
            batch["token_type_ids"] = torch.zeros(b, t, dtype=torch.long)
        return {k: v.to(self.device) for k, v in batch.items()}

    def _step(self, batch: dict[str, torch.Tensor]) -> None:
        labels = batch.pop("labels")
        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(**batch).logits
        if self.shape.task == "causal_lm":
            logits, labels = logits[:, :-1], labels[:, 1:]
            shape = logits.shape
            flat_logits, flat_labels = logits.reshape(-1, shape[-1]), labels.reshape(-1)
        else:
            shape, flat_logits, flat_labels = None, logits, labels
        if self.dp_criterion is not None:  # ghost: per-sample loss; .backward() runs Opacus's two backward passes
            loss = self.dp_criterion(flat_logits, flat_labels, shape=shape)
        else:
            loss = self.criterion(flat_logits, flat_labels)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def run(self, times: StepTimes, steps: int) -> None:
        self.model.train()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(steps):
                batch = self._next_batch()
                times.begin()
                self._step(batch)
                times.end()

    def optimizer_states(self) -> list[dict]:
        return list(self.optimizer.original_optimizer.state.values())


def build_runner(method: str, base_state: dict, shape: Shape, dataset, device: torch.device, outdir: str,
                 lr: float, dp_self_check: bool = True) -> Runner:
    model = build_model(shape)
    model.load_state_dict(base_state)
    if method.startswith("opacus_"):
        return OpacusRunner(method, model, dataset, shape, device, lr)
    return TrainerRunner(method, model, dataset, shape, device, outdir, lr, dp_self_check=dp_self_check)


def _short_error(exc: BaseException) -> str:
    msg = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return msg if len(msg) < 400 else msg[:400] + " ..."


def _base_state(shape: Shape) -> dict:
    return {k: v.clone() for k, v in build_model(shape).state_dict().items()}


# ====================================================================== CPU memory: live tensor bytes
class LiveTensorBytes(TorchDispatchMode):
    """Bytes of live tensor storages on ``device_type`` created under this mode: an allocator-style measure on CPU.

    Every aten op's output storages are counted once (views share their base's storage) and uncounted when the
    storage is freed (weakref finalizer). In-place ops allocate nothing. Enter it before building the model so that
    parameters, buffers, gradients, optimizer state, activations and temporaries are all counted.
    """

    def __init__(self, device_type: str = "cpu"):
        super().__init__()
        self.device_type = device_type
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def reset_peak(self) -> None:
        self.peak = self.live

    def _free(self, key: int, n: int) -> None:
        if self._sizes.get(key) == n:
            del self._sizes[key]
            self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != self.device_type:
                continue
            st = t.untyped_storage()
            n = st.nbytes()
            key = st.data_ptr()
            if n == 0 or key in self._sizes:
                continue
            self._sizes[key] = n
            self.live += n
            if self.live > self.peak:
                self.peak = self.live
            weakref.finalize(st, self._free, key, n)
        return out


def _maxrss_bytes() -> int:
    """The process's peak resident set size. Linux: ``VmHWM`` (``ru_maxrss`` is not reset by ``execve``, so a child
    of a large timing process would report its parent's peak)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/self/status") as f:
            return int(next(ln for ln in f if ln.startswith("VmHWM:")).split()[1]) * 1024
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def child_main(args: argparse.Namespace) -> dict[str, Any]:
    """One method in its own process: CPU peak memory (live tensor bytes and peak RSS), or a GPU batch probe."""
    shape = Shape(**json.loads(args.child_shape))
    device = torch.device(args.device)
    method = args.child
    out: dict[str, Any] = {"method": method, "batch_size": shape.batch_size}
    tracker = LiveTensorBytes() if device.type == "cpu" else None
    ctx = tracker if tracker is not None else contextlib.nullcontext()
    try:
        with ctx, tempfile.TemporaryDirectory() as outdir:
            base = _base_state(shape)
            dataset = make_dataset(shape)
            # The self-check runs in the (unmeasured) warm-up step; skip it here, it does not change later steps.
            runner = build_runner(method, base, shape, dataset, device, outdir, args.lr, dp_self_check=False)
            del base
            gc.collect()
            out["model_state_bytes"] = sum(p.numel() * p.element_size() for p in runner.model.parameters())
            rss_before = _maxrss_bytes()
            warm = StepTimes(device, args.warmup, reset_peak_at_measured=False)
            runner.run(warm, args.warmup)
            gc.collect()
            if tracker is not None:
                tracker.reset_peak()
                out["live_at_measured_start_bytes"] = tracker.live
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                out["cuda_allocated_at_measured_start_bytes"] = torch.cuda.memory_allocated(device)
            peaks, live_after = [], []
            for i in range(args.memory_steps):  # one run() per step: peak and live memory step by step
                # --memory-phases: the first measured step's memory at the start and end of each phase.
                clock = PhaseClock(tracker) if args.memory_phases and tracker is not None and i == 0 else None
                if clock is not None:
                    _instrument(runner, clock)
                    clock.mark("step start")
                try:
                    runner.run(StepTimes(device, 0, reset_peak_at_measured=False), 1)
                finally:
                    if clock is not None:
                        clock.undo()
                gc.collect()
                if clock is not None:
                    clock.mark("after the step")
                    out["memory_phases"] = clock.marks
                    tracker.peak = max(m["peak_since_previous_mark_bytes"] for m in clock.marks)
                if tracker is not None:
                    peaks.append(tracker.peak)
                    live_after.append(tracker.live)
                    tracker.reset_peak()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    peaks.append(torch.cuda.max_memory_allocated(device))
                    live_after.append(torch.cuda.memory_allocated(device))
                    torch.cuda.reset_peak_memory_stats(device)
            out["peak_per_step_bytes"] = peaks
            out["live_after_step_bytes"] = live_after
            # The first measured step's peak is the reported peak; growth of live memory between steps is reported
            # separately (it is a leak if it is not zero).
            key = "peak_live_bytes" if tracker is not None else "cuda_peak_bytes"
            out[key] = peaks[0]
            if len(live_after) > 1:
                out["growth_per_step_bytes"] = (live_after[-1] - live_after[0]) / (len(live_after) - 1)
            if tracker is not None:
                out["rss_growth_bytes"] = max(_maxrss_bytes() - rss_before, 0)
                out["peak_rss_bytes"] = _maxrss_bytes()
            out["ok"] = True
    except torch.OutOfMemoryError as exc:  # GPU probes
        out.update(ok=False, oom=True, error=_short_error(exc))
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        out.update(ok=False, oom="out of memory" in str(exc).lower(), error=_short_error(exc),
                   traceback=traceback.format_exc(limit=6))
    return out


def run_child(method: str, shape: Shape, args: argparse.Namespace, timeout: float = 3600) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", method, "--child-shape", json.dumps(asdict(shape)),
           "--device", args.device, "--warmup", str(args.warmup), "--memory-steps", str(args.memory_steps),
           "--lr", str(args.lr)] + (["--memory-phases"] if args.memory_phases else [])
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"method": method, "ok": False, "error": f"timeout after {timeout}s"}
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"method": method, "ok": False, "error": f"child exited {proc.returncode}: {proc.stderr[-600:]}"}


# ====================================================================== GPU: largest batch
def max_batch_search(method: str, shape: Shape, args: argparse.Namespace, start: int, limit: int) -> dict[str, Any]:
    """Largest batch (fixed T) that runs warm-up + measured steps without OOM: doubling, then bisection.
    """
    probes: dict[int, bool] = {}

    def fits(b: int) -> bool:
        if b not in probes:
            r = run_child(method, replace(shape, batch_size=b), args)
            if not r.get("ok") and not r.get("oom"):
                raise RuntimeError(r.get("error"))
            probes[b] = bool(r.get("ok"))
        return probes[b]

    lo, hi = 0, None
    b = start
    while b <= limit:
        if fits(b):
            lo, b = b, b * 2
        else:
            hi = b
            break
    if hi is None:
        return {"max_batch": lo, "capped_at": limit, "probes": probes}
    while hi - lo > max(1, lo // 16):  # ~6% resolution
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return {"max_batch": lo, "probes": probes}


# ====================================================================== the side-by-side run
def benchmark_shape(shape: Shape, args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    offload = device.type == "cuda" and args.offload != "no"
    result: dict[str, Any] = {"shape": asdict(shape), "methods": {}, "errors": {}}
    print(f"\n=== {shape.name}: {shape.arch} {shape.layers}x{shape.width} vocab {shape.vocab} T={shape.seq_len} "
          f"B={shape.batch_size} on {device} ===", flush=True)
    base = _base_state(shape)
    dataset = make_dataset(shape)
    result["num_parameters"] = sum(p.numel() for p in build_model(shape).parameters())  # tied weights once

    runners: dict[str, Runner] = {}
    with tempfile.TemporaryDirectory() as outdir:
        for method in ([] if args.memory_only else args.methods):
            try:
                runners[method] = build_runner(method, base, shape, dataset, device, outdir, args.lr,
                                               dp_self_check=not args.no_self_check)
                if offload:
                    runners[method].to(torch.device("cpu"))
            except Exception as exc:  # noqa: BLE001
                result["errors"][method] = _short_error(exc)
                print(f"  {method}: cannot build: {result['errors'][method]}", flush=True)
        times = {m: {"measured": [], "measured_cpu": [], "first": None, "repeat_medians": [], "cuda_peak": []}
                 for m in runners}
        order = list(runners)
        result["loadavg_per_repeat"] = []
        for rep in range(args.repeats):
            rot = order[rep % len(order):] + order[:rep % len(order)] if order else []
            if order:
                with contextlib.suppress(OSError):
                    result["loadavg_per_repeat"].append(os.getloadavg()[0])
            for method in rot:
                if method in result["errors"]:
                    continue
                runner = runners[method]
                gc.collect()
                if offload:
                    runner.to(device)
                    torch.cuda.empty_cache()
                warm = args.warmup if rep == 0 else args.rewarm
                st = StepTimes(device, warm, reset_peak_at_measured=True)
                t_run = time.perf_counter()
                try:
                    runner.run(st, warm + args.steps)
                except Exception as exc:  # noqa: BLE001
                    result["errors"][method] = _short_error(exc)
                    print(f"  {method}: failed: {result['errors'][method]}", flush=True)
                    if args.verbose:
                        traceback.print_exc()
                    continue
                finally:
                    if offload:
                        runner.to(torch.device("cpu"))
                rec = times[method]
                if rep == 0 and st.warm:
                    rec["first"] = st.warm[0]
                rec["measured"].extend(st.measured)
                rec["measured_cpu"].extend(st.measured_cpu)
                rec["repeat_medians"].append(statistics.median(st.measured))
                if device.type == "cuda":
                    rec["cuda_peak"].append(torch.cuda.max_memory_allocated(device))
                steps_s = ", ".join(f"{t * 1e3:.0f} (cpu {c * 1e3:.0f})" for t, c in zip(st.measured, st.measured_cpu))
                warm_s = ", ".join(f"{t * 1e3:.0f}" for t in st.warm)
                print(f"  rep {rep} {method:>18}: steps {steps_s} ms (warm-up {warm_s} ms; "
                      f"run {time.perf_counter() - t_run:.0f} s)", flush=True)
        base_reps = times.get("nonprivate", {}).get("repeat_medians", [])
        for method, rec in times.items():
            if method in result["errors"] or not rec["measured"]:
                continue
            # Paired ratio: per repeat, this method's median over the non-private median of the same repeat (the two
            # ran minutes apart at most, so slow drifts of the machine's load cancel); median over repeats.
            paired = [a / b for a, b in zip(rec["repeat_medians"], base_reps)]
            result["methods"][method] = {
                "paired_ratio": statistics.median(paired) if paired else None,
                "median_ms": 1e3 * statistics.median(rec["measured"]),
                "min_ms": 1e3 * min(rec["measured"]),
                "median_cpu_ms": 1e3 * statistics.median(rec["measured_cpu"]),
                "steps_ms": [1e3 * t for t in rec["measured"]],
                "steps_cpu_ms": [1e3 * t for t in rec["measured_cpu"]],
                "repeat_medians_ms": [1e3 * t for t in rec["repeat_medians"]],
                "n": len(rec["measured"]),
                "first_step_ms": None if rec["first"] is None else 1e3 * rec["first"],
            }
            if rec["cuda_peak"]:
                result["methods"][method]["cuda_peak_bytes"] = max(rec["cuda_peak"])
            engine = getattr(getattr(runners[method], "trainer", None), "clipping_engine", None)
            if engine is not None:  # per parameter: "ghost" or "instantiate" (engine.use_ghost_norm), last step
                result["methods"][method]["norm_paths"] = dict(getattr(engine, "norm_paths", {}))
        del runners
        gc.collect()

    if args.memory and device.type == "cpu":
        print("  memory (one subprocess per method) ...", flush=True)
        for method in args.methods:
            if method in result["errors"]:
                continue
            r = run_child(method, shape, args)
            if r.get("ok"):
                result["methods"].setdefault(method, {}).update(
                    {k: r[k] for k in ("peak_live_bytes", "live_at_measured_start_bytes", "rss_growth_bytes",
                                       "peak_rss_bytes", "model_state_bytes", "growth_per_step_bytes",
                                       "peak_per_step_bytes", "live_after_step_bytes", "memory_phases") if k in r})
                print(f"  {method:>18}: peak live tensors {r['peak_live_bytes'] / 2**20:.0f} MiB (live at step start "
                      f"{r['live_at_measured_start_bytes'] / 2**20:.0f} MiB, growth "
                      f"{r.get('growth_per_step_bytes', 0) / 2**20:.0f} MiB/step), peak RSS growth "
                      f"{r['rss_growth_bytes'] / 2**20:.0f} MiB", flush=True)
                for mark in r.get("memory_phases", []):
                    print(f"      {mark['at']:<58} live {mark['live_bytes'] / 2**20:7.0f} MiB, peak since the previous "
                          f"mark {mark['peak_since_previous_mark_bytes'] / 2**20:7.0f} MiB", flush=True)
            else:
                result["errors"].setdefault(method, "memory run: " + str(r.get("error")))
                print(f"  {method}: memory run failed: {r.get('error')}", flush=True)
    if args.max_batch:
        if device.type != "cuda" and not args.tiny:
            print("  largest-batch search: skipped on CPU (no device memory limit to probe).", flush=True)
        else:
            result["max_batch"] = {}
            for method in args.methods:
                if method in result["errors"]:
                    continue
                r = max_batch_search(method, shape, args, start=shape.batch_size, limit=args.max_batch_limit)
                result["max_batch"][method] = r
                print(f"  {method:>18}: largest batch {r['max_batch']}", flush=True)
    return result


# ====================================================================== reporting
def _fmt_ratio(x: float | None, target: float | None = None) -> str:
    if x is None:
        return "—"
    s = f"{x:.2f}×"
    if target is not None:
        s += " ✓" if x <= target else " ✗"
    return s


def _mib(x: float | None) -> str:
    return "" if x is None else f"{x / 2**20:.0f}"


# Issue 17's targets (ratios to non-private training, same run; issue 4's were 1.25 / 1.15 time, 1.10 / 1.05 memory);
# adaptive per-layer is held to per-layer's.
TIME_TARGETS = {"flat": 1.10, "per_layer": 1.08, "adaptive_per_layer": 1.08}
MEM_TARGETS = {"flat": 1.05, "per_layer": 1.05, "adaptive_per_layer": 1.05}


def markdown(result: dict[str, Any], device_type: str) -> str:
    """Two tables per shape: step time (wall clock and process CPU time) and peak memory, as ratios to non-private.

    ✓/✗ compare with issue 17's targets (flat ≤ 1.10× time, per-layer and adaptive ≤ 1.08×; memory ≤ 1.05×).
    """
    shape = result["shape"]
    ms = result["methods"]
    base = ms.get("nonprivate", {})
    tied = "" if shape["arch"] != "gpt2" else (", tied wte/lm_head" if shape.get("tied", True) else ", untied lm_head")
    accum = f" × {shape['accum']} accumulated" if shape.get("accum", 1) > 1 else ""
    lines = [f"#### {shape['name']}: {shape['arch']} {shape['layers']}×{shape['width']}, vocab {shape['vocab']}, "
             f"T={shape['seq_len']}, B={shape['batch_size']}{accum}{tied} "
             f"({result.get('num_parameters', 0) / 1e6:.1f} M params)", ""]
    ghost = ms.get("opacus_ghost", {})
    shown = [m for m in ALL_METHODS if m in ms or m in result["errors"]]
    if any("median_ms" in ms.get(m, {}) for m in shown):
        lines.append("| method | wall (ms, median) | × non-private | × non-private, paired by repeat | "
                     "CPU (ms, median) | × non-private, CPU | per-repeat wall medians (ms) | first step (ms) | "
                     "× Opacus ghost, wall | × Opacus ghost, CPU |")
        lines.append("|---|---:|---:|---:|---:|---:|---|---:|---:|---:|")
        for method in shown:
            m = ms.get(method, {})
            if "median_ms" not in m:
                lines.append(f"| {method} | failed (below) | | | | | | | | |")
                continue
            wall = m["median_ms"] / base["median_ms"] if base.get("median_ms") else None
            cpu = m["median_cpu_ms"] / base["median_cpu_ms"] if base.get("median_cpu_ms") else None
            target = TIME_TARGETS.get(method)
            reps = ", ".join(f"{x:.0f}" for x in m.get("repeat_medians_ms", []))
            first = "" if m.get("first_step_ms") is None else f"{m['first_step_ms']:.0f}"
            g_wall = f"{m['median_ms'] / ghost['median_ms']:.2f}×" if ghost.get("median_ms") else "—"
            g_cpu = f"{m['median_cpu_ms'] / ghost['median_cpu_ms']:.2f}×" if ghost.get("median_cpu_ms") else "—"
            lines.append(f"| {method} | {m['median_ms']:.0f} | {_fmt_ratio(wall, target)} | "
                         f"{_fmt_ratio(m.get('paired_ratio'), target)} | {m['median_cpu_ms']:.0f} | "
                         f"{_fmt_ratio(cpu, target)} | {reps} | {first} | {g_wall} | {g_cpu} |")
        lines.append("")
    mem_key = "cuda_peak_bytes" if device_type == "cuda" else "peak_live_bytes"
    if any(mem_key in ms.get(m, {}) for m in shown):
        what = "torch.cuda.max_memory_allocated" if device_type == "cuda" else "live CPU tensor bytes"
        lines.append(f"| method | peak memory (MiB, {what}) | × non-private | live at step start (MiB) | "
                     "step's own peak: peak − start (MiB) | × non-private | live growth (MiB/step) | "
                     "peak RSS growth (MiB) |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|")
        for method in shown:
            m = ms.get(method, {})
            mem = m.get(mem_key)
            if mem is None:
                lines.append(f"| {method} | failed (below) | | | | | | |")
                continue
            ratio = mem / base[mem_key] if base.get(mem_key) else None
            start = m.get("live_at_measured_start_bytes")
            own = None if start is None else mem - start
            b_start = base.get("live_at_measured_start_bytes")
            own_ratio = own / (base[mem_key] - b_start) if own is not None and b_start is not None else None
            lines.append(f"| {method} | {_mib(mem)} | {_fmt_ratio(ratio, MEM_TARGETS.get(method))} | {_mib(start)} | "
                         f"{_mib(own)} | {_fmt_ratio(own_ratio)} | {_mib(m.get('growth_per_step_bytes'))} | "
                         f"{_mib(m.get('rss_growth_bytes'))} |")
        lines.append("")
    if any(ms.get(m, {}).get("memory_phases") for m in shown):
        lines += ["Where each method's peak happens (`--memory-phases`; marks at the start and end of each phase):", "",
                  "| method | peak (MiB) | between the marks | live at the earlier mark (MiB) |", "|---|---:|---|---:|"]
        for method in shown:
            marks = ms.get(method, {}).get("memory_phases")
            if not marks:
                continue
            i = max(range(len(marks)), key=lambda j: marks[j]["peak_since_previous_mark_bytes"])
            before = marks[i - 1] if i > 0 else marks[i]
            lines.append(f"| {method} | {_mib(marks[i]['peak_since_previous_mark_bytes'])} | {before['at']} → "
                         f"{marks[i]['at']} | {_mib(before['live_bytes'])} |")
        lines.append("")
    paths = {m: ms[m]["norm_paths"] for m in shown if ms.get(m, {}).get("norm_paths")}
    if paths:
        lines += ["Per-example norm path per parameter (`norm_paths`; parameter names with layer numbers as `*`):", "",
                  "| method | ghost | instantiate |", "|---|---|---|"]
        for method, by_param in paths.items():
            cells = []
            for path in ("ghost", "instantiate"):
                names = sorted({re.sub(r"\.\d+\.", ".*.", n) for n, v in by_param.items() if v == path})
                count = sum(v == path for v in by_param.values())
                cells.append(f"{count}: " + ", ".join(f"`{n}`" for n in names) if count else "0")
            lines.append(f"| {method} | {cells[0]} | {cells[1]} |")
        lines.append("")
    if result.get("max_batch"):
        lines += ["| method | largest batch |", "|---|---:|"]
        for method, r in result["max_batch"].items():
            lines.append(f"| {method} | {r['max_batch']} |")
        lines.append("")
    if result.get("loadavg_per_repeat"):
        lines.append("1-min load average at the start of each repeat: " +
                     ", ".join(f"{x:.1f}" for x in result["loadavg_per_repeat"]) + "\n")
    if result["errors"]:
        lines += [f"* `{m}`: `{e}`" for m, e in result["errors"].items()]
    return "\n".join(lines).rstrip("\n") + "\n"


def environment() -> dict[str, str]:
    import accelerate
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "accelerate": accelerate.__version__, "platform": platform.platform(),
           "cpu_threads": str(torch.get_num_threads()), "os.cpu_count": str(os.cpu_count())}
    try:
        import opacus

        env["opacus"] = opacus.__version__
    except ImportError:
        env["opacus"] = "not installed"
    try:
        with open("/proc/cpuinfo") as f:
            env["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    except OSError:
        env["cpu"] = platform.processor()
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    try:
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        head = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--", "hf_dp"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
        env["hf_dp_commit"] = head + (" (hf_dp/ has uncommitted changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        env["loadavg_at_start"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        pass
    return env


# ====================================================================== profiling
class PhaseClock:
    """Wall and process-CPU time per labelled phase of a step (``--profile``): hf_dp's and the Trainer's functions are
    wrapped (benchmark-side, behaviour unchanged) in ``torch.profiler.record_function`` ranges with these labels, so
    they also appear as rows of the profiler's tables. With a ``LiveTensorBytes`` tracker (``--memory-phases``), each
    phase's start and end are also memory marks: live bytes there and the peak since the previous mark."""

    def __init__(self, tracker: LiveTensorBytes | None = None):
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.tracker = tracker
        self.marks: list[dict[str, Any]] = []
        self._open: dict[str, list[tuple[float, float]]] = {}
        self._undo: list[tuple[Any, str, Any, bool]] = []

    def mark(self, label: str) -> None:
        if self.tracker is not None:
            self.marks.append({"at": label, "live_bytes": self.tracker.live,
                               "peak_since_previous_mark_bytes": self.tracker.peak})
            self.tracker.reset_peak()

    def enter(self, label: str) -> None:
        self.mark("start of " + label)
        self._open.setdefault(label, []).append((time.perf_counter(), time.process_time()))

    def exit(self, label: str) -> None:
        t0, c0 = self._open[label].pop()
        self.wall[label] = self.wall.get(label, 0.0) + time.perf_counter() - t0
        self.cpu[label] = self.cpu.get(label, 0.0) + time.process_time() - c0
        self.mark("end of " + label)

    def wrap(self, owner: Any, name: str, label: str) -> None:
        f = getattr(owner, name)
        had_own = name in vars(owner) if hasattr(owner, "__dict__") else True

        def timed(*a, **k):
            self.enter(label)
            with torch.profiler.record_function(label):
                try:
                    return f(*a, **k)
                finally:
                    self.exit(label)

        setattr(owner, name, timed)
        self._undo.append((owner, name, f, had_own))

    def undo(self) -> None:
        for owner, name, f, had_own in reversed(self._undo):
            if had_own:
                setattr(owner, name, f)
            else:
                delattr(owner, name)
        self._undo = []


# (label, nested inside the label before it). "rest" = step − the top-level phases.
PHASES = [("forward (model; non-private: + HF batch loss)", False), ("per-example loss", False),
          ("backward", False), ("fused per-layer clipping (inside backward)", True),
          ("ghost norms: per_example_norms_sq", False), ("clipped sums: accumulate_clipped", False),
          ("finish_fused", False), ("finish_step (the DP step strategy)", False),
          ("noise: privatize (inside finish_step)", True),
          ("optimizer step (AdamW)", False), ("optimizer step (DP optimizer)", False)]


def _instrument(runner: Runner, clock: PhaseClock) -> None:
    from hf_dp.clipping.engine import ClippingEngine

    names = [p for p, _ in PHASES]
    clock.wrap(runner.model, "forward", names[0])
    clock.wrap(torch.Tensor, "backward", names[2])
    if isinstance(runner, TrainerRunner):
        tr = runner.trainer
        if runner.method != "nonprivate":
            import hf_dp.clipping.local as local_step

            clock.wrap(tr, "per_example_loss", names[1])
            clock.wrap(ClippingEngine, "_process_group", names[3])
            clock.wrap(ClippingEngine, "per_example_norms_sq", names[4])
            clock.wrap(ClippingEngine, "accumulate_clipped", names[5])
            clock.wrap(ClippingEngine, "finish_fused", names[6])
            clock.wrap(tr._dp_step, "finish_step", names[7])  # the DP step strategy (hf_dp/clipping/local.py)
            clock.wrap(local_step, "privatize", names[8])
        from transformers import TrainerCallback

        class OptimizerClock(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                clock.enter(names[9])

            def on_optimizer_step(self, args, state, control, **kwargs):
                clock.exit(names[9])

        tr.add_callback(OptimizerClock())
    else:
        clock.wrap(runner.optimizer, "step", names[10])


def profile_method(method: str, shape: Shape, args: argparse.Namespace) -> dict[str, Any]:
    """torch.profiler op tables (self CPU time; by op and by input shape), the time per phase of the step (wall and
    process CPU), and a cProfile of the Python side, for one method. Returns the phase times (ms per step)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    device = torch.device(args.device)
    base = _base_state(shape)
    dataset = make_dataset(shape)
    with tempfile.TemporaryDirectory() as outdir:
        runner = build_runner(method, base, shape, dataset, device, outdir, args.lr, dp_self_check=False)
        runner.run(StepTimes(device, args.warmup, False), args.warmup)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        # Phase times from unprofiled steps (the profiler's own overhead left out), then the profiled steps.
        clock = PhaseClock()
        _instrument(runner, clock)
        st = StepTimes(device, 0, False)
        try:
            runner.run(st, args.steps)
            wall_by_phase, cpu_by_phase = dict(clock.wall), dict(clock.cpu)
            st_prof = StepTimes(device, 0, False)
            with profile(activities=acts, record_shapes=True) as prof:
                runner.run(st_prof, args.steps)
        finally:
            clock.undo()
        n = len(st.measured)
        step_wall, step_cpu = 1e3 * sum(st.measured) / n, 1e3 * sum(st.measured_cpu) / n
        print(f"\n--- {method} on {shape.name}: {n} unprofiled steps, mean {step_wall:.0f} ms wall, "
              f"{step_cpu:.0f} ms process CPU")
        phases: dict[str, Any] = {"step": {"wall_ms": step_wall, "cpu_ms": step_cpu}}
        print(f"  {'phase':<52} {'wall ms/step':>12} {'CPU ms/step':>12}")
        top_wall = top_cpu = 0.0
        for label, nested in PHASES:
            if label not in wall_by_phase:
                continue
            w, c = 1e3 * wall_by_phase[label] / n, 1e3 * cpu_by_phase[label] / n
            phases[label] = {"wall_ms": w, "cpu_ms": c}
            if not nested:
                top_wall, top_cpu = top_wall + w, top_cpu + c
            print(f"  {('  ' if nested else '') + label:<52} {w:>12.0f} {c:>12.0f}")
        phases["rest"] = {"wall_ms": step_wall - top_wall, "cpu_ms": step_cpu - top_cpu}
        print(f"  {'rest of the step (Trainer, callbacks, zero_grad, ...)':<52} {step_wall - top_wall:>12.0f} "
              f"{step_cpu - top_cpu:>12.0f}")
        print(f"\n--- {method}: torch.profiler, {args.steps} profiled steps, median "
              f"{statistics.median(st_prof.measured) * 1e3:.0f} ms wall")
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=args.profile_rows, max_name_column_width=60))
        print(prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=args.profile_rows,
                                                                 max_name_column_width=40,
                                                                 max_shapes_column_width=70))
        if args.cprofile:
            pr = cProfile.Profile()
            st = StepTimes(device, 0, False)
            pr.enable()
            runner.run(st, args.steps)
            pr.disable()
            print(f"--- cProfile (cumulative), {args.steps} steps, median "
                  f"{statistics.median(st.measured) * 1e3:.0f} ms")
            pstats.Stats(pr).sort_stats("cumulative").print_stats(r"hf_dp|opacus|trainer\.py", args.profile_rows)
    return phases


def phase_table(shape: Shape, all_phases: dict[str, dict[str, Any]]) -> str:
    """Markdown: CPU ms per step of each phase, per profiled method, and the difference to non-private."""
    methods = list(all_phases)
    base = all_phases.get("nonprivate")
    head = "| phase (process CPU ms per step) | " + " | ".join(methods) + " |"
    lines = [f"Phases of one step, {shape.name} (`--profile`, unprofiled steps, process CPU time):", "", head,
             "|---|" + "---:|" * len(methods)]
    labels = ["step"] + [p for p, _ in PHASES] + ["rest"]
    for label in labels:
        if not any(label in ph for ph in all_phases.values()):
            continue
        cells = []
        for m in methods:
            v = all_phases[m].get(label, {}).get("cpu_ms")
            cells.append("" if v is None else f"{v:.0f}")
        name = "**step**" if label == "step" else label
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if base:
        cells = []
        for m in methods:
            r = all_phases[m]["step"]["cpu_ms"] / base["step"]["cpu_ms"]
            cells.append(f"{r:.2f}×")
        lines.append("| step ÷ non-private | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ====================================================================== CLI
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="Named list of shapes (default: cpu-quick on CPU, gpu on CUDA). Ignored with --arch.")
    p.add_argument("--shapes", nargs="+", default=None, help="Only the preset's shapes with these names.")
    p.add_argument("--arch", choices=("gpt2", "llama", "bert"), help="A single custom shape instead of a preset.")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--accum", type=int, default=1,
                   help="Gradient accumulation steps (logical batch = batch size × accum; DPTrainer and HF Trainer).")
    p.add_argument("--untied", action="store_true",
                   help="gpt2 with --arch: a separate lm_head instead of GPT-2's tied wte/lm_head (Opacus's ghost "
                        "clipping does not support tied parameters).")
    p.add_argument("--methods", nargs="+", default=list(ALL_METHODS), choices=ALL_METHODS)
    p.add_argument("--repeats", type=int, default=4, help="Interleaved rounds over the methods (order rotated).")
    p.add_argument("--steps", type=int, default=2, help="Timed steps per method per round.")
    p.add_argument("--warmup", type=int, default=1,
                   help="Untimed steps at the start of each method's first run (includes DPTrainer's self-check).")
    p.add_argument("--rewarm", type=int, default=0, help="Untimed steps at the start of each later run.")
    p.add_argument("--no-memory", dest="memory", action="store_false", help="Skip the CPU memory subprocesses.")
    p.add_argument("--memory-steps", type=int, default=2,
                   help="Measured steps in each memory subprocess (the first one's peak is reported; with 2 or more, "
                        "the growth of live memory per step is reported too).")
    p.add_argument("--max-batch", action="store_true", help="GPU: binary-search the largest batch per method.")
    p.add_argument("--max-batch-limit", type=int, default=1024)
    p.add_argument("--no-self-check", action="store_true", help="dp_self_check=False for the DP modes.")
    p.add_argument("--memory-only", action="store_true", help="Skip the timing runs (memory subprocesses only).")
    p.add_argument("--memory-phases", action="store_true",
                   help="CPU memory subprocesses: also live tensor bytes at the start and end of each phase of the "
                        "first measured step (forward, loss, backward, norms, clipped sums, noise, optimizer) and the "
                        "peak between consecutive marks: where the peak happens.")
    p.add_argument("--tiny", action="store_true",
                   help="Dry run: every shape of the preset shrunk (1 layer, width 64, vocab 1000, T ≤ 32, B ≤ 4), so "
                        "that e.g. `--preset gpu --device cpu --tiny --max-batch` runs every code path quickly; on CPU "
                        "--max-batch then doubles the batch up to --max-batch-limit (no memory limit to hit).")
    p.add_argument("--offload", choices=("auto", "no"), default="auto",
                   help="GPU: keep only the running method's model/optimizer on the device (auto).")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available).")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads for the run and its subprocesses (default on CPU: 1; on a shared, "
                        "oversubscribed 2-core machine two OpenMP threads made every step 2-3x slower).")
    p.add_argument("--out", default=None, help="Write all results as JSON here.")
    p.add_argument("--markdown", default=None, help="Write the tables (markdown) here.")
    p.add_argument("--profile", nargs="+", default=None, choices=ALL_METHODS,
                   help="Profile these methods (torch.profiler + cProfile) on the shape instead of benchmarking.")
    p.add_argument("--profile-rows", type=int, default=25)
    p.add_argument("--cprofile", action="store_true", help="With --profile: also a cProfile of the Python side.")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-shape", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.threads is None and args.device == "cpu":
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def selected_shapes(args: argparse.Namespace) -> list[Shape]:
    if args.arch:
        name = f"{args.arch}-{args.layers}x{args.width}-T{args.seq_len}-B{args.batch_size * args.accum}"
        if args.accum > 1:
            name += f"-accum{args.accum}"
        if args.untied and args.arch == "gpt2":
            name += "-untied"
        vocab = args.vocab if args.arch != "bert" or args.vocab != 50257 else 30522
        return [Shape(name, args.arch, args.layers, args.width, args.heads, vocab, args.seq_len, args.batch_size,
                      tied=not args.untied, accum=args.accum)]
    preset = args.preset or ("gpu" if args.device.startswith("cuda") else "cpu-quick")
    shapes = PRESETS[preset]
    if args.shapes:
        shapes = [s for s in shapes if s.name in args.shapes]
    if args.tiny:
        shapes = [replace(s, name=s.name + "-tiny", layers=1, width=64, heads=2, vocab=1000,
                          seq_len=min(s.seq_len, 32), batch_size=min(s.batch_size, 4)) for s in shapes]
    return shapes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("hf_dp").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if args.child:
        print(json.dumps(child_main(args)), flush=True)
        return 0
    shapes = selected_shapes(args)
    if args.profile:
        md = []
        for shape in shapes:
            phases = {method: profile_method(method, shape, args) for method in args.profile}
            md.append(phase_table(shape, phases))
            print("\n" + md[-1], flush=True)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(f"Command: `python benchmarks/run.py {' '.join(sys.argv[1:])}`\n\n" + "\n".join(md))
        return 0
    env = environment()
    print("environment:", json.dumps(env), flush=True)
    print("command: python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:]), flush=True)
    t0 = time.perf_counter()
    results = []
    for shape in shapes:
        results.append(benchmark_shape(shape, args))
        print("\n" + markdown(results[-1], torch.device(args.device).type), flush=True)
    env["wall_time_s"] = f"{time.perf_counter() - t0:.0f}"
    print(f"total wall time {env['wall_time_s']} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": env, "argv": sys.argv[1:], "settings": {k: v for k, v in vars(args).items()},
                       "results": results}, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"Command: `python benchmarks/run.py {' '.join(sys.argv[1:])}`\n\n")
            f.write("Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()) + "\n\n")
            for r in results:
                f.write(markdown(r, torch.device(args.device).type) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
