"""The coverage plan of a model: which hook computes which trainable parameter's per-example gradient.

Every module that owns a trainable parameter gets its layer rule (``rules/``) or, with none, the generic exact
fallback (``fallback.py``: re-run per example under ``torch.func``; ``recurrent.py`` for RNNs). A parameter its
module's rule does not cover gets a side fallback (the module re-run for it alone). A parameter whose uses its
owner's rule cannot see whole (read directly by an ancestor, a parametrization, used with no batch axis) is computed by
the fallback of its smallest enclosing module that treats examples independently (the enclosing-module fallback,
found statically here or by the first-step checks: :meth:`CoveragePlan.enclose`). Nothing is skipped silently
(DESIGN invariant 3).

A plan does not change once built: enclosing parameters returns a new plan (the recorder and the checks then use it).
"""

from __future__ import annotations

import re

from torch import nn

from .fallback import Fallback
from .recurrent import fallback_for
from .rules import Rule, UnsupportedLayerError, Use, find_rule, rule_parameters

__all__ = ["CoveragePlan", "uses_batch_statistics", "with_enclosable"]


def with_enclosable(err: UnsupportedLayerError, names: list[str]) -> UnsupportedLayerError:
    """Mark a first-step refusal that re-running an enclosing module per example might resolve
    (:meth:`CoveragePlan.enclose`): the qualified names of the parameters concerned."""
    err.enclosable = list(names)
    return err


def uses_batch_statistics(module: nn.Module) -> bool:
    """BatchNorm (any dimension, Sync, Lazy) normalises with statistics over the batch in train mode, and
    InstanceNorm with ``track_running_stats`` updates running statistics from the data."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return True
    return isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats


def _no_uses(*_args) -> list[Use]:  # the fallback's uses come from its own hook (fallback.py)
    return []


def _is_descendant(module: nn.Module, ancestor: nn.Module) -> bool:
    return any(m is module for m in ancestor.modules())


def _parent(name: str) -> str | None:
    """The qualified name of a module's parent (``""`` for the model), ``None`` for the model itself."""
    return None if not name else name.rpartition(".")[0]


