#!/usr/bin/env python
"""The floor of exact per-example clipping: what no exact method can avoid, against the non-private step (issue 17).

Exact per-example clipping must compute every example's gradient norm. For one use of a parameter, per-example
gradient ``G_i = L_iᵀ R_i`` (``L_i``: ``(T, d_L)``, ``R_i``: ``(T, d_R)``; nn.Linear: ``L = g``, ``R = a``), the
exact ways are

* **ghost norm** (Li et al. 2022, §4): ``‖G_i‖² = ⟨L_i L_iᵀ, R_i R_iᵀ⟩``: two ``T × T`` Grams,
  ``B·T²·(d_L + d_R)`` multiply-adds (MACs), + ``B·T²`` for their inner product. The clipped sum ``Σ_i c_i L_iᵀ R_i``
  is then the weight-gradient matmul the non-private step does anyway, on a factor scaled per example
  (``B·T·min(d_L, d_R)``). A Gram of a factor read by several layers (BERT's q/k/v input) is counted once.
* **instantiation**: ``G_i`` by one batched matmul, ``B·T·d_L·d_R`` MACs — the same MACs as the non-private
  weight gradient, which it replaces (the clipped sum is ``Σ_i c_i G_i``, ``B·d_L·d_R``), so its extra work is the
  norm and the weighted sum, ``2·B·d_L·d_R``, plus whatever the batched matmul costs more than the single one.

An embedding (index) use has ``L`` one-hot: its Gram is ``B·T²`` comparisons, no MACs; a bias or norm ("ones") use
has ``d_L = 1``. Per parameter the floor is the cheaper of the two (a tied parameter with several uses: ghost with the
cross terms, or the sum of its uses' instantiations).

For each configuration this script

(a) captures the factors' shapes from one recorded micro-batch through hf_dp's own engine (``ClippingEngine.record``),
    and the path the engine picks per parameter in flat and per-layer clipping (``ClippingEngine.norm_paths``, from a
    second and third recorded micro-batch with the trainer's groups), and counts the analytic extra MACs of the
    cheapest exact path, of the engine's paths, and the non-private step's MACs (``torch.utils.flop_counter``);
(b) measures, on random tensors of the same shapes, with the same thread count (one, as the harness), the time of
    just those operations — ghost: the Grams + their inner product + the per-example scaling; instantiation: the
    batched matmul + norm + weighted sum minus the non-private weight-gradient matmul it replaces — takes the
    cheaper per parameter, and divides by the measured non-private step (model forward + backward + AdamW, process CPU
    time). ``1 + floor / non-private`` is the lower bound of the DP ÷ non-private ratio for any exact method on this
    machine; ``+ noise`` adds drawing one Gaussian per parameter value and adding it (any DP-SGD does that).

Process CPU time (``time.process_time``), medians over interleaved repeats; the machine is shared, so ±5–10 %.

    python benchmarks/floor.py --preset issue17 scaling --markdown floor.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)
_BENCH = os.path.dirname(os.path.abspath(__file__))
if _BENCH not in sys.path:
    sys.path.insert(0, _BENCH)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from hf_dp.clipping.engine import ClippingEngine  # noqa: E402
from hf_dp.clipping.modes import build_groups  # noqa: E402

#: instantiations larger than this (all examples' per-example gradients of one parameter) are not run, only counted
_MAX_INST_BYTES = 1536 * 2**20


# ====================================================================== shapes of the factors
@dataclass(frozen=True)
class UseSig:
    """The shapes of one use: kind ``dense``/``index``/``ones``, ``B``, ``T``, ``d_L``, ``d_R``, and keys of the
    factor tensors (their storage) so that a Gram of a tensor read by several layers is counted once."""

    kind: str
    b: int
    t: int
    d_l: int
    d_r: int
    left_key: tuple | None
    right_key: tuple

    def shape_only(self) -> tuple:
        return (self.kind, self.b, self.t, self.d_l, self.d_r)


def _key(x: torch.Tensor | None) -> tuple | None:
    return None if x is None else (x.data_ptr(), tuple(x.shape), x.stride())


def _batch(shape, model) -> dict[str, torch.Tensor]:
    import run  # benchmarks/run.py

    ds = run.make_dataset(shape, num_batches=1)
    rows = [ds[i] for i in range(shape.batch_size)]
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def capture(model, batch, b: int) -> tuple[dict[str, list[UseSig]], dict[str, dict[str, str]]]:
    """Per parameter, the shapes of its uses (one recorded micro-batch), and the engine's path per mode."""
    engine = ClippingEngine(model)
    with engine.record(b):
        model(**batch).loss.backward()
    sigs = {}
    for name, uses in engine.recorded_uses().items():
        sigs[name] = [UseSig(u.kind, u.right.shape[0], u.seq_len, u.left_dim, u.right.shape[-1], _key(u.left)
                             if u.kind == "dense" else None, _key(u.right)) for u in uses]
    engine.clear()
    paths = {}
    groups = [g.params for g in build_groups(engine, "per_layer")]
    covered = {n for g in groups for n in g}
    rest = [n for n in engine.params if n not in covered]
    # flat: norms at arrival with the per-layer groups and no handler (DPTrainer._build_clipping)
    engine.set_fused_groups(groups + ([rest] if rest else []), None)
    engine.norm_paths.clear()
    with engine.record(b):
        model(**batch).loss.backward()
    engine.per_example_norms_sq()
    paths["flat"] = dict(engine.norm_paths)
    engine.clear()
    # per-layer: clipped in the backward pass, group by group
    engine.set_fused_groups(groups, lambda k, norms: torch.ones(b))
    engine.norm_paths.clear()
    with engine.record(b):
        model(**batch).loss.backward()
    engine.finish_fused()
    paths["per_layer"] = dict(engine.norm_paths)
    engine.clear()
    engine.pop_summed_grads()
    engine.set_fused_groups(None, None)
    return sigs, paths


