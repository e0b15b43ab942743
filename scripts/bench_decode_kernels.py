"""GPU check and timing of the decode kernels (lora_gather, paged decode attention) in bf16.

1. bf16 correctness of every launcher configuration below against the torch references, on
   odd shapes (mixed ranks, rank-0 rows, random sequence lengths, a sliding window).
2. lora_gather at 8B decode shapes, K=4096 -> N in {4096, 1024, 14336}, B in {1, 16, 64, 256},
   8 or 64 adapters with ranks drawn from {8, 16, 32, 64} (rows spread over all of them), added
   in place into y, against: a per-adapter loop (gather rows, two matmuls, index_add), padding
   every adapter to the largest rank with gathered bmm, and the frozen linear x W^T itself.
3. paged decode attention, Hq=32, Hkv=8, D=128, page 16, every row at context 512/2048/8192,
   B in {1, 16, 64, 256}, against gathering the pages into dense K/V and running SDPA.
4. the fused decode epilogues at 8B shapes (``--sections epilogues``), B in {16, 64, 256}, each
   row its own r=16 adapter (64 adapters at most): q/k/v (grouped shrink + LoRA expand, RoPE and
   KV write in one kernel) against the engine's previous path (three lora_gather calls, eager
   RoPE, write_kv); gate/up (grouped shrink + LoRA expand + SwiGLU) against two lora_gather
   calls and eager silu * up; each also without LoRA; add + RMSNorm against the eager ops; and
   the frozen q/k/v and gate/up GEMMs, three / two of them against one over the fused weight.
   Shrink launch configurations are swept; bf16 checks against the references come first.

Times are medians of CUDA-graph replays (device time; the engine replays graphs) unless the
column says eager. Each timed call cycles through enough adapter pools / weights / layers to
exceed the 50 MB L2, so weights come from HBM as they do in a real decode step.

    python scripts/bench_decode_kernels.py [--out DIR]      # GPU
    TRITON_INTERPRET=1 python scripts/bench_decode_kernels.py --smoke   # CPU: tiny shapes, wall clock
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_lorafusion.kernels import lora_epilogues as le  # noqa: E402
from lightning_lorafusion.kernels import lora_gather as lg  # noqa: E402
from lightning_lorafusion.kernels import paged_attention as pa  # noqa: E402
from lightning_lorafusion.kernels.rms_norm import add_rms_norm  # noqa: E402
from lightning_lorafusion.model.decoder import apply_rope, rms_norm  # noqa: E402

RANKS = (8, 16, 32, 64)
DT = {"dtype": torch.bfloat16}  # fp32 under --smoke (the interpreter's bf16 arithmetic is wrong)
FAILED: list[str] = []  # bf16 checks that failed (reported last; timing still runs)
ROTATE = {"bytes": 256 << 20}  # data touched per timed call, ~5x the L2 (tiny under --smoke)
LORA_CONFIGS = {  # launcher knobs of lora_gather; "auto" = the defaults
    "auto": {},
    "k128": {"block_k": 128},
    "k512": {"block_k": 512},
    "n128": {"block_n": 128},
    "n512": {"block_n": 512},
    "r16": {"block_r": 16},
    "r64": {"block_r": 64},
    "w8": {"num_warps": 8},
}
SHRINK_CONFIGS = {  # the grouped shrink's knobs in the fused epilogues; "auto" = the defaults
    "auto": {},
    "k128": {"block_k": 128},
    "k512": {"block_k": 512},
    "r16": {"block_r": 16},
    "k512r16": {"block_k": 512, "block_r": 16},
    "w8": {"num_warps": 8},
    "k1024": {"block_k": 1024},
    "k1024w8": {"block_k": 1024, "num_warps": 8},
    "k2048w8": {"block_k": 2048, "num_warps": 8},
    "w2": {"num_warps": 2},
}
ATTN_CONFIGS = {
    "auto": {},
    "t32": {"block_t": 32},
    "t128": {"block_t": 128},
    "w8": {"num_warps": 8},
    "st2": {"num_stages": 2},
    "split1": {"splits": 1},
    "split_half": {"splits": "half"},
    "split_x2": {"splits": "x2"},
}


def log(msg: str, fh=None) -> None:
    print(msg, flush=True)
    if fh is not None:
        fh.write(msg + "\n")
        fh.flush()


def rel_err(got, want) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


class Timer:
    def __init__(self, smoke: bool):
        self.smoke = smoke

    def graph(self, fn) -> float:
        """Median device time (us) of fn replayed from a CUDA graph: fn is captured once (not
        unrolled: fn already cycles through many inputs), replayed in batches between events."""
        if self.smoke:
            return self.eager(fn)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # compiles, allocates
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                fn()
            graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            per_batch = max(1, min(50, int(5.0 / max(start.elapsed_time(end), 1e-3))))  # ~5 ms batches
            times = []
            for _ in range(10):
                start.record()
                for _ in range(per_batch):
                    graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / per_batch)
        torch.cuda.current_stream().wait_stream(stream)
        del graph
        return 1e3 * sorted(times)[len(times) // 2]

    def eager(self, fn) -> float:
        """Median time (us) between CUDA events around eager calls (counts host launch gaps)."""
        if self.smoke:
            t = time.perf_counter()
            fn()
            return 1e6 * (time.perf_counter() - t)
        return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


# ---------------------------------------------------------------------------------------------
# lora_gather
# ---------------------------------------------------------------------------------------------


def make_lora_set(n_adapters, k, n, rows, device, gen, zero_rows=0):
    """One pool of n_adapters (ranks from RANKS) and a routing of `rows` rows over them (every
    adapter used when rows >= n_adapters); plus padded copies and per-adapter groups for the
    torch baselines. `gen` is a generator on `device`."""
    dt = DT["dtype"]
    ranks = [RANKS[int(i)] for i in torch.randint(len(RANKS), (n_adapters,), generator=gen, device=device)]
    parts, a_offs, b_offs, pos = [], [], [], 0
    a_pad = torch.zeros(n_adapters, max(ranks), k, device=device, dtype=dt)
    bt_pad = torch.zeros(n_adapters, max(ranks), n, device=device, dtype=dt)
    for i, r in enumerate(ranks):
        a = (torch.randn(r, k, generator=gen, device=device) * k**-0.5).to(dt)
        bt = (torch.randn(r, n, generator=gen, device=device) * r**-0.5).to(dt)
        a_pad[i, :r], bt_pad[i, :r] = a, bt
        parts += [a.reshape(-1), bt.reshape(-1)]
        a_offs.append(pos)
        b_offs.append(pos + r * k)
        pos += r * (k + n)
    pool = torch.cat(parts)
    row_ad = torch.arange(rows) % n_adapters
    row_ad = row_ad[torch.randperm(rows, generator=gen, device=device).cpu()]
    rank_rows = torch.tensor([ranks[a] for a in row_ad], dtype=torch.int32)
    rank_rows[:zero_rows] = 0
    s = {
        "pool": pool,
        "a_off": torch.tensor([a_offs[a] for a in row_ad], dtype=torch.int64, device=device),
        "b_off": torch.tensor([b_offs[a] for a in row_ad], dtype=torch.int64, device=device),
        "ranks": rank_rows.to(device),
        "scales": torch.full((rows,), 2.0, device=device),
        "x": torch.randn(rows, k, generator=gen, device=device).to(dt),
        "row_ad": row_ad.to(device),
        "a_pad": a_pad,
        "bt_pad": bt_pad,
        "groups": [],
        "unique_bytes": 2 * sum(ranks[a] * (k + n) for a in set(row_ad.tolist())),
    }
    for a in sorted(set(row_ad.tolist())):
        idx = (row_ad == a).nonzero().squeeze(1).to(device)
        r = ranks[a]
        s["groups"].append((idx, pool[a_offs[a] : a_offs[a] + r * k].view(r, k),
                            pool[b_offs[a] : b_offs[a] + r * n].view(r, n)))
    return s


def run_ours(s, n, y, cfg):
    return lg._lora_gather_triton(s["x"], s["pool"], s["a_off"], s["b_off"], s["ranks"], s["scales"], n, y,
                                  **LORA_CONFIGS[cfg])


def run_loop(s, y):
    for idx, a, bt in s["groups"]:
        d = (s["x"].index_select(0, idx) @ a.T) * 2.0 @ bt
        y.index_add_(0, idx, d)


def run_padded(s, y):
    a_g = s["a_pad"][s["row_ad"]]  # [B, Rmax, K]
    bt_g = s["bt_pad"][s["row_ad"]]  # [B, Rmax, N]
    sv = torch.bmm(s["x"][:, None, :], a_g.transpose(1, 2)) * 2.0
    y += torch.bmm(sv, bt_g)[:, 0]


def check_lora(device, fh, smoke):
    log("\n# lora_gather bf16 vs lora_gather_reference (rel. Frobenius error; tolerance 1e-2)", fh)
    gen = torch.Generator(device=device).manual_seed(1)
    cases = [(67, 45, 5, 3, 1)] if smoke else [(4096, 1024, 64, 64, 0), (4007, 1001, 37, 8, 5)]
    worst = 0.0
    for k, n, rows, n_ad, zero in cases:
        s = make_lora_set(n_ad, k, n, rows, device, gen, zero_rows=zero)
        want = lg.lora_gather_reference(s["x"], s["pool"], s["a_off"], s["b_off"], s["ranks"], s["scales"], n)
        y0 = torch.randn(rows, n, generator=gen, device=device).to(DT["dtype"])
        want_acc = y0.clone()
        lg.lora_gather_reference(s["x"], s["pool"], s["a_off"], s["b_off"], s["ranks"], s["scales"], n, out=want_acc)
        for cfg in LORA_CONFIGS:
            got = run_ours(s, n, None, cfg)
            acc = y0.clone()
            run_ours(s, n, acc, cfg)
            e1, e2 = rel_err(got, want), rel_err(acc, want_acc)
            worst = max(worst, e1, e2)
            ok = e1 < 1e-2 and e2 < 1e-2 and bool(torch.all(got[:zero] == 0))
            log(f"K={k} N={n} B={rows} adapters={n_ad} cfg={cfg:9s} delta {e1:.1e}  out+= {e2:.1e}  {'ok' if ok else 'FAIL'}", fh)
            FAILED.extend([] if ok else [f"lora_gather {cfg} K={k} N={n}"])
    return worst


def bench_lora(device, fh, timer, smoke):
    log("\n# lora_gather timing", fh)
    gen = torch.Generator(device=device).manual_seed(2)
    shapes = [(64, 48)] if smoke else [(4096, 4096), (4096, 1024), (4096, 14336)]
    batches = [1, 3] if smoke else [1, 16, 64, 256]
    counts = [2] if smoke else [8, 64]
    rows_out = []
    for k, n in shapes:
        w_sets = None
        for rows in batches:
            for n_ad in counts:
                if rows == 1 and n_ad != counts[0]:
                    continue  # one row uses one adapter either way
                probe = make_lora_set(n_ad, k, n, rows, device, gen)
                sets = [probe] + [make_lora_set(n_ad, k, n, rows, device, gen)
                                  for _ in range(max(0, min(64, math.ceil(ROTATE["bytes"] / probe["unique_bytes"])) - 1))]
                if w_sets is None:
                    w_count = max(1, min(32, math.ceil(ROTATE["bytes"] / (2 * k * n))))
                    w_sets = [torch.randn(n, k, device=device, dtype=DT["dtype"]) for _ in range(w_count)]
                ys = [torch.zeros(rows, n, device=device, dtype=DT["dtype"]) for _ in sets]
                xs = [s["x"] for s in sets]
                per = {}
                for cfg in LORA_CONFIGS:
                    per[cfg] = timer.graph(lambda: [run_ours(s, n, y, cfg) for s, y in zip(sets, ys)]) / len(sets)
                eager = timer.eager(lambda: [run_ours(s, n, y, "auto") for s, y in zip(sets, ys)]) / len(sets)
                loop = timer.graph(lambda: [run_loop(s, y) for s, y in zip(sets, ys)]) / len(sets)
                padded = timer.graph(lambda: [run_padded(s, y) for s, y in zip(sets, ys)]) / len(sets)
                base = timer.graph(lambda: [F.linear(xs[i % len(xs)], w) for i, w in enumerate(w_sets)]) / len(w_sets)
                best = min(per, key=per.get)
                ub = sum(s["unique_bytes"] for s in sets) / len(sets)
                row = {
                    "K": k, "N": n, "B": rows, "adapters": len(probe["groups"]), "ours_us": per["auto"],
                    "best_cfg": best, "best_us": per[best], "ours_eager_us": eager, "loop_us": loop,
                    "padded_us": padded, "base_linear_us": base, "unique_adapter_MB": ub / 1e6,
                    "ours_GBps": ub / per["auto"] / 1e3, "configs_us": per,
                }
                rows_out.append(row)
                log(json.dumps({k2: (round(v, 2) if isinstance(v, float) else v) for k2, v in row.items()
                                if k2 != "configs_us"}), fh)
                log("   configs: " + " ".join(f"{c}={t:.1f}" for c, t in per.items()), fh)
                del sets, ys
            torch.cuda.empty_cache() if device.type == "cuda" else None
    return rows_out


# ---------------------------------------------------------------------------------------------
# paged decode attention
# ---------------------------------------------------------------------------------------------


def make_kv(rows, lens, layers, hq, hkv, d, page, device, gen):
    pages_per_row = max(-(-n // page) for n in lens)
    num_pages = rows * pages_per_row
    pool = torch.randn(num_pages, layers, 2, page, hkv, d, device=device, dtype=DT["dtype"], generator=gen)
    table = torch.randperm(num_pages, device=device, generator=gen).view(rows, pages_per_row).int()
    q = torch.randn(rows, hq, d, device=device, dtype=DT["dtype"], generator=gen)
    return q, pool, table, torch.tensor(lens, dtype=torch.int32, device=device)


def attn_knobs(cfg, rows, hkv, max_tokens, device):
    knobs = dict(ATTN_CONFIGS[cfg])
    if knobs.get("splits") in ("x2", "half"):
        block_t = 64 if device.type == "cuda" else 16
        auto = pa._num_splits(rows * hkv, triton.cdiv(max_tokens, block_t), device)
        knobs["splits"] = 2 * auto if knobs["splits"] == "x2" else max(1, auto // 2)
    return knobs


def run_attn(q, pool, layer, table, lens, cfg, window=None):
    knobs = attn_knobs(cfg, q.shape[0], pool.shape[4], table.shape[1] * pool.shape[3], q.device)
    return pa._paged_decode_attention_triton(q, pool, layer, table, lens, q.shape[2] ** -0.5, window, **knobs)


def run_gather_sdpa(q, pool, layer, table, gqa=True):
    """Gather the pages into dense K/V, then SDPA with GQA (or with K/V repeated per q head)."""
    b, hq, d = q.shape
    _, _, _, page, hkv, _ = pool.shape
    kv = pool[:, layer][table.long()]  # [B, pages, 2, S, Hkv, D]
    k = kv[:, :, 0].reshape(b, -1, hkv, d).transpose(1, 2)
    v = kv[:, :, 1].reshape(b, -1, hkv, d).transpose(1, 2)
    if not gqa:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    return F.scaled_dot_product_attention(q[:, :, None, :], k, v, enable_gqa=gqa)[:, :, 0]


def check_attn(device, fh, smoke):
    log("\n# paged decode attention bf16 vs paged_decode_attention_reference (tolerance 2e-2)", fh)
    gen = torch.Generator(device=device).manual_seed(3)
    hq, hkv, d, page = (8, 2, 32, 16) if smoke else (32, 8, 128, 16)
    lens = [1, 16, 17, 40] if smoke else [1, 16, 17, 700, 2048, 1999, 64, 1500] * 2
    q, pool, table, seq_lens = make_kv(len(lens), lens, 2, hq, hkv, d, page, device, gen)
    worst = 0.0
    for window in (None, 24 if smoke else 1024):
        want = pa.paged_decode_attention_reference(q, pool, 1, table, seq_lens, scale=d**-0.5, sliding_window=window)
        for cfg in ATTN_CONFIGS:
            e = rel_err(run_attn(q, pool, 1, table, seq_lens, cfg, window), want)
            worst = max(worst, e)
            log(f"B={len(lens)} lens up to {max(lens)} window={window} cfg={cfg:10s} {e:.1e} {'ok' if e < 2e-2 else 'FAIL'}", fh)
            FAILED.extend([] if e < 2e-2 else [f"paged attention {cfg} window={window}"])
    return worst


def bench_attn(device, fh, timer, smoke):
    log("\n# paged decode attention timing (every row at the full context)", fh)
    gen = torch.Generator(device=device).manual_seed(4)
    hq, hkv, d, page = (8, 2, 32, 16) if smoke else (32, 8, 128, 16)
    contexts = [40] if smoke else [512, 2048, 8192]
    batches = [1, 3] if smoke else [1, 16, 64, 256]
    rows_out = []
    for ctx in contexts:
        for rows in batches:
            layer_bytes = rows * ctx * hkv * d * 2 * 2
            layers = max(1, min(64, math.ceil(ROTATE["bytes"] / layer_bytes)))
            q, pool, table, lens = make_kv(rows, [ctx] * rows, layers, hq, hkv, d, page, device, gen)
            per = {}
            for cfg in ATTN_CONFIGS:
                per[cfg] = timer.graph(lambda: [run_attn(q, pool, l, table, lens, cfg) for l in range(layers)]) / layers
            eager = timer.eager(lambda: [run_attn(q, pool, l, table, lens, "auto") for l in range(layers)]) / layers
            sdpa_gqa = timer.graph(lambda: [run_gather_sdpa(q, pool, l, table) for l in range(layers)]) / layers
            sdpa_rep = timer.graph(lambda: [run_gather_sdpa(q, pool, l, table, False) for l in range(layers)]) / layers
            sdpa = min(sdpa_gqa, sdpa_rep)
            best = min(per, key=per.get)
            row = {
                "B": rows, "context": ctx, "ours_us": per["auto"], "best_cfg": best, "best_us": per[best],
                "ours_eager_us": eager, "gather_sdpa_us": sdpa, "sdpa_gqa_us": sdpa_gqa,
                "sdpa_repeat_us": sdpa_rep, "kv_MB": layer_bytes / 1e6,
                "ours_GBps": layer_bytes / per["auto"] / 1e3, "configs_us": per,
            }
            rows_out.append(row)
            log(json.dumps({k2: (round(v, 2) if isinstance(v, float) else v) for k2, v in row.items()
                            if k2 != "configs_us"}), fh)
            log("   configs: " + " ".join(f"{c}={t:.1f}" for c, t in per.items()), fh)
            del q, pool, table, lens
            torch.cuda.empty_cache() if device.type == "cuda" else None
    return rows_out


# ---------------------------------------------------------------------------------------------
# fused decode epilogues (q/k/v + RoPE + KV write, gate/up + SwiGLU, add + RMSNorm)
# ---------------------------------------------------------------------------------------------

QKV = {"hq": 32, "hkv": 8, "d": 128}  # 8B attention
EPI_RANK = 16


def make_group_set(k, widths, rows, n_adapters, rank, device, gen):
    """A pool holding n_adapters adapters (rank ``rank`` on every projection of the group) and
    a GatheredLora routing row i to adapter i % n_adapters; plus random outputs to add into."""
    dt = DT["dtype"]
    parts, offs, pos = [], [], 0
    for _ in range(n_adapters):
        per = []
        for n in widths:
            parts += [(torch.randn(rank, k, generator=gen, device=device) * k**-0.5).to(dt).reshape(-1),
                      (torch.randn(rank, n, generator=gen, device=device) * rank**-0.5).to(dt).reshape(-1)]
            per.append((pos, pos + rank * k))
            pos += rank * (k + n)
        offs.append(per)
    row_ad = [i % n_adapters for i in range(rows)]
    a_off = torch.tensor([[offs[a][g][0] for a in row_ad] for g in range(len(widths))], device=device)
    b_off = torch.tensor([[offs[a][g][1] for a in row_ad] for g in range(len(widths))], device=device)
    lora = lg.GatheredLora(torch.randn(rows, k, generator=gen, device=device).to(dt), torch.cat(parts), a_off, b_off,
                           torch.full((len(widths), rows), rank, dtype=torch.int32, device=device),
                           torch.full((rows,), 2.0, device=device))
    y = torch.randn(rows, sum(widths), generator=gen, device=device).to(dt)
    return {"lora": lora, "y": y, "unique_bytes": 2 * min(rows, n_adapters) * rank * len(widths) * k
            + 2 * min(rows, n_adapters) * rank * sum(widths)}


def make_rope_inputs(rows, device, gen, layers):
    dt = DT["dtype"]
    hkv, d = QKV["hkv"], QKV["d"]
    page = 16
    pages = rows + 1
    pool = torch.randn(pages, layers, 2, page, hkv, d, generator=gen, device=device).to(dt)
    angle = torch.rand(rows, d // 2, generator=gen, device=device) * 6.0
    angle = torch.cat((angle, angle), dim=-1)
    return {"kv": pool, "cos": angle.cos().to(dt), "sin": angle.sin().to(dt),
            "pages": torch.randperm(pages, generator=gen, device=device)[:rows],
            "slots": torch.randint(0, page, (rows,), generator=gen, device=device)}


def qkv_views(y):
    hq, hkv, d = QKV["hq"], QKV["hkv"], QKV["d"]
    t = y.shape[0]
    q, k, v = y.split((hq * d, hkv * d, hkv * d), dim=1)
    return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)


def run_qkv_new(s, r, layer, lora=True, cfg="auto"):
    q, k, v = qkv_views(s["y"])
    le.rope_write_kv(q, k, v, r["cos"], r["sin"], r["kv"], layer, r["pages"], r["slots"],
                     lora=s["lora"] if lora else None, backend="triton", **SHRINK_CONFIGS[cfg])


def run_qkv_old(s, r, layer, lora=True):
    """The engine's previous path: a lora_gather per projection, eager RoPE, write_kv."""
    q, k, v = qkv_views(s["y"])
    if lora:
        l = s["lora"]
        for g, y in enumerate(s["y"].split((q.shape[1] * q.shape[2], k.shape[1] * k.shape[2],
                                            v.shape[1] * v.shape[2]), dim=1)):
            lg.lora_gather(l.x, l.pool, l.a_offsets[g], l.b_offsets[g], l.ranks[g], l.scales, y.shape[1], out=y,
                           backend="triton")
    cos, sin = r["cos"][:, None, :], r["sin"][:, None, :]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    pa.write_kv(r["kv"], layer, k, v, r["pages"], r["slots"])
    return q


