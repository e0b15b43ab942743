"""A layer's decode LoRA per row against rows grouped by adapter (``GatheredLora.groups``), with a block sweep.

A decode batch of B rows over A adapters (each row draws one uniformly; ranks cycled from
``--ranks``, on all seven projections) through what one layer of the engine runs after its
GEMMs (8B shape by default): the RoPE + KV-write epilogue with q/k/v's LoRA, o's gather, the
SwiGLU epilogue with gate/up's LoRA, down's gather. Timed per (B, A, rank mix), ``--layers``
layers of their own adapter weights one after another (so replays do not find the adapters in
L2), reported per layer, medians of CUDA-graph replays (``harness.kernel_ms``):

- ``base``: the epilogues without LoRA (what the LoRA rides on);
- ``per_row``: every shrink and expand per row (both row bounds out of reach);
- ``shrink_grouped``: the grouped shrink, the expands per row;
- ``grouped``: both grouped, at the engine's blocks;
- ``floor``: the adapters' bytes present in the step (each distinct adapter once) at the
  device's copy bandwidth, a bound no LoRA path can beat.

Then both grouped modes at each setting of ``SWEEP`` (changes to ``KNOBS``: GROUP_ROWS, the
expand's BLOCK_N, warps, form (row loop or dot) and dot precision, the grouped shrink's BLOCK_K,
K split and warps) for the mixed-rank cases of ``--sweep-rows``: the best per case, and a table
of each setting's LoRA time over the per-row one.
Each grouped result is checked against the per-row one (``max_rel_diff``). The sweep stops
when ``--budget-s`` is spent (the table is printed and the JSON written either way).

    PYTHONPATH=. python3 scripts/bench_decode_groups.py --out $OUT
    PYTHONPATH=. TRITON_INTERPRET=1 python3 scripts/bench_decode_groups.py --device cpu --dtype float32 --tiny \\
        --batches 16 --adapters 4 --ranks 4,8 --rank-mixes 1 --layers 1 --sweep-rows 16 --out /tmp/dg
"""

from __future__ import annotations

import argparse
import itertools
import random
import time

from harness import add_device_args, add_output_args, comma_list, device_info, dtype_of, kernel_ms, logger, write_json

import torch  # noqa: E402

from lightning_lorafusion.kernels import lora_gather as lg  # noqa: E402
from lightning_lorafusion.kernels.lora_epilogues import rope_write_kv, swiglu  # noqa: E402
from lightning_lorafusion.kernels.lora_gather import GatheredLora, adapter_groups, lora_gather  # noqa: E402

log = logger("bench_decode_groups")

# (hidden, heads, kv heads, head_dim, intermediate)
SHAPES = {"8b": (4096, 32, 8, 128, 14336), "tiny": (64, 4, 2, 16, 96)}
# sweep settings, each a change from the engine's knobs in ``lora_gather`` (the first: none);
# ordered by what is expected to matter most, as the sweep stops at ``--budget-s``
SWEEP = [{}, {"GROUPED_SHRINK_SPLIT_K": 16384}, {"GROUPED_SHRINK_SPLIT_K": 2048},
         {"GROUPED_EXPAND_ROW_LOOP": False, "GROUPED_EXPAND_DOT": "tf32"},
         {"GROUPED_EXPAND_ROW_LOOP": False, "GROUPED_EXPAND_DOT": "tf32", "GROUPED_SHRINK_SPLIT_K": 16384},
         {"GROUPED_EXPAND_BLOCK_N": 128}, {"GROUP_ROWS": 32},
         {"GROUPED_EXPAND_BLOCK_N": 512, "GROUPED_EXPAND_WARPS": 8},
         {"GROUPED_EXPAND_ROW_LOOP": False}, {"GROUPED_SHRINK_SPLIT_K": 16384, "GROUPED_SHRINK_WARPS": 8},
         {"GROUPED_SHRINK_BLOCK_K": 256, "GROUPED_SHRINK_SPLIT_K": 1024}]
