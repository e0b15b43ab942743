"""GPU check and timing of the decode kernels (lora_gather, paged decode attention) in bf16.

1. bf16 correctness of every launcher configuration below against the torch references, on
   odd shapes (mixed ranks, rank-0 rows, random sequence lengths, a sliding window).
2. lora_gather at 8B decode shapes, K=4096 -> N in {4096, 1024, 14336}, B in {1, 16, 64, 256},
   8 or 64 adapters with ranks drawn from {8, 16, 32, 64} (rows spread over all of them), added
   in place into y, against: a per-adapter loop (gather rows, two matmuls, index_add), padding
   every adapter to the largest rank with gathered bmm, and the frozen linear x W^T itself.
3. paged decode attention, Hq=32, Hkv=8, D=128, page 16, every row at context 512/2048/8192,
   B in {1, 16, 64, 256}, against gathering the pages into dense K/V and running SDPA.

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

from lightning_lorafusion.kernels import lora_gather as lg  # noqa: E402
from lightning_lorafusion.kernels import paged_attention as pa  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes (tests the script)")
    args = parser.parse_args()
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
    lora_err = check_lora(device, fh, args.smoke)
    attn_err = check_attn(device, fh, args.smoke)
    log(f"checks done in {time.time() - t0:.0f} s", fh)
    lora = bench_lora(device, fh, timer, args.smoke)
    log(f"lora timing done at {time.time() - t0:.0f} s", fh)
    attn = bench_attn(device, fh, timer, args.smoke)
    log(f"attention timing done at {time.time() - t0:.0f} s", fh)
    (args.out / "bench_decode_kernels.json").write_text(json.dumps(
        {"device": name, "lora_bf16_worst_err": lora_err, "attn_bf16_worst_err": attn_err,
         "lora": lora, "attention": attn}, indent=1))

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
    log(f"\nbf16 checks: {'FAILED: ' + ', '.join(FAILED) if FAILED else 'all passed'} "
        f"(worst lora_gather {lora_err:.1e}, attention {attn_err:.1e})", fh)
    fh.close()


if __name__ == "__main__":
    main()