def run_gu_new(s, lora=True, cfg="auto"):
    n = s["y"].shape[1] // 2
    return le.swiglu(s["y"][:, :n], s["y"][:, n:], lora=s["lora"] if lora else None, backend="triton",
                     **SHRINK_CONFIGS[cfg])


def run_gu_old(s, lora=True):
    n = s["y"].shape[1] // 2
    g, u = s["y"][:, :n], s["y"][:, n:]
    if lora:
        l = s["lora"]
        for i, y in enumerate((g, u)):
            lg.lora_gather(l.x, l.pool, l.a_offsets[i], l.b_offsets[i], l.ranks[i], l.scales, n, out=y,
                           backend="triton")
    return F.silu(g) * u


def check_epilogues(device, fh, smoke):
    log("\n# fused epilogues bf16 vs references (rel. Frobenius error; tolerance 1e-2)", fh)
    gen = torch.Generator(device=device).manual_seed(5)
    rows = 5 if smoke else 64
    k, widths_qkv, inter = (64, None, 48) if smoke else (4096, None, 14336)
    if smoke:
        QKV.update(hq=4, hkv=2, d=16)
    widths_qkv = (QKV["hq"] * QKV["d"], QKV["hkv"] * QKV["d"], QKV["hkv"] * QKV["d"])
    worst = 0.0
    s = make_group_set(k, widths_qkv, rows, rows, EPI_RANK, device, gen)
    r = make_rope_inputs(rows, device, gen, 2)
    want_kv, want_y = r["kv"].clone(), s["y"].clone()
    le.rope_write_kv_reference(*qkv_views(want_y), r["cos"], r["sin"], want_kv, 1, r["pages"], r["slots"], s["lora"])
    y0, kv0 = s["y"].clone(), r["kv"].clone()
    for cfg in SHRINK_CONFIGS:
        s["y"].copy_(y0)
        r["kv"].copy_(kv0)
        run_qkv_new(s, r, 1, True, cfg)
        e = max(rel_err(s["y"], want_y), rel_err(r["kv"], want_kv))
        worst = max(worst, e)
        log(f"rope_write_kv B={rows} cfg={cfg:8s} {e:.1e} {'ok' if e < 1e-2 else 'FAIL'}", fh)
        FAILED.extend([] if e < 1e-2 else [f"rope_write_kv {cfg}"])
    s = make_group_set(k, (inter, inter), rows, rows, EPI_RANK, device, gen)
    want = le.swiglu_reference(s["y"][:, :inter], s["y"][:, inter:], s["lora"])
    for cfg in SHRINK_CONFIGS:
        e = rel_err(run_gu_new(s, True, cfg), want)
        worst = max(worst, e)
        log(f"swiglu B={rows} cfg={cfg:8s} {e:.1e} {'ok' if e < 1e-2 else 'FAIL'}", fh)
        FAILED.extend([] if e < 1e-2 else [f"swiglu {cfg}"])
    h = torch.randn(rows, k, generator=gen, device=device).to(DT["dtype"])
    o = torch.randn(rows, k, generator=gen, device=device).to(DT["dtype"])
    w = torch.rand(k, generator=gen, device=device).to(DT["dtype"])
    e = rel_err(add_rms_norm(h.clone(), o, w, 1e-5, backend="triton"), rms_norm(h + o, w, 1e-5))
    worst = max(worst, e)
    log(f"add_rms_norm B={rows} {e:.1e} {'ok' if e < 1e-2 else 'FAIL'}", fh)
    FAILED.extend([] if e < 1e-2 else ["add_rms_norm"])
    return worst