KNOBS = ("GROUP_ROWS", "GROUPED_EXPAND_BLOCK_N", "GROUPED_EXPAND_WARPS", "GROUPED_EXPAND_ROW_LOOP",
         "GROUPED_EXPAND_DOT", "GROUPED_SHRINK_BLOCK_K", "GROUPED_SHRINK_SPLIT_K", "GROUPED_SHRINK_WARPS")


def projection_dims(shape: str) -> list[tuple[int, int]]:
    """(K, N) of q, k, v, o, gate, up, down."""
    h, hq, hkv, d, i = SHAPES[shape]
    return [(h, hq * d), (h, hkv * d), (h, hkv * d), (hq * d, h), (h, i), (h, i), (i, h)]


def layer_step(b: int, a: int, ranks: list[int], args, device, dtype, seed: int = 0, cycle: bool = False) -> dict:
    """``args.layers`` layers' adapter weights for ``a`` adapters (rank ``ranks[i % len]`` on
    every projection) in one pool, a batch of ``b`` rows drawn among them (``cycle``: row i
    takes adapter i % a, S-LoRA's setting; "zipf": drawn by Zipf(0.8) popularity, the
    many-tenant trace's), and the layer's activations -> everything
    ``run_layers`` needs."""
    rng = random.Random(seed)
    dims = projection_dims(args.shape)
    rank_of = [ranks[i % len(ranks)] for i in range(a)]
    offsets, pos = [], 0  # offsets[layer][adapter][projection] = (A offset, B^T offset)
    for _ in range(args.layers):
        per_adapter = []
        for r in rank_of:
            per_adapter.append([(pos + sum(r * (kk + n) for kk, n in dims[:p]),
                                 pos + sum(r * (kk + n) for kk, n in dims[:p]) + r * dims[p][0]) for p in range(7)])
            pos += sum(r * (kk + n) for kk, n in dims)
        offsets.append(per_adapter)
    pool = torch.randn(pos, device=device, dtype=dtype) * 0.02
    if cycle == "zipf":  # the many-tenant trace's popularity: adapter i drawn with weight 1 / (i + 1)^0.8
        row_adapter = rng.choices(range(a), weights=[1 / (i + 1) ** 0.8 for i in range(a)], k=b)
    else:
        row_adapter = [i % a if cycle else rng.randrange(a) for i in range(b)]
    h, hq, hkv, d, inter = SHAPES[args.shape]
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    def tables(layer: int, projections: range):
        a_off = torch.tensor([[offsets[layer][i][p][0] for i in row_adapter] for p in projections], device=device)
        b_off = torch.tensor([[offsets[layer][i][p][1] for i in row_adapter] for p in projections], device=device)
        rk = torch.tensor([rank_of[i] for i in row_adapter], dtype=torch.int32, device=device)
        return a_off, b_off, rk.expand(len(projections), b).contiguous()

    pages = (b + 15) // 16
    slots = torch.randperm(pages * 16, device=device)[:b]
    bytes_present = sum(rank_of[i] * sum(kk + n for kk, n in dims) for i in set(row_adapter)) * pool.element_size()
    return dict(b=b, pool=pool, scales=torch.full((b,), 0.5, device=device), keys=[i + 1 for i in row_adapter],
                tables=[{name: tables(layer, ps) for name, ps in (("qkv", range(0, 3)), ("o", range(3, 4)),
                                                                  ("gate_up", range(4, 6)), ("down", range(6, 7)))}
                        for layer in range(args.layers)],
                x=rand(b, h), qkv=rand(b, (hq + 2 * hkv) * d), attn=rand(b, hq * d), gu=rand(b, 2 * inter),
                act=rand(b, inter), o=rand(b, h), down=rand(b, h), cos=rand(b, d), sin=rand(b, d),
                kv=rand(pages, 1, 2, 16, hkv, d), slot_pages=slots // 16, slot_offsets=slots % 16,
                heads=(hq, hkv, d, inter), bytes_present=bytes_present)


