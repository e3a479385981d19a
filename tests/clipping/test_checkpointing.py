"""Activation checkpointing under DP (issue #24, item 1): exact, and the recorded inputs are the recomputed ones.

``DPTrainingArguments(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": ...})`` turns on
transformers' checkpointing of every decoder block; hf_dp records a layer's input as a saved tensor of the graph
(``hf_dp/clipping/checkpointing.py``), so the segment's recompute in the backward provides it. Oracle: the model's own
loss on a batch of one, differentiated by autograd in float64 on the model *without* checkpointing (σ = 0, q = 1, SGD
with lr = 1: the update is minus the released gradient).
"""

from __future__ import annotations

import math
import warnings
import weakref

import pytest
import torch
from helpers import (
    CheckpointedBlocks,
    FallbackGate,
    check_exact,
    cls_dataset,
    example_norms,
    flat_clipped_sum,
    group_clipped_sum,
    lm_dataset,
    loop_grads,
    lora_llama,
    per_example_grads,
    tiny_gpt2,
    tiny_llama,
)

from hf_dp import DPTrainer, DPTrainingArguments

MODES = ["flat", "per_layer", "adaptive_per_layer"]


def ckpt_args(tmp_path, c: float, clipping: str, reentrant: bool, per_device: int = 3, ga: int = 2, **kw):
    """Flat clipping here is book-keeping (``flat_clipping_passes="one"``; "auto" would take two passes under
    checkpointing, tested in ``test_two_pass.py``)."""
    if clipping == "flat":
        kw.setdefault("flat_clipping_passes", "one")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DPTrainingArguments(
            output_dir=str(tmp_path), noise_multiplier=0.0, per_sample_max_grad_norm=c, clipping=clipping,
            per_device_train_batch_size=per_device, gradient_accumulation_steps=ga, max_steps=1, learning_rate=1.0,
            optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, use_cpu=True, report_to="none",
            save_strategy="no", dp_seed=0, disable_tqdm=True, gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": reentrant}, **kw)


class Recomputes:
    """Counts the forwards of the model and of a module inside a checkpointed block (transformers checkpoints the
    block's ``forward``, not its ``__call__``: the block's own hooks run once): more calls of the module than of the
    model means the blocks were re-run in the backward (checkpointing was on during the DP step)."""

    def __init__(self, model, block):
        self.model_calls = self.block_calls = 0
        model.register_forward_pre_hook(lambda *_: setattr(self, "model_calls", self.model_calls + 1))
        block.register_forward_pre_hook(lambda *_: setattr(self, "block_calls", self.block_calls + 1))


def check_step(model, block, data, tmp_path, clipping: str, reentrant: bool, **kw):
    """One DP step with checkpointing on equals the float64 oracle; returns the trainer."""
    model = model.double()
    n = len(data)
    grads = per_example_grads(model, data, list(range(n)))  # q = 1: every example; no checkpointing here
    c = sorted(example_norms(grads))[n // 2]  # some examples clipped, some not
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    counter = Recomputes(model, block)
    trainer = DPTrainer(model=model, args=ckpt_args(tmp_path, c, clipping, reentrant, **kw), train_dataset=data)
    if clipping == "flat":
        expected = flat_clipped_sum(grads, c)
    else:  # the groups and thresholds are configuration (as tests/test_groupwise.py reads them)
        groups = [g.params for g in trainer.group_clipper.groups]
        expected = group_clipped_sum(grads, groups, trainer.group_clipper.thresholds.tolist())
    trainer.train()
    assert counter.block_calls > counter.model_calls  # the blocks were recomputed in the backward
    for k, p in model.named_parameters():
        target = expected[k] / n if p.requires_grad else torch.zeros_like(p)
        torch.testing.assert_close(before[k] - p.detach(), target, rtol=1e-7, atol=1e-10, msg=k)
    return trainer


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize("clipping", MODES)
def test_llama_exact_under_checkpointing(tmp_path, clipping, reentrant):
    torch.manual_seed(0)
    model = tiny_llama()
    trainer = check_step(model, model.model.layers[0].self_attn, lm_dataset(6, seed=4), tmp_path, clipping, reentrant)
    assert trainer.accountant.steps == 1


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_gpt2_tied_exact_under_checkpointing(tmp_path, clipping, reentrant):
    """GPT-2: Conv1D layers, tied wte / lm_head (a use outside the blocks and one inside none), learned positions."""
    torch.manual_seed(1)
    model = tiny_gpt2(tied=True)
    check_step(model, model.transformer.h[0].attn, lm_dataset(6, seed=1), tmp_path, clipping, reentrant)


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_lora_exact_under_checkpointing(tmp_path, clipping, reentrant):
    torch.manual_seed(2)
    model = lora_llama(tiny_llama().double())
    block = model.base_model.model.model.layers[0].self_attn
    check_step(model, block, lm_dataset(6, seed=2), tmp_path, clipping, reentrant)


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_first_step_and_counterfactual_checks_run_under_checkpointing(tmp_path, reentrant):
    """dp_self_check (single examples vs batch, the counterfactual of each example collated alone) and the
    always-on first-step coverage check all run with the blocks checkpointed, and the step stays exact."""
    torch.manual_seed(3)
    model = tiny_llama()
    check_step(model, model.model.layers[1].mlp, lm_dataset(6, seed=3), tmp_path, "flat", reentrant, dp_self_check=True)


def test_dropout_recompute_sees_the_same_masks(tmp_path):
    """With dropout on in training, the recomputed segment draws the same masks as the first forward (torch restores
    the RNG state before the recompute): the DP update with checkpointing equals the one without."""
    data = lm_dataset(6, seed=5)
    updates = []
    for ckpt in (False, True):
        torch.manual_seed(5)
        model = tiny_gpt2(tied=False)
        model.config.resid_pdrop = model.config.attn_pdrop = 0.0
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.3
        model = model.double()
        before = {k: p.detach().clone() for k, p in model.named_parameters()}
        args = ckpt_args(tmp_path / str(ckpt), 0.05, "flat", False, seed=7)
        if not ckpt:
            args.gradient_checkpointing = args.activation_checkpointing = False
        torch.manual_seed(6)
        DPTrainer(model=model, args=args, train_dataset=data).train()
        updates.append({k: before[k] - p.detach() for k, p in model.named_parameters()})
    for k in updates[0]:
        assert updates[0][k].abs().max() > 0, k
        torch.testing.assert_close(updates[1][k], updates[0][k], rtol=1e-9, atol=1e-12, msg=k)


def _llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=61, hidden_size=16, intermediate_size=24, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("checkpointing", ["off", "nonreentrant", "reentrant"])
def test_recorded_inputs_live_one_segment_at_a_time(checkpointing):
    """Memory regression: with checkpointing, no input of a recorded layer from the first forward survives the
    forward (the engine holds none), and during the backward with per-layer clipping at most one block's recorded
    input is alive at a time (each layer is clipped inside the backward and its factors freed). Counted by the
    storages of the q_proj inputs (finalizers: alive while any tensor on them is)."""
    from hf_dp.clipping.engine import ClippingEngine
    from hf_dp.clipping.modes import build_groups

    layers = 6
    torch.manual_seed(7)
    model = _llama(layers)
    if checkpointing != "off":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing ==
                                                                           "reentrant"})
    model.train()
    engine = ClippingEngine(model)
    groups = [g.params for g in build_groups(engine, "per_layer")]
    engine.set_fused_groups(groups, lambda k, norms: torch.ones(4, dtype=torch.float64))
    live: set = set()
    during_backward: list[int] = []
    in_backward = [False]

    def track(_mod, args):
        if in_backward[0]:
            during_backward.append(len(live))
        if torch.is_grad_enabled():
            key = object()
            live.add(key)
            weakref.finalize(args[0].untyped_storage(), live.discard, key)

    for layer in model.model.layers:
        layer.self_attn.q_proj.register_forward_pre_hook(track)
    ids = torch.randint(1, 61, (4, 16), generator=torch.Generator().manual_seed(0))
    with engine.record(4):
        logits = model(input_ids=ids).logits
        losses = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:],
                                                   reduction="none").mean(1)
        del logits
        after_forward = len(live)
        in_backward[0] = True
        losses.sum().backward()
    engine.finish_fused()
    if checkpointing == "off":
        assert after_forward == layers  # the counter sees what is kept: every layer's input, as autograd keeps it
    else:
        assert after_forward == 0  # not held from the first forward: it is recomputed
        assert len(during_backward) == layers  # each block re-run once
        assert max(during_backward) <= 1  # the block before has been clipped and freed