# ====================================================================== analytic MACs
def ghost_macs(uses: list[UseSig], seen: set | None) -> float:
    """Extra MACs of the ghost norm and the per-example scaling; the left Gram of a dense factor already in ``seen``
    is free (shared)."""
    total = 0.0
    for i, u in enumerate(uses):
        for v in uses[i:]:
            if v is u:
                if u.kind == "dense":
                    if seen is None or u.left_key not in seen:
                        total += u.b * u.t * u.t * u.d_l
                    if seen is not None:
                        seen.add(u.left_key)
                elif u.kind == "ones":
                    total += u.b * u.t * u.t
                total += u.b * u.t * u.t * u.d_r + u.b * u.t * u.t  # right Gram, inner product
            else:  # cross term: right Gram across the uses, left Gram (one-hot: a gather), inner product
                total += u.b * u.t * v.t * u.d_r + u.b * u.t * v.t
                if u.kind == "dense" and v.kind == "dense":
                    total += u.b * u.t * v.t * u.d_l
        total += u.b * u.t * (min(u.d_l, u.d_r) if u.kind == "dense" else u.d_r)  # per-example scaling
    return total


def inst_macs(uses: list[UseSig]) -> float:
    """Extra MACs of instantiation over the non-private weight gradient (which the batched matmul replaces): summing
    several uses, the norm, the weighted sum."""
    u = uses[0]
    per = u.b * u.d_l * u.d_r
    return per * (len(uses) - 1) + 2 * per


def inst_bytes(uses: list[UseSig]) -> int:
    u = uses[0]
    return 4 * u.b * u.d_l * u.d_r


# ====================================================================== measured
def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        c0 = time.process_time()
        fn()
        times.append(time.process_time() - c0)
    return 1e3 * statistics.median(times)


def _tensors(uses: list[UseSig], g: torch.Generator) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
    out = []
    for u in uses:
        right = torch.randn(u.b, u.t, u.d_r, generator=g)
        if u.kind == "dense":
            left = torch.randn(u.b, u.t, u.d_l, generator=g)
        elif u.kind == "index":
            left = torch.randint(0, u.d_l, (u.b, u.t), generator=g)
        else:
            left = None
        out.append((left, right))
    return out


def _left_gram(u: UseSig, lu, v: UseSig, lv) -> torch.Tensor:
    if u.kind == "index" and v.kind == "index":
        return (lu.unsqueeze(2) == lv.unsqueeze(1)).float()
    if u.kind == "index":
        return _left_gram(v, lv, u, lu).transpose(1, 2)
    if u.kind == "ones":
        lu = torch.ones(u.b, u.t, 1)
    if v.kind == "index":
        return lu.gather(2, lv.unsqueeze(1).expand(u.b, u.t, v.t))
    if v.kind == "ones":
        lv = torch.ones(v.b, v.t, 1)
    return torch.bmm(lu, lv.transpose(1, 2))