def run_layers(s: dict, lora: bool, groups: torch.Tensor | None) -> list[torch.Tensor]:
    """What ``args.layers`` layers run after their GEMMs -> each layer's q|k|v, o, SwiGLU and
    down outputs (q|k|v, o and down are updated in place: replays accumulate, timing is unchanged)."""
    hq, hkv, d, inter = s["heads"]
    b, outs = s["b"], []
    for t in s["tables"]:
        def gathered(name, x):
            return GatheredLora(x, s["pool"], *t[name], s["scales"], groups=groups) if lora else None
        q, k, v = s["qkv"].split([hq * d, hkv * d, hkv * d], dim=1)
        rope_write_kv(q.view(b, hq, d), k.view(b, hkv, d), v.view(b, hkv, d), s["cos"], s["sin"], s["kv"], 0,
                      s["slot_pages"], s["slot_offsets"], lora=gathered("qkv", s["x"]), backend="triton")
        if lora:
            a_off, b_off, rk = t["o"]
            lora_gather(s["attn"], s["pool"], a_off[0], b_off[0], rk[0], s["scales"], s["o"].shape[1], out=s["o"],
                        backend="triton", groups=groups)
        act = swiglu(s["gu"][:, :inter], s["gu"][:, inter:], lora=gathered("gate_up", s["x"]), backend="triton")
        if lora:
            a_off, b_off, rk = t["down"]
            lora_gather(s["act"], s["pool"], a_off[0], b_off[0], rk[0], s["scales"], s["down"].shape[1],
                        out=s["down"], backend="triton", groups=groups)
        outs.append(act)
    return outs


IN_PLACE = ("qkv", "o", "down", "kv")


def outputs(s: dict, groups) -> list[torch.Tensor]:
    """One pass from the in-place buffers' first values -> everything it wrote (fp32)."""
    for k in IN_PLACE:
        s[k].copy_(s["init"][k])
    acts = run_layers(s, True, groups)
    return [s[k].float().clone() for k in ("qkv", "o", "down")] + [a.float() for a in acts]


def set_knobs(defaults: dict, change: dict) -> None:
    for name in KNOBS:
        setattr(lg, name, change.get(name, defaults[name]))


def setting_name(change: dict) -> str:
    short = {"GROUP_ROWS": "rows", "GROUPED_EXPAND_BLOCK_N": "bn", "GROUPED_EXPAND_WARPS": "xw",
             "GROUPED_EXPAND_ROW_LOOP": "loop", "GROUPED_EXPAND_DOT": "dot", "GROUPED_SHRINK_BLOCK_K": "bk",
             "GROUPED_SHRINK_SPLIT_K": "split", "GROUPED_SHRINK_WARPS": "sw"}
    return ",".join(f"{short[k]}={v}" for k, v in change.items()) or "engine"


def time_mode(s: dict, mode: str, device) -> tuple[float | None, float]:
    """(µs per layer on CUDA, max relative difference from the per-row outputs) of a mode."""
    bounds = {"base": (10**9, 10**9), "per_row": (10**9, 10**9), "shrink_grouped": (0, 10**9), "grouped": (0, 0)}
    lg.GROUPED_MIN_ROWS, lg.GROUPED_EXPAND_MIN_ROWS = bounds[mode]
    groups = adapter_groups(s["keys"], s["b"]).to(device)
    diff = 0.0
    if mode not in ("base", "per_row"):
        got = outputs(s, groups)
        diff = max(float((g - w).abs().max() / w.abs().max().clamp_min(1e-30)) for g, w in zip(got, s["want"]))
    us = None
    if device.type == "cuda":
        us = 1e3 * kernel_ms(lambda: run_layers(s, mode != "base", groups), graph=True) / len(s["tables"])
    return us, diff