class _Blocks(CheckpointedBlocks):
    """A model of the user's own: two blocks, each under ``torch.utils.checkpoint`` (no transformers involved);
    ``twice``: the block's first Linear is also applied to the tokens flattened to ``(B·T, d)`` rows."""

    def __init__(self, reentrant: bool | None, twice: bool = False):
        super().__init__(torch.nn.ModuleList(torch.nn.ModuleDict(
            {"a": torch.nn.Linear(8, 8), "norm": torch.nn.LayerNorm(8), "b": torch.nn.Linear(8, 8)}) for _ in range(2)),
            reentrant)
        self.twice = twice

    def block(self, k: int, h: torch.Tensor) -> torch.Tensor:
        m = self.blocks[k]
        y = m["a"](h)
        if self.twice:
            y = y + m["a"](h.reshape(-1, h.shape[-1])).reshape(h.shape)
        return h + m["b"](torch.tanh(m["norm"](y)))


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_users_own_checkpoint_is_exact(reentrant):
    """``torch.utils.checkpoint`` around a block of a plain ``nn.Module``: per-example norms and the clipped sum equal
    the per-example oracle (each example run alone through the model without checkpointing, autograd)."""
    from hf_dp.clipping.engine import ClippingEngine

    torch.manual_seed(8)
    model = _Blocks(None).double()
    x = torch.randn(4, 5, 3, dtype=torch.float64)
    grads = loop_grads(model, list(x), lambda y: y)  # each example alone, no checkpointing
    norms = torch.tensor(example_norms(grads), dtype=torch.float64)
    c = float(norms.median())
    expected = flat_clipped_sum(grads, c)
    model.reentrant = reentrant
    engine = ClippingEngine(model)
    engine.first_step_check(lambda sl: model(x[sl]), 4)
    with engine.record(4):
        model(x).sum().backward()
    norms_sq = engine.per_example_norms_sq()
    total = torch.stack(list(norms_sq.values())).sum(0).sqrt()
    torch.testing.assert_close(total, norms, rtol=1e-10, atol=1e-12)
    engine.accumulate_clipped((c / (total + 1e-6)).clamp(max=1.0))
    for n, p in model.named_parameters():
        torch.testing.assert_close(engine.summed_grads[n], expected[n], rtol=1e-10, atol=1e-12, msg=n)
        assert p.grad is None