def _common_ancestor(names: list[str]) -> str:
    """The qualified name of the smallest module containing all of ``names`` (one of them, or an ancestor)."""
    parts = [n.split(".") if n else [] for n in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


class CoveragePlan:
    """Which hook computes which trainable parameter's per-example gradients (see the module docstring).

    Args:
        model: the (unwrapped) model.
        params: its trainable parameters by qualified name; ``names``: parameter id → that name.
        enclosure: parameter id → qualified name of the module whose forward, re-run per example, gives its
            per-example gradient (its owner's rule then no longer records it); default: the static enclosures.
        host: passed to ``recurrent.fallback_for`` (the engine: a recurrent fallback refuses packed rows).
        broadcast_methods: the names of the methods ``broadcast.py`` patches; a module with one of them that
            contains a hooked layer is listed in :attr:`broadcast_owners`.

    Attributes: :attr:`layers` ``[(module name, module, rule)]`` (a rule named ``"fallback"`` for a module whose
    parameters a fallback computes), :attr:`fallbacks` (by module id, a side fallback by its own id), :attr:`side_of`
    (ruled module id → its side fallback), :attr:`dormant` (ruled modules whose rule records no trainable parameter),
    :attr:`owners` (parameter id → its owning modules, for messages), :attr:`problems` and :attr:`batch_stats`
    (refused by the engine).
    """

    def __init__(self, model: nn.Module, params: dict[str, nn.Parameter], names: dict[int, str],
                 enclosure: dict[int, str] | None = None, host=None, broadcast_methods: tuple[str, ...] = ()):
        self.model = model
        self.params = params
        self.names = names
        self.host = host
        self.broadcast_methods = broadcast_methods
        self.enclosure: dict[int, str] = self._static_enclosures() if enclosure is None else dict(enclosure)
        self._build()

    def _build(self) -> None:
        model = self.model
        self.layers: list[tuple[str, nn.Module, Rule]] = []
        self.fallbacks: dict[int, Fallback] = {}
        self.dormant: set[int] = set()  # ruled modules whose rule records no trainable parameter: rule not hooked
        #: ruled module id -> the fallback for its trainable parameters its rule does not cover (a side fallback,
        #: kept in fallbacks under its own id: the module's rule hook numbers the module's calls)
        self.side_of: dict[int, Fallback] = {}
        self.enclosed = set(self.enclosure)
        self.problems: list[str] = []
        self.batch_stats: list[str] = []
        self.owners: dict[int, list[str]] = {}
        extra: dict[str, list[str]] = {}  # enclosing module -> paths (relative to it) of the parameters it computes
        for pid, mname in self.enclosure.items():
            module = model.get_submodule(mname)
            path = next(n for n, q in module.named_parameters(remove_duplicate=False) if id(q) == pid)
            if path not in extra.setdefault(mname, []):
                extra[mname].append(path)
        for name, module in model.named_modules():
            if uses_batch_statistics(module):
                self.batch_stats.append(f"{name} ({type(module).__name__})")
            own = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]
            for _n, p in own:
                self.owners.setdefault(id(p), []).append(f"{name} ({type(module).__name__})")
            kept = [(n, p) for n, p in own if id(p) not in self.enclosed]
            inner = tuple(extra.get(name, ()))
            if not own and not inner:
                continue
            rule = find_rule(module)
            if inner:  # an enclosing module (never ruled, never the model: see enclose)
                fb = Fallback(module, name, tuple(n for n, _ in kept) + inner)
                self.fallbacks[id(module)] = fb
                # its Rule lists its own parameters only: groups (modes.py) keep an enclosed parameter in its owner's
                self.layers.append((name, module, Rule("fallback", _no_uses, tuple(n for n, _ in own))))
                continue
            if rule is None and module is model:
                self.problems.append(
                    f"{', '.join(n for n, _ in own)} ({type(module).__name__}: parameters of the model itself; hf_dp's "
                    "generic fallback would re-run the whole model per example. Move them into a submodule or freeze "
                    "them)")
                continue
            if rule is None:
                rule = Rule("fallback", _no_uses, tuple(n for n, _ in own))
                if kept:  # recurrent.py for RNNs
                    self.fallbacks[id(module)] = fallback_for(module, name, tuple(n for n, _ in kept), self.host)
                else:
                    self.dormant.add(id(module))
                self.layers.append((name, module, rule))
                continue
            if rule.check is not None:
                rule.check(module, name)
            ruled = rule_parameters(rule, module)
            uncovered = tuple(n for n, _ in kept if n not in ruled)
            if ruled:
                if not any(n in ruled for n, _ in kept):
                    self.dormant.add(id(module))  # its rule's hook is not needed (a side fallback may still be)
                self.layers.append((name, module, rule))
            if uncovered and module is model:
                self.problems += [f"{name}.{n} ({type(module).__name__}: its {rule.name!r} rule covers "
                                  f"{', '.join(rule.params)} only)" for n in uncovered]
            elif uncovered:
                # A side fallback: the module itself re-run per example for the parameters its rule does not cover
                # (an embedding's extra vector, a router's scale), next to its rule's hook for the others; verified
                # on the first step like any fallback, and moved to an enclosing module if it cannot be
                # (first_step_check). Its entry lists the rule's parameters too, so per-layer groups keep the layer.
                fb = Fallback(module, name, uncovered, ruled=rule.name)
                self.fallbacks[id(fb)] = fb
                self.side_of[id(module)] = fb
                self.layers.append((name, module, Rule("fallback", _no_uses, tuple(rule.params) + uncovered)))
        self.broadcast_owners = [
            m for m in model.modules() if any(callable(getattr(m, k, None)) for k in self.broadcast_methods)
            and any(r is not m and id(r) not in self.dormant and _is_descendant(r, m) for _, r, _ in self.layers)]

    def keeps(self, param) -> bool:
        """Whether a rule records this parameter: trainable, and not computed by an enclosing module's fallback."""
        return id(param) in self.names and id(param) not in self.enclosed

    def owned(self, module: nn.Module, rule: Rule) -> list[str]:
        """The qualified names of the parameters of ``module`` that its ``rule`` records."""
        return [self.names[id(getattr(module, n))] for n in rule.params
                if getattr(module, n, None) is not None and self.keeps(getattr(module, n))]

    def layer_parameters(self) -> list[tuple[str, list[str]]]:
        """``[(module name, names of its trainable parameters its entry lists)]`` per entry of :attr:`layers`."""
        out = []
        for mname, module, rule in self.layers:
            out.append((mname, [self.names[id(getattr(module, n))] for n in rule.params
                                if getattr(module, n, None) is not None and id(getattr(module, n)) in self.names]))
        return out

    # ------------------------------------------------------------------ enclosing-module fallbacks
    def _static_enclosures(self) -> dict[int, str]:
        """Parameters whose uses no layer hook can see, known without running the model: a parametrization's
        ``original*`` tensors (weight norm: read through the parametrized module's attribute, computed by a
        ``ParametrizationList`` that is called with no input) and the children of ``nn.MultiheadAttention`` (its
        forward applies ``out_proj.weight`` with a functional call). They go to the fallback of the smallest
        enclosing module that can be re-run per example (verified on the first step like any fallback)."""
        from torch.nn.utils.parametrize import ParametrizationList

        enclosure: dict[int, str] = {}
        for name, module in self.model.named_modules():
            if isinstance(module, ParametrizationList) or isinstance(module, nn.MultiheadAttention):
                inner = [(n, p) for n, p in module.named_parameters() if id(p) in self.names]
                if isinstance(module, nn.MultiheadAttention):
                    inner = [(n, p) for n, p in inner if "." in n]  # its children's (out_proj), not its own
                for _n, p in inner:
                    if id(p) not in enclosure:
                        target = self._enclosing_candidate(name if isinstance(module, nn.MultiheadAttention)
                                                           else _parent(name), start_inclusive=True)
                        if target is not None:
                            enclosure[id(p)] = target
        return enclosure

    def _enclosing_candidate(self, name: str | None, start_inclusive: bool = False) -> str | None:
        """The nearest module at or above ``name`` (above it unless ``start_inclusive``) that can host an enclosing
        fallback: called with the examples (not a container: ``ModuleList``, ``ModuleDict``, ``ParametrizationList``),
        without a layer rule (a rule factors its own parameters only), not recurrent, and not the model itself
        (re-running the whole model per example is refused: :class:`~hf_dp.clipping.engine.ClippingEngine`)."""
        from torch.nn.utils.parametrize import ParametrizationList

        if name is None:
            return None
        if not start_inclusive:
            name = _parent(name)
        while name:
            module = self.model.get_submodule(name)
            if not isinstance(module, (nn.ModuleList, nn.ModuleDict, ParametrizationList, nn.RNNBase)) \
                    and find_rule(module) is None:
                return name
            name = _parent(name)
        return None

    def _same_role(self, names: list[str]) -> list[str]:
        """``names`` and the parameters in the same role elsewhere (the same qualified name up to the indices of
        repeated blocks, at the same stage of enclosure): a refusal raised during the forward names the first offending
        module only (Swin's relative position table of block 0), and its twins in the other blocks would otherwise each
        cost one more round of first-step checks. The re-run check verifies every one of them."""
        def role(n: str) -> tuple[str, bool]:
            return re.sub(r"(?<=\.)\d+(?=\.)", "*", "." + n), self.enclosure.get(id(self.params[n])) is None

        roles = {role(n) for n in names if n in self.params}
        return list(names) + [n for n in self.params if n not in names and role(n) in roles]

    def enclose(self, names: list[str]) -> CoveragePlan | None:
        """A new plan in which each named parameter (and its twins in repeated blocks) is computed one enclosing
        module up: from its owners' rule to their smallest common ancestor's fallback, or from its current enclosing
        module to the next. ``None`` when some parameter has no enclosing module left, or the new plan leaves a
        parameter uncovered (the refusal that asked for it then stands)."""
        moves = {}
        for full in self._same_role(names):
            p = self.params.get(full)
            if p is None:
                return None
            current = self.enclosure.get(id(p))
            if current is None:
                owners = [n for n, m in self.model.named_modules()
                          if any(q is p for q in m.parameters(recurse=False))]
                common = _common_ancestor(owners)
                target = self._enclosing_candidate(common, start_inclusive=common not in owners)
            else:
                target = self._enclosing_candidate(current)
            if target is None:
                return None
            moves[id(p)] = target
        plan = CoveragePlan(self.model, self.params, self.names, {**self.enclosure, **moves}, self.host,
                            self.broadcast_methods)
        return None if plan.problems else plan