def copy_gbps(device) -> float | None:
    """Device-to-device copy bandwidth (read + write bytes per second), GB/s."""
    if device.type != "cuda":
        return None
    src = torch.empty(2**28, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (kernel_ms(lambda: dst.copy_(src)) * 1e-3) / 1e9


def measure(args, b: int, a: int, ranks: list[int], device, dtype, gbps) -> tuple[dict, dict]:
    """The four modes of one case at the engine's knobs -> (its table row, its problem)."""
    s = layer_step(b, a, ranks, args, device, dtype)
    s["init"] = {k: s[k].clone() for k in IN_PLACE}
    lg.GROUPED_MIN_ROWS = lg.GROUPED_EXPAND_MIN_ROWS = 10**9
    s["want"] = outputs(s, None)
    row = {"rows": b, "adapters": a, "ranks": ",".join(map(str, ranks)), "distinct": len(set(s["keys"])),
           "floor_us": s["bytes_present"] / (gbps * 1e3) if gbps else None, "max_rel_diff": 0.0}
    for mode in ("base", "per_row", "shrink_grouped", "grouped"):
        row[f"{mode}_us"], diff = time_mode(s, mode, device)
        row["max_rel_diff"] = max(row["max_rel_diff"], diff)
    log(str(row))
    return row, s


def sweep(cases: list[tuple[dict, dict]], device, deadline: float, defaults: dict) -> None:
    """Each sweep setting (outer: its kernels compile once) over every case (inner), both
    grouped modes, into the rows' ``sweep`` lists, until ``deadline``."""
    for row, _ in cases:  # the first setting is the engine's: the modes' times
        row["sweep"] = [{"setting": "engine", "grouped_us": row["grouped_us"],
                         "shrink_grouped_us": row["shrink_grouped_us"], "max_rel_diff": row["max_rel_diff"]}]
    for change in SWEEP[1:]:
        if time.monotonic() > deadline:
            for row, _ in cases:
                row["sweep_cut"] = True
            break
        set_knobs(defaults, change)
        for row, s in cases:
            entry = {"setting": setting_name(change), **change, "max_rel_diff": 0.0}
            for mode in ("grouped", "shrink_grouped"):
                entry[f"{mode}_us"], diff = time_mode(s, mode, device)
                entry["max_rel_diff"] = max(entry["max_rel_diff"], diff)
            row["sweep"].append(entry)
        log(f"swept {setting_name(change)}")
    set_knobs(defaults, {})


def fmt(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


def lora_part(r: dict, us: float | None) -> float | None:
    return None if us is None or r["base_us"] is None else us - r["base_us"]


def print_tables(rows: list[dict]) -> None:
    print("\n| rows | adapters | ranks | distinct | floor µs | base µs | per row +µs | shrink grouped +µs "
          "| grouped +µs | grouped / per row | best +µs | best setting (mode) | max rel diff |")
    print("|" + "---|" * 13)
    for r in rows:
        lora = {m: lora_part(r, r[f"{m}_us"]) for m in ("per_row", "shrink_grouped", "grouped")}
        ratio = None if lora["grouped"] is None else lora["grouped"] / lora["per_row"]
        tries = [(lora_part(r, x[f"{m}_us"]), f"{x['setting']} ({m})") for x in r.get("sweep", [])
                 for m in ("grouped", "shrink_grouped") if x[f"{m}_us"] is not None]
        best = min(tries, default=(None, "-"))
        print(f"| {r['rows']} | {r['adapters']} | {r['ranks']} | {r['distinct']} | {fmt(r['floor_us'])} "
              f"| {fmt(r['base_us'])} | {fmt(lora['per_row'])} | {fmt(lora['shrink_grouped'])} "
              f"| {fmt(lora['grouped'])} | {fmt(ratio, '.2f')} | {fmt(best[0])} | {best[1]} "
              f"| {r['max_rel_diff']:.1e} |")
    swept = [r for r in rows if r.get("sweep") and r["base_us"] is not None]
    if not swept:
        return
    print("\nsweep: LoRA part over the per-row one, per swept case (rows/adapters), grouped | shrink grouped")
    print("| setting | " + " | ".join(f"{r['rows']}/{r['adapters']}" for r in swept) + " |")
    print("|" + "---|" * (len(swept) + 1))
    for i, x in enumerate(swept[0]["sweep"]):
        cells = []
        for r in swept:
            e = r["sweep"][i] if i < len(r["sweep"]) else None
            per_row = lora_part(r, r["per_row_us"])
            cells.append("-" if e is None else " / ".join(fmt(lora_part(r, e[f"{m}_us"]) / per_row, ".2f")
                                                         for m in ("grouped", "shrink_grouped")))
        print(f"| {x['setting']} | " + " | ".join(cells) + " |")


def main(argv=None) -> dict:
    """The benchmark; the kernels' knobs and row bounds it sets are put back after it (tests run it
    in the process that later builds engines)."""
    saved = {name: getattr(lg, name) for name in KNOBS + ("GROUPED_MIN_ROWS", "GROUPED_EXPAND_MIN_ROWS")}
    try:
        return _main(argv)
    finally:
        for name, value in saved.items():
            setattr(lg, name, value)


def _main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_args(ap)
    ap.add_argument("--tiny", action="store_const", const="tiny", dest="shape", default="8b",
                    help="a tiny layer (for the interpreter) instead of the 8B shape")
    ap.add_argument("--batches", type=comma_list(cast=int), default=[64, 128, 256])
    ap.add_argument("--adapters", type=comma_list(cast=int), default=[8, 32, 100])
    ap.add_argument("--ranks", type=comma_list(cast=int), default=[4, 8, 16, 32, 64],
                    help="the mixed ranks, cycled over adapters")
    ap.add_argument("--rank-mixes", type=int, default=2, help="1: the mixed ranks only; 2: also all rank 16")
    ap.add_argument("--layers", type=int, default=4, help="layers of their own adapter weights per timed pass")
    ap.add_argument("--sweep-rows", type=comma_list(cast=int), default=[64, 128, 256],
                    help="batches whose cases get the block sweep (mixed ranks)")
    ap.add_argument("--budget-s", type=float, default=105.0,
                    help="no new sweep setting after this many seconds (from the start)")
    ap.add_argument("--stop-s", type=float, default=70.0, help="no new case after this many seconds")
    add_output_args(ap)
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), dtype_of(args.dtype)
    start = time.monotonic()
    defaults = {name: getattr(lg, name) for name in KNOBS}
    gbps = copy_gbps(device)
    mixes = [args.ranks, [16]][:args.rank_mixes]
    rows, swept = [], []

    def save():
        write_json(args.out, "bench_decode_groups.json", {**device_info(device), "args": vars(args),
                                                          "copy_gbps": gbps, "engine_knobs": defaults,
                                                          "sweep_settings": SWEEP, "rows": rows})

    for ranks, b, a in itertools.product(mixes, args.batches, args.adapters):
        if time.monotonic() > start + args.stop_s:
            log(f"--stop-s {args.stop_s} reached: ({b}, {a}, {ranks}) and the cases after it not run")
            break
        row, s = measure(args, b, a, ranks, device, dtype, gbps)
        rows.append(row)
        if ranks is args.ranks and b in args.sweep_rows:
            swept.append((row, s))
        save()
    sweep(swept, device, start + args.budget_s, defaults)
    save()
    print(f"\nper layer ({args.shape} shape, {args.dtype}, {args.layers} layers per pass); '+µs': over base; "
          f"copy bandwidth {fmt(gbps, '.0f')} GB/s; engine knobs: {defaults}")
    print_tables(rows)
    return {"rows": rows}


if __name__ == "__main__":
    main()
