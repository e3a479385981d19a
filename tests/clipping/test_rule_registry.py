"""The public layer-rule registry (issue #23): ``hf_dp.register_layer_rule`` and the built-in dispatch order.

A user's own layer with a registered rule is exact against the float64 oracle (σ = 0, q = 1: the DP update is the
clipped sum of each example's gradient of the model's own loss on a batch of one) and is computed by that rule, not
by the generic fallback; without the rule the same layer goes to the fallback. A wrong rule is refused by the
first-step checks, never trusted. Registration is checked (duplicates, reserved names) and undoable.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from helpers import REPO, VOCAB, cls_dataset, dp_args, group_clipped_sum, per_example_grads, sorted_norms
from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutput
from transformers.pytorch_utils import Conv1D

import hf_dp
from hf_dp import DPTrainer, UnsupportedLayerError, Use, register_layer_rule
from hf_dp.clipping.engine import ClippingEngine
from hf_dp.clipping.rules import BUILTIN_ORDER, find_rule, layer_rule_names

N = 4


@pytest.fixture(autouse=True)
def no_rule_leaks():
    """Every test leaves the registry as it found it: the built-in rules only."""
    assert layer_rule_names() == list(BUILTIN_ORDER)
    yield
    assert layer_rule_names() == list(BUILTIN_ORDER), "a test left a user rule registered"


# ------------------------------------------------------------------------------------------------ a user's own layer
class ScaledLinear(nn.Module):
    """``y = x (s ⊙ W)ᵀ``: a weight and a per-output scale ``s`` of shape ``(d_out, 1)`` (no built-in rule covers it:
    its parameters are not a weight/bias pair)."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in ** 0.5)
        self.scale = nn.Parameter(torch.rand(d_out, 1) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.scale * self.weight).T


CALLS = {"n": 0}


def scaled_linear_rule(module: ScaledLinear, name: str, inp: torch.Tensor, out, grad: torch.Tensor) -> list[Use]:
    """``G_W = (g ⊙ sᵀ)ᵀ x`` (``∂y_tj/∂W_jk = s_j x_tk``), ``G_s = Σ_t g_t ⊙ (W x_t)`` (``∂y_tj/∂s_j = (W x_t)_j``)."""
    CALLS["n"] += 1
    d_out, d_in = module.weight.shape
    x = inp.reshape(inp.shape[0], -1, d_in)
    g = grad.reshape(grad.shape[0], -1, d_out)
    s, w = module.scale.detach().reshape(1, 1, d_out), module.weight.detach()
    return [Use(module.weight, g * s, x, d_out, name), Use(module.scale, None, g * (x @ w.T), 1, name)]


def forgets_scale(module, name, inp, out, grad):
    """Wrong: the weight's left factor lacks the scale (as a rule missing a factor of 2 would be)."""
    uses = scaled_linear_rule(module, name, inp, out, grad)
    g = grad.reshape(grad.shape[0], -1, module.weight.shape[0])
    return [Use(module.weight, g, uses[0].right, uses[0].left_dim, name), uses[1]]


def mixes_examples(module, name, inp, out, grad):
    """Wrong: every example gets the batch's mean scale gradient. Its sum over the batch is right (the hooks-vs-
    autograd check passes); each example's gradient is not."""
    uses = scaled_linear_rule(module, name, inp, out, grad)
    mean = uses[1].right.mean(0, keepdim=True).expand_as(uses[1].right)
    return [uses[0], Use(module.scale, None, mean, 1, name)]


def other_parameter(module, name, inp, out, grad):
    """Wrong: a Use for a parameter the layer does not own."""
    u = scaled_linear_rule(module, name, inp, out, grad)[0]
    return [Use(nn.Parameter(torch.zeros_like(module.weight)), u.left, u.right, u.left_dim, name)]


def wrong_left_dim(module, name, inp, out, grad):
    u = scaled_linear_rule(module, name, inp, out, grad)
    return [Use(u[0].param, u[0].left[..., :-1], u[0].right, u[0].left_dim - 1, name), u[1]]


def not_a_list(module, name, inp, out, grad):
    return scaled_linear_rule(module, name, inp, out, grad)[0]