def bench_epilogues(device, fh, timer, smoke):
    log("\n# fused epilogues timing (r=16, each row its own adapter up to 64 adapters)", fh)
    gen = torch.Generator(device=device).manual_seed(6)
    k, inter = (64, 48) if smoke else (4096, 14336)
    widths_qkv = (QKV["hq"] * QKV["d"], QKV["hkv"] * QKV["d"], QKV["hkv"] * QKV["d"])
    dt = DT["dtype"]
    out = []
    for rows in ([3] if smoke else [16, 64, 256]):
        n_ad = min(rows, 64)
        for group, widths in (("qkv", widths_qkv), ("gate_up", (inter, inter))):
            probe = make_group_set(k, widths, rows, n_ad, EPI_RANK, device, gen)
            count = max(1, min(16, math.ceil(ROTATE["bytes"] / probe["unique_bytes"])))
            sets = [probe] + [make_group_set(k, widths, rows, n_ad, EPI_RANK, device, gen) for _ in range(count - 1)]
            w_count = max(1, min(8, math.ceil(ROTATE["bytes"] / (2 * k * sum(widths)))))
            ws = [torch.randn(sum(widths), k, generator=gen, device=device).to(dt) for _ in range(w_count)]
            xs = [s["lora"].x for s in sets]
            res = {"group": group, "B": rows, "adapters": n_ad, "sets": count,
                   "unique_adapter_MB": probe["unique_bytes"] / 1e6}
            if group == "qkv":
                ropes = [make_rope_inputs(rows, device, gen, 4) for _ in range(2)]

                def each(fn):
                    return lambda: [fn(s, ropes[i % 2], i % 4) for i, s in enumerate(sets)]

                res["old_lora_us"] = timer.graph(each(lambda s, r, l: run_qkv_old(s, r, l, True))) / count
                res["old_base_us"] = timer.graph(each(lambda s, r, l: run_qkv_old(s, r, l, False))) / count
                res["new_base_us"] = timer.graph(each(lambda s, r, l: run_qkv_new(s, r, l, False))) / count
                cfgs = {c: timer.graph(each(lambda s, r, l, c=c: run_qkv_new(s, r, l, True, c))) / count
                        for c in SHRINK_CONFIGS}
            else:
                res["old_lora_us"] = timer.graph(lambda: [run_gu_old(s, True) for s in sets]) / count
                res["old_base_us"] = timer.graph(lambda: [run_gu_old(s, False) for s in sets]) / count
                res["new_base_us"] = timer.graph(lambda: [run_gu_new(s, False) for s in sets]) / count
                cfgs = {c: timer.graph(lambda c=c: [run_gu_new(s, True, c) for s in sets]) / count
                        for c in SHRINK_CONFIGS}
            res["new_lora_us"], res["configs_us"] = cfgs["auto"], cfgs
            res["best_cfg"] = min(cfgs, key=cfgs.get)
            res["gemm_fused_us"] = timer.graph(lambda: [F.linear(xs[i % count], w) for i, w in enumerate(ws)]) / w_count
            splits = [w.split(widths) for w in ws]
            res["gemm_split_us"] = timer.graph(
                lambda: [[F.linear(xs[i % count], wi) for wi in sp] for i, sp in enumerate(splits)]) / w_count
            res["adapter_GBps"] = probe["unique_bytes"] / (res["new_lora_us"] - res["new_base_us"]) / 1e3 \
                if res["new_lora_us"] > res["new_base_us"] else float("nan")
            out.append(res)
            log(json.dumps({kk: (round(v, 2) if isinstance(v, float) else v) for kk, v in res.items()
                            if kk != "configs_us"}), fh)
            log("   configs: " + " ".join(f"{c}={t:.1f}" for c, t in cfgs.items()), fh)
            del sets, ws, xs
            torch.cuda.empty_cache() if device.type == "cuda" else None
        hs = [torch.randn(rows, k, generator=gen, device=device).to(dt) for _ in range(8)]
        wn = torch.rand(k, generator=gen, device=device).to(dt)
        eager = timer.graph(lambda: [rms_norm(h + hs[i - 1], wn, 1e-5) for i, h in enumerate(hs)]) / len(hs)
        fused = timer.graph(lambda: [add_rms_norm(h, hs[i - 1], wn, 1e-5, backend="triton")
                                     for i, h in enumerate(hs)]) / len(hs)
        out.append({"group": "add_rms_norm", "B": rows, "old_base_us": eager, "new_base_us": fused})
        log(json.dumps(out[-1]), fh)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes (tests the script)")
    parser.add_argument("--sections", default="lora,attention,epilogues",
                        help="comma-separated: lora, attention, epilogues")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    device = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:
        DT["dtype"] = torch.float32
        ROTATE["bytes"] = 1
    args.out.mkdir(parents=True, exist_ok=True)
    fh = open(args.out / "bench_decode_kernels.log", "w")
    name = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name()
    log(f"device: {name}; torch {torch.__version__}; triton {triton.__version__}; python {platform.python_version()}; "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", fh)
    timer = Timer(args.smoke)
    t0 = time.time()
    lora_err = check_lora(device, fh, args.smoke) if "lora" in sections else float("nan")
    attn_err = check_attn(device, fh, args.smoke) if "attention" in sections else float("nan")
    epi_err = check_epilogues(device, fh, args.smoke) if "epilogues" in sections else float("nan")
    log(f"checks done in {time.time() - t0:.0f} s", fh)
    epi = bench_epilogues(device, fh, timer, args.smoke) if "epilogues" in sections else []
    log(f"epilogue timing done at {time.time() - t0:.0f} s", fh)
    lora = bench_lora(device, fh, timer, args.smoke) if "lora" in sections else []
    log(f"lora timing done at {time.time() - t0:.0f} s", fh)
    attn = bench_attn(device, fh, timer, args.smoke) if "attention" in sections else []
    log(f"attention timing done at {time.time() - t0:.0f} s", fh)
    (args.out / "bench_decode_kernels.json").write_text(json.dumps(
        {"device": name, "lora_bf16_worst_err": lora_err, "attn_bf16_worst_err": attn_err,
         "epilogue_bf16_worst_err": epi_err, "lora": lora, "attention": attn, "epilogues": epi}, indent=1))

    log("\n## lora_gather, us per call (graph replay; eager = CUDA events around eager calls)", fh)
    log("| K->N | B | adapters | ours | ours eager | best cfg | per-adapter loop | pad to max rank | x W^T | ours / x W^T | GB/s |", fh)
    log("|---|---|---|---|---|---|---|---|---|---|---|", fh)
    for r in lora:
        log(f"| {r['K']}->{r['N']} | {r['B']} | {r['adapters']} | {r['ours_us']:.1f} | {r['ours_eager_us']:.1f} | "
            f"{r['best_cfg']} {r['best_us']:.1f} | {r['loop_us']:.1f} | {r['padded_us']:.1f} | {r['base_linear_us']:.1f} | "
            f"{r['ours_us'] / r['base_linear_us']:.0%} | {r['ours_GBps']:.0f} |", fh)
    log("\n## paged decode attention, us per call (Hq=32, Hkv=8, D=128, page 16)", fh)
    log("| B | context | ours | ours eager | best cfg | gather + SDPA (better of GQA / repeated K,V) | speed-up | KV GB/s |", fh)
    log("|---|---|---|---|---|---|---|---|", fh)
    for r in attn:
        log(f"| {r['B']} | {r['context']} | {r['ours_us']:.1f} | {r['ours_eager_us']:.1f} | {r['best_cfg']} {r['best_us']:.1f} | "
            f"{r['gather_sdpa_us']:.1f} | {r['gather_sdpa_us'] / r['ours_us']:.1f}x | {r['ours_GBps']:.0f} |", fh)
    log("\n## fused epilogues, us per call (graph replay; old = the engine's previous ops)", fh)
    log("| op | B | old, LoRA | fused, LoRA | best shrink cfg | old, base | fused, base | GEMMs split / fused |", fh)
    log("|---|---|---|---|---|---|---|---|", fh)
    for r in epi:
        if r["group"] == "add_rms_norm":
            log(f"| add + RMSNorm | {r['B']} | | | | {r['old_base_us']:.1f} | {r['new_base_us']:.1f} | |", fh)
            continue
        log(f"| {r['group']} | {r['B']} | {r['old_lora_us']:.1f} | {r['new_lora_us']:.1f} | {r['best_cfg']} "
            f"{r['configs_us'][r['best_cfg']]:.1f} | {r['old_base_us']:.1f} | {r['new_base_us']:.1f} | "
            f"{r['gemm_split_us']:.1f} / {r['gemm_fused_us']:.1f} |", fh)
    log(f"\nbf16 checks: {'FAILED: ' + ', '.join(FAILED) if FAILED else 'all passed'} "
        f"(worst lora_gather {lora_err:.1e}, attention {attn_err:.1e}, epilogues {epi_err:.1e})", fh)
    fh.close()


if __name__ == "__main__":
    main()