def test_recomputed_call_of_ambiguous_layout_is_refused():
    """A Linear applied twice in a checkpointed block, once per example (B, T, d) and once to the tokens flattened to
    (B·T, d) rows: a recomputed call cannot be matched to its layout, so the reentrant recompute is refused at the
    first step (its input would otherwise be split into examples by the wrong layout)."""
    from hf_dp.clipping.engine import ClippingEngine
    from hf_dp.clipping.layers import UnsupportedLayerError

    torch.manual_seed(9)
    model = _Blocks(True, twice=True).double()
    x = torch.randn(4, 5, 3, dtype=torch.float64)
    engine = ClippingEngine(model)
    with pytest.raises(UnsupportedLayerError, match="re-run by activation checkpointing"):
        engine.first_step_check(lambda sl: model(x[sl]), 4)


@pytest.mark.parametrize("where", ["arguments", "fsdp_plugin"])
def test_checkpointing_under_fsdp_is_refused(where):
    """Under FSDP2 the engine's own hooks (clipping/fsdp.py) have not been made to follow recomputed segments."""
    from types import SimpleNamespace

    from hf_dp.clipping.fsdp import check_fsdp_supported

    args = SimpleNamespace(clipping="flat", privacy_unit="example", activation_checkpointing=where == "arguments",
                           gradient_checkpointing=False)
    plugin = SimpleNamespace(fsdp_version=2, activation_checkpointing=where == "fsdp_plugin")
    with pytest.raises(ValueError, match="does not support activation checkpointing"):
        check_fsdp_supported(plugin, args)
    args.activation_checkpointing = plugin.activation_checkpointing = False
    check_fsdp_supported(plugin, args)  # FSDP2, flat, example level, no checkpointing: accepted