def measure_param(uses: list[UseSig], repeats: int, g: torch.Generator) -> dict[str, float | None]:
    """ms of: the dense left Gram (shareable), the rest of the ghost norm + scaling, and instantiation's extra."""
    ts = _tensors(uses, g)
    c = torch.rand(uses[0].b, generator=g)
    dense_self = uses[0].kind == "dense" and len(uses) == 1
    grams = {}
    if dense_self:
        grams["left"] = torch.bmm(ts[0][0], ts[0][0].transpose(1, 2))

    def ghost_rest():
        total = None
        for i, u in enumerate(uses):
            for j in range(i, len(uses)):
                v = uses[j]
                if j == i:
                    left = grams["left"] if dense_self else _left_gram(u, ts[i][0], u, ts[i][0])
                else:
                    left = _left_gram(u, ts[i][0], v, ts[j][0])
                right = torch.bmm(ts[i][1], ts[j][1].transpose(1, 2))
                term = (left * right).sum((1, 2))
                total = term if total is None else total + (term if j == i else 2 * term)
        for u, (left, right) in zip(uses, ts):  # per-example scaling of the smaller factor for the clipped sum
            x = left if u.kind == "dense" and u.d_l <= u.d_r else right
            (x.reshape(u.b, -1) * c.view(-1, 1))
        return total

    out = {"left_gram_ms": 0.0}
    if dense_self:
        a = ts[0][0]
        out["left_gram_ms"] = _median_ms(lambda: torch.bmm(a, a.transpose(1, 2)), repeats)
    out["ghost_rest_ms"] = _median_ms(ghost_rest, repeats)

    if inst_bytes(uses) > _MAX_INST_BYTES:
        out["inst_ms"] = None
        return out
    u0 = uses[0]

    def one_inst(u, left, right):
        if u.kind == "dense":
            return torch.bmm(left.transpose(1, 2), right)
        if u.kind == "index":
            rows = (left + torch.arange(u.b).view(-1, 1) * u.d_l).reshape(-1)
            return right.new_zeros(u.b * u.d_l, u.d_r).index_add_(0, rows, right.reshape(-1, u.d_r)).view(
                u.b, u.d_l, u.d_r)
        return right.sum(1, keepdim=True)

    def inst():
        gi = None
        for u, (left, right) in zip(uses, ts):
            x = one_inst(u, left, right)
            gi = x if gi is None else gi.add_(x)
        norms = torch.linalg.vector_norm(gi, dim=2).square().sum(1)
        s = c.view(1, -1) @ gi.reshape(u0.b, -1)
        return norms, s

    def nonprivate():  # the weight gradient the non-private step computes for the same uses
        s = None
        for u, (left, right) in zip(uses, ts):
            if u.kind == "dense":
                x = left.reshape(-1, u.d_l).t() @ right.reshape(-1, u.d_r)
            elif u.kind == "index":
                x = right.new_zeros(u.d_l, u.d_r).index_add_(0, left.reshape(-1), right.reshape(-1, u.d_r))
            else:
                x = right.sum((0, 1))
            s = x if s is None else s.add_(x)
        return s

    ti, tn = [], []
    inst()
    nonprivate()
    for _ in range(repeats):  # interleaved: both under the same load
        ti.append(_time_once(inst))
        tn.append(_time_once(nonprivate))
    out["inst_ms"] = 1e3 * (statistics.median(ti) - statistics.median(tn))
    out["inst_raw_ms"] = 1e3 * statistics.median(ti)
    out["weight_grad_ms"] = 1e3 * statistics.median(tn)
    return out


def _time_once(fn) -> float:
    c0 = time.process_time()
    fn()
    return time.process_time() - c0


def nonprivate_step(model, batch, repeats: int, accum: int) -> dict[str, float]:
    """Process CPU ms of the non-private step: ``accum`` × (forward + backward of the model's batch loss) + AdamW."""
    from torch.utils.flop_counter import FlopCounterMode

    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step():
        for _ in range(accum):
            model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    with FlopCounterMode(display=False) as fc:
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    times = [_time_once(step) for _ in range(repeats)]
    return {"step_ms": 1e3 * statistics.median(times), "macs_per_micro": fc.get_total_flops() / 2,
            "all_ms": [1e3 * t for t in times]}


