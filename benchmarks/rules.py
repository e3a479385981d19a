#!/usr/bin/env python
"""Micro-benchmarks of the clipping engine's per-layer work (issues 13 and 17). Not part of the test suite.

Two tables, single-thread CPU time (``time.process_time``), medians over interleaved repeats:

* ``--rules``: for one layer of each rule (Conv1d / Conv2d via unfold, depthwise Conv1d, the elementwise-affine norm
  rule, MoE experts + router, the ``torch.func`` fallback) and for an ``nn.Linear`` with about as many parameters on
  the same examples and tokens: the non-private forward + backward (autograd's weight gradients), the DP forward +
  backward under ``ClippingEngine.record`` (hooks, rule factors; the fallback's per-example re-run), the per-example
  norms and the clipped sums (flat clipping, norms after the backward pass), in ms per step and in ns per
  parameter value, and the DP step's time ÷ the non-private one.
* ``--paths``: for the dense layers of the benchmark layouts (BERT-like 4×256, GPT-2 4×768) at T ∈ {64, 128, 256},
  the time of a layer's norms + clipped sum by the ghost norm (two Grams + the book-keeping matmul) and by
  instantiation (one batched matmul, the norm and the clipped sum from the per-example gradients), the path
  ``use_ghost_norm(..., fused=True)`` picks for per-layer clipping, and whether it is the faster one.

    python benchmarks/rules.py --rules --paths --markdown rules.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from hf_dp.clipping import engine as engine_mod  # noqa: E402
from hf_dp.clipping.engine import ClippingEngine  # noqa: E402
from hf_dp.clipping.layers import Use  # noqa: E402


# ====================================================================== layers
class Seq(nn.Module):
    """``(B, T, d)`` tokens → a layer → per-example loss ``Σ y²``; conv layers see ``(B, C, T)``, ``(B, C, H, W)``."""

    def __init__(self, layer: nn.Module, layout: str = "btd"):
        super().__init__()
        self.layer = layer
        self.layout = layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layer(x)
        y = y[0] if isinstance(y, tuple) else y
        return y.pow(2).flatten(1).sum(1)


class NoRule(nn.Module):
    """A layer with no rule (parameter names other than weight/bias): the generic torch.func fallback."""

    def __init__(self, d: int):
        super().__init__()
        self.mix = nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.scale) @ self.mix


def cases(b: int, t: int, d: int) -> list[tuple[str, nn.Module, torch.Tensor, str]]:
    """(name, layer, input, what it is compared with)."""
    from transformers import MixtralConfig
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(b, t, d, generator=g)
    side = int(round(t ** 0.5))
    moe = MixtralSparseMoeBlock(MixtralConfig(hidden_size=d, intermediate_size=2 * d, num_local_experts=4,
                                              num_experts_per_tok=2))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.02, generator=g)
    return [
        (f"nn.Linear({d}, {d})", nn.Linear(d, d), tokens, "—"),
        (f"nn.Linear({3 * d}, {d})", nn.Linear(3 * d, d), torch.randn(b, t, 3 * d, generator=g), "—"),
        (f"nn.Conv1d({d}, {d}, 3) (unfold)", nn.Conv1d(d, d, 3, padding=1), tokens.transpose(1, 2).contiguous(),
         f"nn.Linear({3 * d}, {d})"),
        (f"nn.Conv2d({d // 4}, {d}, 3×3) (unfold), {side}×{side} map", nn.Conv2d(d // 4, d, 3, padding=1),
         torch.randn(b, d // 4, side, side, generator=g), f"nn.Linear({d}, {d})"),
        (f"nn.Conv1d({d}, {d}, 4, groups={d}) (depthwise)", nn.Conv1d(d, d, 4, groups=d, padding=3),
         tokens.transpose(1, 2).contiguous(), f"nn.LayerNorm({d})"),
        (f"nn.LayerNorm({d})", nn.LayerNorm(d), tokens, "—"),
        (f"LlamaRMSNorm({d}) (affine-norm rule)", LlamaRMSNorm(d), tokens, f"nn.LayerNorm({d})"),
        (f"Mixtral MoE block (4 experts, top-2, {d}→{2 * d}) + router", moe, tokens,
         f"nn.Linear({3 * d}, {d}) (per parameter value)"),
        (f"no rule: (x ⊙ s) M, M {d}×{d} (torch.func fallback)", NoRule(d), tokens, f"nn.Linear({d}, {d})"),
    ]


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        c0 = time.process_time()
        fn()
        times.append(time.process_time() - c0)
    return 1e3 * statistics.median(times)


def rule_rows(b: int, t: int, d: int, repeats: int) -> list[dict]:
    rows = []
    for name, layer, x, compare in cases(b, t, d):
        model = Seq(layer)
        engine = ClippingEngine(model)
        n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)

        def run_losses(sl, model=model, x=x):
            return model(x[sl])

        engine.first_step_check(run_losses, b)  # proves batch layouts (MoE token rows), as DPTrainer does

        def nonprivate(model=model, x=x):
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()

        parts = {"backward": [], "norms": [], "sums": []}

        def dp(model=model, x=x, engine=engine, parts=parts):
            c0 = time.process_time()
            with engine.record(b):
                model(x).sum().backward()
            c1 = time.process_time()
            norms = engine.per_example_norms_sq()
            total = torch.stack([v.double() for v in norms.values()]).sum(0).sqrt()
            c2 = time.process_time()
            engine.accumulate_clipped((1.0 / (total + 1e-6)).clamp(max=1.0).float())
            c3 = time.process_time()
            engine.clear()
            engine.pop_summed_grads()
            parts["backward"].append(c1 - c0)
            parts["norms"].append(c2 - c1)
            parts["sums"].append(c3 - c2)

        nonprivate()
        dp()
        for v in parts.values():
            v.clear()
        np_times, dp_times = [], []
        for _ in range(repeats):  # interleaved
            np_times.append(_median_ms(nonprivate, 1))
            dp_times.append(_median_ms(dp, 1))
        med = {k: 1e3 * statistics.median(v) for k, v in parts.items()}
        t_np, t_dp = statistics.median(np_times), statistics.median(dp_times)
        rows.append({"layer": name, "params": n_params, "compare": compare, "nonprivate_ms": t_np, "dp_ms": t_dp,
                     "record_ms": med["backward"], "norms_ms": med["norms"], "sums_ms": med["sums"],
                     "dp_extra_ns_per_param": 1e6 * (t_dp - t_np) / n_params,
                     "norms_sums_ns_per_param": 1e6 * (med["norms"] + med["sums"]) / n_params,
                     "ratio": t_dp / t_np, "paths": dict(engine.norm_paths)})
        print(f"  {name}: {rows[-1]}", flush=True)
    return rows


def rules_markdown(rows: list[dict], b: int, t: int, d: int) -> str:
    lines = [f"Per-rule cost, B = {b}, T = {t} tokens (conv2d: a {int(round(t ** 0.5))}² map), width {d}; process CPU "
             "time, one thread, median; flat clipping (norms after the backward pass):", "",
             "| layer | params | non-private fwd+bwd (ms) | DP fwd+bwd under record (ms) | norms (ms) | clipped sums "
             "(ms) | DP step ÷ non-private | norms + sums (ns / param) | DP extra (ns / param) | compare with |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['params']:,} | {r['nonprivate_ms']:.1f} | {r['record_ms']:.1f} | "
                     f"{r['norms_ms']:.1f} | {r['sums_ms']:.1f} | {r['ratio']:.2f}× | "
                     f"{r['norms_sums_ns_per_param']:.1f} | {r['dp_extra_ns_per_param']:.1f} | {r['compare']} |")
    return "\n".join(lines) + "\n"


# ====================================================================== ghost vs instantiation
LAYOUTS = {
    "bert-4x256 B=32": (32, [(256, 256), (256, 1024), (1024, 256)]),
    "gpt2-4x768 B=8": (8, [(768, 2304), (768, 768), (768, 3072), (3072, 768)]),
}


def path_rows(repeats: int, seq_lens=(64, 128, 256)) -> list[dict]:
    rows = []
    for layout, (b, dims) in LAYOUTS.items():
        for t in seq_lens:
            for d_in, d_out in dims:
                g = torch.Generator().manual_seed(0)
                a = torch.randn(b, t, d_in, generator=g)
                grad = torch.randn(b, t, d_out, generator=g)
                w = nn.Parameter(torch.zeros(d_out, d_in))
                use = Use(w, grad, a, d_out, "layer")  # nn.Linear's factors: L = g, R = a
                c = torch.rand(b, generator=g)
                eng = ClippingEngine(nn.Linear(1, 1))
                eng.params = {"w": w}

                scratch: dict = {}  # per-layer clipping's reused instantiation buffer (engine._scratch_for)

                def run(ghost, reuse=False, eng=eng, use=use, c=c, scratch=scratch):
                    _, inst = eng._plain_norm_sq([use], ghost=ghost, scratch=scratch if reuse else None)
                    eng._add_clipped("w", [use], c, inst, False)
                    eng.summed_grads = {}

                run(True)
                run(False)
                run(False, True)
                ghost_t, inst_t, reuse_t = [], [], []
                for _ in range(repeats):
                    ghost_t.append(_median_ms(lambda run=run: run(True), 1))
                    inst_t.append(_median_ms(lambda run=run: run(False), 1))
                    reuse_t.append(_median_ms(lambda run=run: run(False, True), 1))
                gm, im, rm = statistics.median(ghost_t), statistics.median(inst_t), statistics.median(reuse_t)
                pick = "ghost" if engine_mod.use_ghost_norm([use], fused=True) else "instantiate"
                flat_pick = "ghost" if engine_mod.use_ghost_norm([use], fused=True, memory_ratio=1) else "instantiate"
                best = "ghost" if gm <= rm else "instantiate"  # per-layer instantiates into the reused buffer
                rows.append({"layout": layout, "T": t, "layer": f"{d_in}→{d_out}", "ghost_ms": gm, "inst_ms": im,
                             "inst_reuse_ms": rm,
                             "rule_per_layer": pick, "rule_flat": flat_pick, "faster": best,
                             "inst_mib": b * d_in * d_out * 4 / 2**20,
                             "factors_mib": b * t * (d_in + d_out) * 4 / 2**20})
                print(f"  {rows[-1]}", flush=True)
    return rows


def paths_markdown(rows: list[dict]) -> str:
    lines = ["Ghost norm vs instantiation per dense layer (norms + clipped sum of one layer, process CPU ms, one "
             "thread, median). Rule: `use_ghost_norm(uses, fused=True)` (per-layer clipping: memory ratio 2; flat "
             "with norms at arrival: memory ratio 1).", "",
             "| layout | T | layer (in→out) | ghost (ms) | instantiate (ms) | instantiate, reused buffer (per-layer; "
             "ms) | faster | per-layer rule | matches | flat rule | per-example grads (MiB) | stored factors (MiB) |",
             "|---|---:|---|---:|---:|---:|---|---|---|---|---:|---:|"]
    for r in rows:
        g, i = r["ghost_ms"], r["inst_reuse_ms"]
        ok = "✓" if r["rule_per_layer"] == r["faster"] else ("≈" if abs(g - i) <= 0.1 * min(g, i) else "✗")
        lines.append(f"| {r['layout']} | {r['T']} | {r['layer']} | {r['ghost_ms']:.1f} | {r['inst_ms']:.1f} | "
                     f"{r['inst_reuse_ms']:.1f} | {r['faster']} | {r['rule_per_layer']} | {ok} | {r['rule_flat']} | "
                     f"{r['inst_mib']:.0f} | {r['factors_mib']:.0f} |")
    lines.append("\n✓: the per-layer rule picks the faster path (ghost, or instantiation into the reused buffer); ≈: "
                 "the other path is faster by ≤ 10 %; ✗: by more.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rules", action="store_true", help="Per-rule cost vs nn.Linear.")
    p.add_argument("--paths", action="store_true", help="Ghost vs instantiation per dense layer, and the rule.")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--markdown", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    md = []
    if args.rules:
        rows = rule_rows(args.batch_size, args.seq_len, args.width, args.repeats)
        md.append(rules_markdown(rows, args.batch_size, args.seq_len, args.width))
    if args.paths:
        md.append(paths_markdown(path_rows(args.repeats)))
    text = "\n".join(md)
    print("\n" + text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"Command: `python benchmarks/rules.py {' '.join(sys.argv[1:])}`\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