class _SqrtBranch(torch.nn.Module):
    """``L_i = ‖a(x_i)‖² + ‖b(x_i)‖`` (``b`` without bias): for ``x_i = 0`` the loss is finite but ``b.weight``'s
    gradient is NaN (``d‖z‖/dz`` at ``z = 0``), while ``a.bias``'s is finite."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(3, 2)
        self.b = torch.nn.Linear(3, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x).pow(2).sum(1) + self.b(x).pow(2).sum(1).sqrt()


def test_counterfactual_check_clipped_in_backward_gives_a_non_finite_parameter_factor_zero():
    """The counterfactual check clips inside the backward (checkpointing.clipped_in_backward) with its fixed factors:
    an example whose gradient of one parameter is NaN while its loss is finite gets factor 0 for that parameter (as
    in training), so the check passes on an honest model instead of refusing with a false cause (NaN difference);
    a NaN loss (another example) gets factor 0 everywhere."""
    from hf_dp.clipping.engine import ClippingEngine

    torch.manual_seed(10)
    model = _SqrtBranch().double()
    x = torch.randn(4, 3, dtype=torch.float64)
    x[1] = 0.0
    x[3, 0] = math.nan
    losses = model(x).detach()
    assert math.isfinite(float(losses[1])) and math.isnan(float(losses[3]))
    engine = ClippingEngine(model)
    engine.check_counterfactual(lambda: model(x), 4, 4, {i: (lambda i=i: model(x[i:i + 1])) for i in range(4)})
    for p in model.parameters():
        assert p.grad is None


class _ScaledBlocks(_Blocks):
    """``_Blocks`` whose block also multiplies by a trainable vector inside a module without a rule: its parameter is
    computed by the generic fallback (``fallback.py``, re-run per example), inside the checkpointed segment."""

    def __init__(self, reentrant: bool | None):
        super().__init__(reentrant)
        self.scalers = torch.nn.ModuleList(_Scale() for _ in range(2))

    def block(self, k: int, h: torch.Tensor) -> torch.Tensor:
        m = self.blocks[k]
        return h + m["b"](torch.tanh(m["norm"](self.scalers[k](m["a"](h)))))


class _Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.s = torch.nn.Parameter(torch.randn(8))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.s


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_generic_fallback_inside_a_checkpointed_block_is_exact(clipping, reentrant):
    """A module without a rule re-run per example by the generic fallback inside a checkpointed segment: the clipped
    sum (flat: after the backward; per-layer: fused into it, factors 1/2) equals the per-example oracle."""
    from hf_dp.clipping.engine import ClippingEngine
    from hf_dp.clipping.modes import build_groups

    torch.manual_seed(11)
    model = _ScaledBlocks(None).double()
    x = torch.randn(4, 5, 3, dtype=torch.float64)
    grads = loop_grads(model, list(x), lambda y: y)  # each example alone, no checkpointing
    norms = torch.tensor(example_norms(grads), dtype=torch.float64)
    c = float(norms.median())
    model.reentrant = reentrant
    engine = ClippingEngine(model)
    engine.first_step_check(lambda sl: model(x[sl]), 4)
    assert engine._fallbacks  # the scales are computed by the fallback
    if clipping == "per_layer":
        groups = [g.params for g in build_groups(engine, "per_layer")]
        engine.set_fused_groups(groups, lambda k, norms_sq: torch.full((4,), 0.5, dtype=torch.float64))
        expected = {n: sum(0.5 * g[n] for g in grads) for n in grads[0]}
    else:
        expected = flat_clipped_sum(grads, c)
    with engine.record(4):
        model(x).sum().backward()
    if clipping == "per_layer":
        engine.finish_fused()
    else:
        total = torch.stack(list(engine.per_example_norms_sq().values())).sum(0).sqrt()
        torch.testing.assert_close(total, norms, rtol=1e-10, atol=1e-12)
        engine.accumulate_clipped((c / (total + 1e-6)).clamp(max=1.0))
    for n in expected:
        torch.testing.assert_close(engine.summed_grads[n], expected[n], rtol=1e-10, atol=1e-12, msg=n)


class _SharedScaleBlocks(_Blocks):
    """``_Blocks`` whose two blocks call ONE module without a rule (the generic fallback): its parameter's uses come
    from two checkpointed segments, re-run one at a time in the backward."""

    def __init__(self, reentrant: bool | None):
        super().__init__(reentrant)
        self.gate = FallbackGate()

    def block(self, k: int, h: torch.Tensor) -> torch.Tensor:
        m = self.blocks[k]
        return h + m["b"](torch.tanh(m["norm"](self.gate(m["a"](h)))))


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_a_fallback_shared_by_two_checkpointed_blocks_is_clipped_once_per_example(reentrant):
    """Per-layer clipping fused into the backward: a group is clipped only when all its uses have arrived. A module
    without a rule called in two checkpointed blocks: with reentrant checkpointing its first forward runs without
    gradients and each block is re-run separately in the backward; clipping the group at the first re-run's use
    clipped each example's gradient in two parts (one example moved it by 1.27·C). Against the oracle with the
    per-group thresholds at the median norms (some examples clipped, some not), and the group clipped once."""
    from hf_dp.clipping.engine import ClippingEngine
    from hf_dp.clipping.modes import build_groups

    torch.manual_seed(11)
    model = _SharedScaleBlocks(None).double()
    x = torch.randn(4, 5, 3, dtype=torch.float64)
    grads = loop_grads(model, list(x), lambda y: y)  # each example alone, no checkpointing
    model.reentrant = reentrant
    engine = ClippingEngine(model)
    engine.first_step_check(lambda sl: model(x[sl]), 4)
    groups = [g.params for g in build_groups(engine, "per_layer")]
    thresholds = [sorted(math.sqrt(sum(float(g[n].pow(2).sum()) for n in names)) for g in grads)[1] + 1e-3
                  for names in groups]
    clipped = []

    def factors(k, norms_sq):
        clipped.append(k)
        return (thresholds[k] / (torch.stack(list(norms_sq.values())).sum(0).sqrt() + 1e-6)).clamp(max=1.0)

    engine.set_fused_groups(groups, factors)
    with engine.record(4):
        model(x).sum().backward()
    engine.finish_fused()
    gate = next(k for k, names in enumerate(groups) if "gate.s" in names)
    assert clipped.count(gate) == 1
    expected = group_clipped_sum(grads, groups, thresholds)
    for n in expected:
        torch.testing.assert_close(engine.summed_grads[n], expected[n], rtol=1e-10, atol=1e-12, msg=n)


class _OwnClassifier(torch.nn.Module):
    """A module of one's own around a transformers model (a tiny Llama backbone, mean-pooled, a linear head): the
    Trainer cannot enable checkpointing on it (no ``gradient_checkpointing_enable``); one enables it on the backbone."""

    def __init__(self):
        super().__init__()
        self.backbone = _llama(2).model
        self.head = torch.nn.Linear(16, 3)

    def forward(self, input_ids, attention_mask=None, labels=None):
        from transformers.modeling_outputs import SequenceClassifierOutput

        logits = self.head(self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state.mean(1))
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_checkpointing_turned_on_inside_the_model_takes_two_passes_and_is_exact(tmp_path, reentrant):
    """flat_clipping_passes="auto" sees checkpointing turned on on a transformers model inside a module of one's own
    (any module's ``gradient_checkpointing``, what transformers' ``is_activation_checkpointing`` reads), so flat
    clipping takes two passes and keeps the saving; read without transformers' deprecated ``is_gradient_checkpointing``
    (a FutureWarning, gone in transformers 6). The step is exact against the oracle (the module's own loss on a batch
    of one), with the backbone's blocks recomputed in the backward; to 1e-5 as two passes on Llama are (its RMSNorm
    computes in float32, and pass 2 is the model's own batched backward)."""
    from hf_dp.clipping.two_pass import flat_clipping_passes

    torch.manual_seed(10)
    model = _OwnClassifier()
    args = ckpt_args(tmp_path, 1.0, "flat", reentrant, flat_clipping_passes="auto")
    args.gradient_checkpointing = args.activation_checkpointing = False
    assert flat_clipping_passes(args, model) == 1
    model.backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    llama = _llama(1)
    llama.gradient_checkpointing_enable()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert flat_clipping_passes(args, model) == 2
        assert flat_clipping_passes(args, llama) == 2
    counter = Recomputes(model, model.backbone.layers[0].self_attn)
    check_exact(model, cls_dataset(4, num_labels=3, seq_len=6), tmp_path, clipping="flat", rtol=1e-5,
                per_example_loss=lambda out, y: torch.nn.functional.cross_entropy(out.logits, y, reduction="none"))
    assert counter.block_calls > counter.model_calls