def noise_ms(n: int, repeats: int) -> float:
    """One Gaussian per parameter value, added to the sum: the draw + one add (what any DP-SGD step does)."""
    s = torch.zeros(n)
    gen = torch.Generator().manual_seed(0)

    def draw():
        z = torch.empty(n).normal_(0, 1.0, generator=gen)
        s.add_(z)

    return _median_ms(draw, repeats)


# ====================================================================== one configuration
def floor_of(shape, repeats: int, np_repeats: int) -> dict:
    import run

    model = run.build_model(shape)
    batch = _batch(shape, model)
    b = shape.batch_size
    sigs, paths = capture(model, batch, b)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    np_ = nonprivate_step(model, batch, np_repeats, shape.accum)
    g = torch.Generator().manual_seed(0)
    cache: dict[tuple, dict] = {}
    rows = []
    seen_flat: set = set()
    seen_min: set = set()
    gram_done: set = set()
    for name, uses in sigs.items():
        key = tuple(u.shape_only() for u in uses)
        if key not in cache:
            cache[key] = measure_param(uses, repeats, g)
        m = cache[key]
        dense_self = uses[0].kind == "dense" and len(uses) == 1
        shared = dense_self and uses[0].left_key in gram_done
        if dense_self:
            gram_done.add(uses[0].left_key)
        ghost_unshared = m["left_gram_ms"] + m["ghost_rest_ms"]
        ghost_shared = m["ghost_rest_ms"] + (0.0 if shared else m["left_gram_ms"])
        inst = m["inst_ms"]
        g_mac_unshared = ghost_macs(uses, None)
        g_mac_shared = ghost_macs(uses, seen_min)
        ghost_macs(uses, seen_flat)
        i_mac = inst_macs(uses)
        best_ms = ghost_shared if inst is None else min(ghost_shared, inst)
        best_mac = min(g_mac_shared, i_mac)
        flat_path = paths["flat"].get(name, "?")
        pl_path = paths["per_layer"].get(name, "?")

        def pick(path, ghost_ms, ghost_mac, inst=inst, i_mac=i_mac):
            if path == "ghost":
                return ghost_ms, ghost_mac
            return (inst if inst is not None else float("nan")), i_mac

        flat_ms, flat_mac = pick(flat_path, ghost_shared, g_mac_shared)  # flat shares the Gram cache
        pl_ms, pl_mac = pick(pl_path, ghost_unshared, g_mac_unshared)  # per-layer: one group at a time, no cache
        u = uses[0]
        rows.append({"param": name, "uses": [x.shape_only() for x in uses], "kind": "+".join(x.kind for x in uses),
                     "B": u.b, "T": u.t, "d_L": u.d_l, "d_R": u.d_r, "shared_gram": shared,
                     "ghost_ms": ghost_shared, "ghost_unshared_ms": ghost_unshared, "inst_ms": inst,
                     "inst_raw_ms": m.get("inst_raw_ms"), "weight_grad_ms": m.get("weight_grad_ms"),
                     "left_gram_ms": m["left_gram_ms"],
                     "ghost_macs": g_mac_shared, "inst_macs": i_mac, "floor_ms": best_ms, "floor_macs": best_mac,
                     "floor_path": "ghost" if (inst is None or ghost_shared <= inst) else "instantiate",
                     "flat_path": flat_path, "per_layer_path": pl_path, "flat_ms": flat_ms, "flat_macs": flat_mac,
                     "per_layer_ms": pl_ms, "per_layer_macs": pl_mac})
    acc = shape.accum
    noise = noise_ms(n_params, repeats)
    tot = {k: acc * sum(r[k] for r in rows) for k in ("floor_ms", "floor_macs", "flat_ms", "flat_macs",
                                                          "per_layer_ms", "per_layer_macs")}
    np_ms = np_["step_ms"]
    np_macs = acc * np_["macs_per_micro"]
    res = {"shape": shape.name, "params": n_params, "B": b, "accum": acc, "T": shape.seq_len,
           "nonprivate_ms": np_ms, "nonprivate_all_ms": np_["all_ms"], "nonprivate_macs": np_macs,
           "noise_ms": noise, **tot,
           "floor_ratio": 1 + tot["floor_ms"] / np_ms, "floor_noise_ratio": 1 + (tot["floor_ms"] + noise) / np_ms,
           "floor_mac_ratio": 1 + tot["floor_macs"] / np_macs,
           "flat_paths_ratio": 1 + (tot["flat_ms"] + noise) / np_ms,
           "per_layer_paths_ratio": 1 + (tot["per_layer_ms"] + noise) / np_ms,
           "rows": rows}
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}), flush=True)
    return res