class Classifier(nn.Module):
    """Embedding → ``mix`` (a ScaledLinear by default; called with ``extra`` inputs after the first) → tanh → masked
    mean → Linear head; returns its own mean cross-entropy ``loss``."""

    def __init__(self, d: int = 8, labels: int = 3, mix: nn.Module | None = None, extra: tuple = ()):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.mix = ScaledLinear(d, d) if mix is None else mix
        self.head = nn.Linear(d, labels)
        self.extra = extra

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = torch.tanh(self.mix(self.embed(input_ids), *self.extra))
        m = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        m = m.unsqueeze(-1).to(h.dtype)
        logits = self.head((h * m).sum(1) / m.sum(1))
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def classifier(mix: Callable[[], nn.Module] | None = None, extra: tuple = ()) -> Classifier:
    torch.manual_seed(0)
    return Classifier(mix=None if mix is None else mix(), extra=extra).double()


class Block(nn.Module):
    """A ScaledLinear nested in a block without parameters of its own: a parameter its rule gets wrong could be moved
    to the block's re-run per example (the engine's enclosing-module fallback), which would hide the wrong rule."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.inner = ScaledLinear(d, d)

    def forward(self, x):
        return self.inner(x) * 2.0


class ProjectThenScale(ScaledLinear):
    """``y = proj(x) (s ⊙ W)ᵀ``: a layer with a parametrised child (its own rule: ``linear``), which the registry's
    re-run of the layer cannot run without firing the engine's hooks on it: its rule is checked by the engine alone."""

    def __init__(self, d: int = 8):
        super().__init__(d, d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        return super().forward(self.proj(x))


def project_then_scale_forgets_scale(module, name, inp, out, grad):
    h = F.linear(inp, module.proj.weight.detach(), module.proj.bias.detach())  # not module.proj(...): hooked
    return forgets_scale(module, name, h, out, grad)


def project_then_scale_rule(module, name, inp, out, grad):
    h = F.linear(inp, module.proj.weight.detach(), module.proj.bias.detach())
    return scaled_linear_rule(module, name, h, out, grad)


class Noisy(ScaledLinear):
    def forward(self, x):
        return F.dropout(super().forward(x), 0.5, self.training)


class Gained(ScaledLinear):
    def forward(self, x, gain):
        return super().forward(x) * gain


def per_example_ce(outputs, labels):
    return F.cross_entropy(outputs.logits, labels, reduction="none")


def median_norm(grads, names: list[str]) -> float:
    return sorted_norms(grads, names)[N // 2 - 1] + 1e-9


def dp_step(model: nn.Module, tmp_path, clipping: str) -> tuple[DPTrainer, dict, dict]:
    """One DP step over the N examples (q = 1, σ = 0, SGD lr 1, two micro-batches of two); returns the trainer, the
    update and the oracle's expected update (about half the examples clipped, per group for per-layer)."""
    data = cls_dataset(N, num_labels=3)
    grads = per_example_grads(model, data, list(range(N)))
    names = list(grads[0])
    args = dp_args(tmp_path, 2, N // 2, median_norm(grads, names), clipping=clipping)
    trainer = DPTrainer(model=model, args=args, train_dataset=data, per_example_loss=per_example_ce)
    if clipping == "flat":
        groups, thresholds = [names], [args.per_sample_max_grad_norm]
    else:
        groups = [g.params for g in trainer.group_clipper.groups]
        thresholds = [median_norm(grads, g) for g in groups]
        trainer.group_clipper.thresholds = torch.tensor(thresholds, dtype=torch.float64)
    expected = {n: t / N for n, t in group_clipped_sum(grads, groups, thresholds).items()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    update = {n: before[n] - p.detach() for n, p in model.named_parameters()}
    return trainer, update, expected


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_registered_rule_is_exact_and_is_what_computes_the_layer(tmp_path, caplog, clipping):
    model = classifier()
    CALLS["n"] = 0
    with register_layer_rule(ScaledLinear, scaled_linear_rule, params=("weight", "scale")), \
            caplog.at_level(logging.WARNING, logger="hf_dp"):
        assert find_rule(model.mix).name == "ScaledLinear"
        trainer, update, expected = dp_step(model, tmp_path, clipping)
    for n, u in update.items():
        torch.testing.assert_close(u, expected[n], rtol=1e-7, atol=1e-10, msg=n)
    assert CALLS["n"] >= N // 2 + 1  # the rule factored the layer: the first-step check's call and each micro-batch
    assert "generic fallback" not in caplog.text  # no module re-run per example: the rule, not the fallback
    if clipping == "per_layer":  # the layer is one group of its own, both parameters in it
        assert ["mix.weight", "mix.scale"] in [sorted(g.params, reverse=True) for g in trainer.group_clipper.groups]


def run_first_step(model: nn.Module) -> ClippingEngine:
    """The engine's always-on first-step checks on two examples, then a recorded micro-batch of four."""
    data = cls_dataset(N, num_labels=3)
    ids, mask = torch.tensor(data["input_ids"]), torch.tensor(data["attention_mask"])
    labels = torch.tensor(data["labels"])

    def run(sl):
        return per_example_ce(model(ids[sl], mask[sl]), labels[sl])

    engine = ClippingEngine(model)
    engine.first_step_check(run, N)
    return engine


def test_without_the_rule_the_layer_goes_to_the_fallback(caplog):
    model = classifier()
    CALLS["n"] = 0
    assert find_rule(model.mix) is None
    with caplog.at_level(logging.WARNING, logger="hf_dp"):
        run_first_step(model)
    assert "generic fallback" in caplog.text and "mix (ScaledLinear" in caplog.text
    assert CALLS["n"] == 0


@pytest.mark.parametrize("nested", [False, True])
def test_rule_missing_a_factor_is_refused(nested):
    """Refused by the registry's check of the rule against autograd on the layer re-run for example 0 — also when the
    layer sits in a block whose re-run per example could have taken over the parameter (the engine's enclosing
    fallback would then hide the wrong rule behind a log line that blames a use outside the layer)."""
    model = classifier(Block if nested else None)
    where = r"mix\.inner \(ScaledLinear\)" if nested else r"mix \(ScaledLinear\)"
    with register_layer_rule(ScaledLinear, forgets_scale, params=("weight", "scale")):
        with pytest.raises(UnsupportedLayerError, match=where + r".*gradient of 'weight' that differs from autograd's"
                           r" for the layer re-run on that example"):
            run_first_step(model)
    with register_layer_rule(ScaledLinear, scaled_linear_rule, params=("weight", "scale")):
        run_first_step(model)  # the right rule passes the same checks


def test_rule_missing_a_factor_is_refused_by_the_engine_where_the_layer_cannot_be_re_run():
    """A layer with a parametrised child is not re-run by the registry; the engine's hooks-vs-autograd check (the
    sum of the per-example gradients against autograd's gradient) refuses the wrong rule."""
    model = classifier(ProjectThenScale)
    with register_layer_rule(ProjectThenScale, project_then_scale_forgets_scale, params=("weight", "scale")):
        with pytest.raises(UnsupportedLayerError, match=r"differs from autograd's gradient[\s\S]*mix\.weight"):
            run_first_step(model)
    with register_layer_rule(ProjectThenScale, project_then_scale_rule, params=("weight", "scale")):
        run_first_step(model)


@pytest.mark.parametrize("layer, extra, message", [
    (Noisy, (), "re-running the layer on the same input gives another output"),
    (Gained, (torch.tensor(2.0, dtype=torch.float64),), "could not be checked: re-running the layer's forward on "
     r"example 0's first input failed \(TypeError"),
])
def test_layer_a_rule_cannot_be_checked_on_is_refused(layer, extra, message):
    """A random layer (its rule cannot know the draws) and one whose forward needs more than its first input (the
    rule's only input) are refused, with that cause."""
    with register_layer_rule(layer, scaled_linear_rule, params=("weight", "scale")):
        with pytest.raises(UnsupportedLayerError, match=message):
            run_first_step(classifier(lambda: layer(8, 8), extra))


@pytest.mark.parametrize("factor, message", [
    (mixes_examples, r"gives example 0 a different gradient in a micro-batch of 2 than from its rows alone"),
    (other_parameter, r"not one of the layer's own weight, scale"),
    (wrong_left_dim, r"per-example gradient has 56 values for a parameter of shape \(8, 8\)"),
    (not_a_list, r"returned Use, not a list of hf_dp.Use"),
])
def test_rule_that_mixes_examples_or_misshapes_its_factors_is_refused(factor, message):
    """Refused by the registry's own checks on a user rule's first call (the mixing rule passes the engine's
    hooks-vs-autograd check: its batch sum is right)."""
    with register_layer_rule(ScaledLinear, factor, params=("weight", "scale"), name="scaled"):
        with pytest.raises(UnsupportedLayerError, match=message) as err:
            run_first_step(classifier())
    assert "'scaled'" in str(err.value) and "mix (ScaledLinear)" in str(err.value)


def test_verify_refuses_a_layer_its_rule_does_not_fit():
    def verify(module, name, inp, out):
        if module.scale.abs().max() > 1e3:
            raise UnsupportedLayerError(f"{name}: scale too large for this rule")

    model = classifier()
    with torch.no_grad():
        model.mix.scale.fill_(1e4)
    with register_layer_rule(ScaledLinear, scaled_linear_rule, params=("weight", "scale"), verify=verify):
        with pytest.raises(UnsupportedLayerError, match="mix: scale too large"):
            run_first_step(model)


# ------------------------------------------------------------------------------------------------- registration
def test_duplicates_and_reserved_names_are_refused():
    with register_layer_rule(ScaledLinear, scaled_linear_rule, params=("weight", "scale")):
        with pytest.raises(ValueError, match="'ScaledLinear' is already registered"):
            register_layer_rule(ScaledLinear, scaled_linear_rule)
        with pytest.raises(ValueError, match=r"ScaledLinear already has a registered rule \('ScaledLinear'\)"):
            register_layer_rule(ScaledLinear, scaled_linear_rule, name="again")
    for name in ("linear", "affine_norm", "fallback"):
        with pytest.raises(ValueError, match="name of a built-in rule"):
            register_layer_rule(ScaledLinear, scaled_linear_rule, name=name)
    with pytest.raises(ValueError, match="needs name="):
        register_layer_rule(lambda m: isinstance(m, ScaledLinear), scaled_linear_rule)
    with pytest.raises(TypeError, match="nn.Module subclasses"):
        register_layer_rule(int, scaled_linear_rule)
    with pytest.raises(ValueError, match="params must name"):
        register_layer_rule(ScaledLinear, scaled_linear_rule, params=())


def test_registration_is_undoable():
    mix = ScaledLinear(2, 2)
    handle = register_layer_rule(ScaledLinear, scaled_linear_rule, params=("weight", "scale"))
    assert find_rule(mix) is handle.rule and layer_rule_names()[0] == "ScaledLinear"
    handle.remove()
    assert find_rule(mix) is None
    handle.remove()  # a second removal does nothing
    register_layer_rule(ScaledLinear, scaled_linear_rule, name="by_name")
    hf_dp.unregister_layer_rule("by_name")
    assert find_rule(mix) is None
    with pytest.raises(KeyError, match="no user layer rule named 'by_name'"):
        hf_dp.unregister_layer_rule("by_name")
    with register_layer_rule(ScaledLinear, scaled_linear_rule):
        assert find_rule(mix).name == "ScaledLinear"
    assert find_rule(mix) is None


class MyLinear(nn.Linear):
    def forward(self, x):
        return x @ self.weight.T + self.bias


class MyLinearChild(MyLinear):
    def forward(self, x):
        return super().forward(x) * 2


def test_user_rules_come_first_in_registration_order():
    assert find_rule(MyLinear(2, 2)).name == "linear_subclass"
    with register_layer_rule(MyLinear, scaled_linear_rule) as mine:
        assert find_rule(MyLinear(2, 2)) is mine.rule  # before the built-in linear_subclass rule
        assert find_rule(MyLinearChild(2, 2)).name == "linear_subclass"  # its own forward: not matched by the class
        assert find_rule(nn.Linear(2, 2)).name == "linear"
        with register_layer_rule(lambda m: isinstance(m, nn.Linear), scaled_linear_rule, name="any_linear") as anyl:
            assert layer_rule_names()[:2] == ["MyLinear", "any_linear"]
            assert find_rule(MyLinear(2, 2)) is mine.rule  # first registered, first matched
            assert find_rule(MyLinearChild(2, 2)) is anyl.rule
            assert find_rule(nn.Linear(2, 2)) is anyl.rule  # over the built-in exact-type rule too
    assert find_rule(MyLinear(2, 2)).name == "linear_subclass"


# -------------------------------------------------------------------------------------- the built-in dispatch order
class OwnEmbedding(nn.Embedding):
    def forward(self, ids):
        return super().forward(ids) * 2.0


class GatedNorm(nn.Module):
    def __init__(self, d: int = 4):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x, gate):
        return self.weight * x * torch.sigmoid(gate)


def representative_modules() -> list[tuple[nn.Module, str | None, bool]]:
    """(module, the rule's name, whether the rule gets every input) — as the if-chain before the registry chose."""
    moe = tf.MixtralForCausalLM(tf.MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2)).model.layers[0]
    phimoe_router = tf.models.phimoe.modeling_phimoe.PhimoeTopKRouter(tf.PhimoeConfig(
        hidden_size=16, num_local_experts=4, num_experts_per_tok=2))
    falcon_linear = tf.models.falcon.modeling_falcon.FalconLinear(4, 4)
    return [
        (nn.Linear(3, 4), "linear", False), (Conv1D(4, 3), "hf_conv1d", False),
        (falcon_linear, "linear_subclass", False), (phimoe_router, "router", False), (moe.mlp.gate, "router", False),
        (moe.mlp.experts, "experts", True), (nn.Embedding(5, 3), "embedding", False),
        (OwnEmbedding(5, 3), "embedding_calls", False), (nn.LayerNorm(3), "layer_norm", False),
        (moe.input_layernorm, "affine_norm", False), (GatedNorm(), "affine_norm", True),
        (nn.Conv1d(2, 2, 3), "conv", False), (nn.Conv2d(2, 2, 3), "conv", False), (nn.Conv3d(2, 2, 3), None, False),
        (nn.BatchNorm1d(3), None, False), (nn.GroupNorm(1, 2), None, False), (nn.LSTM(2, 3), None, False),
        (ScaledLinear(2, 2), None, False), (nn.Bilinear(2, 2, 3), None, False),
    ]


def test_builtin_rules_dispatch_as_before():
    """The rule names the hand-written if-chain returned before the registry (checked once against a saved copy of
    it over every module of the zoo and test models: 1499 modules, no difference), for one module of each kind."""
    for module, name, all_inputs in representative_modules():
        rule = find_rule(module)
        assert (None if rule is None else rule.name) == name, type(module).__name__
        assert rule is None or rule.all_inputs == all_inputs, type(module).__name__


# -------------------------------------------------------------------------------------------------- the README
def readme_example() -> str:
    """The code block of the README's section "Your own layers: register a rule"."""

    path = REPO / "README.md"
    with open(path, encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## Your own layers: register a rule"):]
    return section[section.index("```python") + len("```python"):section.index("```\n", section.index("```python") + 9)]


def test_readme_example_registers_an_exact_rule():
    """The README's example, run as written, registers a rule that passes the first-step checks and gives each
    example's gradient (against a loop over single examples, float64)."""
    namespace: dict = {}
    exec(compile(readme_example(), "README.md", "exec"), namespace)
    try:
        torch.manual_seed(0)
        layer = namespace["ScaledLinear"](3, 4).double()
        with torch.no_grad():
            layer.scale.uniform_(0.5, 2.0)
        assert find_rule(layer).name == "ScaledLinear"
        model, x = nn.Sequential(layer), torch.randn(3, 5, 3, dtype=torch.float64)

        def run(sl):
            return torch.tanh(model(x[sl])).pow(2).sum((1, 2))

        engine = ClippingEngine(model)
        engine.first_step_check(run, 3)
        with engine.record(3):
            run(slice(0, 3)).sum().backward()
        norms = engine.per_example_norms_sq()
        for i in range(3):
            layer.zero_grad()
            run(slice(i, i + 1)).sum().backward()
            for name, p in (("0.weight", layer.weight), ("0.scale", layer.scale)):
                torch.testing.assert_close(norms[name][i], p.grad.pow(2).sum(), rtol=1e-9, atol=1e-12)
    finally:
        hf_dp.unregister_layer_rule("ScaledLinear")