# ====================================================================== markdown
def _pattern(name: str) -> str:
    import re

    return re.sub(r"\.\d+\.", ".*.", name)


def summary_markdown(results: list[dict]) -> str:
    lines = ["| configuration | params | non-private step (ms CPU) | non-private GMAC | floor: extra GMAC (÷ np) | "
             "floor: norm ops (ms) | noise (ms) | **floor ratio** (norms) | **+ noise** | engine's paths, flat: ratio "
             "| engine's paths, per-layer: ratio |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(
            f"| {r['shape']} | {r['params'] / 1e6:.1f} M | {r['nonprivate_ms']:.0f} | "
            f"{r['nonprivate_macs'] / 1e9:.1f} | "
            f"{r['floor_macs'] / 1e9:.2f} ({100 * r['floor_macs'] / r['nonprivate_macs']:.1f} %) | "
            f"{r['floor_ms']:.0f} | {r['noise_ms']:.0f} | **{r['floor_ratio']:.3f}×** | "
            f"**{r['floor_noise_ratio']:.3f}×** | {r['flat_paths_ratio']:.3f}× | {r['per_layer_paths_ratio']:.3f}× |")
    return "\n".join(lines) + "\n"


def layers_markdown(r: dict) -> str:
    """Per parameter pattern (layers of equal shape merged): the two paths' extra ms and the engine's choices."""
    groups: dict[str, list[dict]] = {}
    for row in r["rows"]:
        groups.setdefault(_pattern(row["param"]), []).append(row)
    lines = [f"{r['shape']}: per parameter (× count of equal layers), extra process CPU ms over the non-private "
             "step, per micro-batch",
             "",
             "| parameter | × | uses (kind, B, T, d_L, d_R) | ghost (ms) | ghost MMAC | instantiate (ms) | "
             "inst. MMAC | floor path | flat | per-layer |",
             "|---|---:|---|---:|---:|---:|---:|---|---|---|"]
    for pat, rows in groups.items():
        x = rows[0]
        gm = statistics.mean(y["ghost_ms"] for y in rows)
        im = "—" if x["inst_ms"] is None else f"{x['inst_ms']:.2f}"
        lines.append(f"| `{pat}` | {len(rows)} | {', '.join(str(tuple(u)) for u in x['uses'])} | {gm:.2f} | "
                     f"{statistics.mean(y['ghost_macs'] for y in rows) / 1e6:.0f} | {im} | "
                     f"{x['inst_macs'] / 1e6:.1f} | "
                     f"{x['floor_path']} | {x['flat_path']} | {x['per_layer_path']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import run

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", nargs="+", default=["issue17", "scaling"], choices=sorted(run.PRESETS))
    p.add_argument("--shapes", nargs="+", default=None, help="Only these shape names.")
    p.add_argument("--repeats", type=int, default=5, help="Repeats of each timed op.")
    p.add_argument("--np-repeats", type=int, default=3, help="Timed non-private steps.")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", action="store_true", help="Also the per-parameter table of each configuration.")
    p.add_argument("--out", default=None, help="JSON output.")
    p.add_argument("--markdown", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import logging

    logging.getLogger("hf_dp").setLevel(logging.ERROR)
    shapes, names = [], set()
    for preset in args.preset:
        for s in run.PRESETS[preset]:
            if s.name not in names and (args.shapes is None or s.name in args.shapes):
                shapes.append(s)
                names.add(s.name)
    results = []
    for s in shapes:
        print(f"== {s.name}", flush=True)
        results.append(floor_of(s, args.repeats, args.np_repeats))
    md = [summary_markdown(results)]
    if args.layers:
        md += [layers_markdown(r) for r in results]
    text = "\n".join(md)
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"Command: `python benchmarks/floor.py {' '.join(sys.argv[1:])}`\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
