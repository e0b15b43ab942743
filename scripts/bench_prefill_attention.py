"""GPU check and timing of the paged prefill attention kernel (kernels/paged_prefill.py) in bf16.

1. bf16 correctness of every launcher configuration below against the torch reference (fp32 on
   the same inputs; tolerance 2e-2), plus a sliding window and Qwen2's GQA 7 on the default one.
2. Timing, one layer, page 16, Llama-3.2-1B heads (Hq 32, Hkv 8, D 64) and Llama-8B heads
   (Hq 32, Hkv 8, D 128), two batches:
   - "prefix": 64 requests of 512-token prompts whose first 256-448 tokens (a multiple of the
     page, uniform) are cached: the new 64-256 tokens attend over all 512. Ours (one launch)
     against what the runner did before (one gather + SDPA per request,
     ``paged_prefix_attention_reference``, then a concat) and FlashAttention varlen on K/V
     already gathered dense (the gather not timed; bottom-right causal, a lower bound for a
     gather-then-FlashAttention path).
   - "fresh": the same 64 prompts with nothing cached (512 new tokens each): ours reading the
     pages against FlashAttention varlen on the dense rows (the engine's path for fresh
     prompts, ``model.attention.varlen_causal_attention``).
   Times are medians of ``triton.testing.do_bench`` (CUDA events around eager calls, so the
   reference's per-request host work counts, as it did in the engine).

    PYTHONPATH=. python3 scripts/bench_prefill_attention.py --out DIR        # GPU, < 1 min
    PYTHONPATH=. TRITON_INTERPRET=1 python3 scripts/bench_prefill_attention.py --smoke --out DIR  # CPU
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import platform
import time
from pathlib import Path

import torch
import triton
import triton.testing

from lightning_lorafusion.kernels.paged_attention import paged_prefix_attention_reference
from lightning_lorafusion.kernels.paged_prefill import (
    _paged_prefill_attention_triton,
    paged_prefill_attention_reference,
)
from lightning_lorafusion.model.attention import varlen_causal_attention

CONFIGS = {  # launcher knobs (block_m counts rows: tokens x the group's query heads); "auto" = defaults
    "auto": {},  # the defaults: m128 n64 4 warps for D <= 64, else m128 n32 4 warps (stages 3)
    "m64_n64_w4": {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3},
    "m128_n32_w4": {"block_m": 128, "block_n": 32, "num_warps": 4, "num_stages": 3},
    "m128_n128_w8_s2": {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2},
}
HEADS = {"llama1b": (32, 8, 64), "llama8b": (32, 8, 128)}
TOL = 2e-2  # bf16: probabilities and output rounded to bf16 (unit roundoff 3.9e-3)
FAILED: list[str] = []


def log(msg: str, fh) -> None:
    print(msg, flush=True)
    fh.write(msg + "\n")
    fh.flush()


def rel_err(got, want) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def make_batch(starts, total, hq, hkv, d, page, dtype, device, gen):
    """Requests of ``total`` tokens each, ``starts[i]`` of them cached: a one-layer pool with the
    pages in random order holding every position's K/V, the new tokens' q, and the dense K/V
    of each whole sequence (for the FlashAttention baselines)."""
    n_req = len(starts)
    per = -(-total // page)
    pool = torch.randn(n_req * per + 8, 1, 2, page, hkv, d, device=device, generator=gen).to(dtype)
    table = torch.randperm(n_req * per + 8, device=device, generator=gen)[: n_req * per].view(n_req, per).int()
    lens = [total - s for s in starts]
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).int()
    q = torch.randn(int(cu[-1]), hq, d, device=device, generator=gen).to(dtype)
    kv = pool[:, 0][table.long()]  # [n, pages, 2, S, Hkv, D]
    k_dense = kv[:, :, 0].reshape(n_req, per * page, hkv, d)[:, :total].reshape(-1, hkv, d)
    v_dense = kv[:, :, 1].reshape(n_req, per * page, hkv, d)[:, :total].reshape(-1, hkv, d)
    return {
        "q": q, "pool": pool, "table": table, "cu": cu.to(device),
        "starts": torch.tensor(starts, dtype=torch.int32, device=device), "starts_host": list(starts),
        "cu_host": cu.tolist(), "max_new": max(lens), "k_dense": k_dense, "v_dense": v_dense, "total": total,
        "flops": sum(4 * hq * d * n * (s + (n + 1) / 2) for s, n in zip(starts, lens)),
    }


def run_ours(b, cfg, window=None):
    d = b["q"].shape[2]
    return _paged_prefill_attention_triton(b["q"], b["pool"], 0, b["cu"], b["starts"], b["table"], d**-0.5, window,
                                           max_seqlen=b["max_new"], **CONFIGS[cfg])


def run_reference(b, window=None):
    """The runner's former prefix path: one gather + SDPA per request (host bounds), a concat."""
    q, bounds, firsts = b["q"], b["cu_host"], b["starts_host"]
    return torch.cat([paged_prefix_attention_reference(q[a:e], b["pool"], 0, b["table"][i], firsts[i],
                                                       scale=q.shape[2] ** -0.5, sliding_window=window)
                      for i, (a, e) in enumerate(zip(bounds, bounds[1:]))])


def flash_dense(b):
    """FlashAttention varlen over dense K/V: q rows of the new tokens, k/v rows of whole
    sequences (bottom-right causal when they differ); None where this torch has no variant."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    q, k, v = b["q"], b["k_dense"], b["v_dense"]
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        kwargs = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        kwargs = {"is_causal": True}
    else:
        return None
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    else:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    n_req, total = len(b["starts_host"]), b["total"]
    cu_k = torch.arange(0, (n_req + 1) * total, total, dtype=torch.int32, device=q.device)
    return lambda: varlen_attn(q, k, v, b["cu"], cu_k, b["max_new"], total, **kwargs)


def timed(fn, smoke: bool) -> float:
    """Median µs per call."""
    if smoke:
        t = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - t)
    return 1e3 * triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median")


def check(device, dtype, fh, smoke, gen) -> float:
    log(f"\n# bf16 kernel vs reference (fp32 on the same inputs), tolerance {TOL}", fh)
    worst = 0.0
    page = 4 if smoke else 16
    starts = [0, 5, 23, 48] if smoke else [0, 17, 300, 448, 96, 256, 5, 511]
    total = 53 if smoke else 512
    cases = [("llama8b", None, list(CONFIGS)), ("llama8b", 24 if smoke else 200, ["auto"]),
             ("qwen2_7b", None, ["auto"]), ("llama1b", None, list(CONFIGS))]
    heads = dict(HEADS, qwen2_7b=(28, 4, 128))
    for name, window, cfgs in cases:
        hq, hkv, d = heads[name]
        if smoke:
            hq, hkv, d = hq // 4, max(1, hkv // 4), d // 4
        b = make_batch(starts, total, hq, hkv, d, page, dtype, device, gen)
        f32 = dict(b, q=b["q"].float(), pool=b["pool"].float())
        want = paged_prefill_attention_reference(f32["q"], f32["pool"], 0, b["cu"], b["starts"], b["table"],
                                                 scale=d**-0.5, sliding_window=window)
        for cfg in cfgs:
            e = rel_err(run_ours(b, cfg, window), want)
            worst = max(worst, e)
            ok = e < TOL
            log(f"{name} Hq={hq} Hkv={hkv} D={d} window={window} cfg={cfg:15s} {e:.1e} {'ok' if ok else 'FAIL'}", fh)
            FAILED.extend([] if ok else [f"{name} {cfg} window={window}"])
    return worst


def bench(device, dtype, fh, smoke, gen) -> list[dict]:
    log("\n# timing (one layer; µs per call)", fh)
    page, n_req, total = (4, 3, 40) if smoke else (16, 64, 512)
    lo, hi = (16, 28) if smoke else (256, 448)
    choices = list(range(lo, hi + 1, page))
    picks = torch.randint(len(choices), (n_req,), generator=torch.Generator().manual_seed(7))
    starts = [choices[int(i)] for i in picks]
    rows = []
    for name, (hq, hkv, d) in HEADS.items():
        if smoke:
            hq, hkv, d = hq // 4, hkv // 4, d // 4
        for case, case_starts in (("prefix", starts), ("fresh", [0] * n_req)):
            b = make_batch(case_starts, total, hq, hkv, d, page, dtype, device, gen)
            per = {cfg: timed(lambda: run_ours(b, cfg), smoke) for cfg in CONFIGS}
            best = min(per, key=per.get)
            row = {"heads": name, "Hq": hq, "Hkv": hkv, "D": d, "case": case, "requests": n_req,
                   "new_tokens": int(b["cu_host"][-1]), "ours_us": per["auto"], "best_cfg": best,
                   "best_us": per[best], "configs_us": per, "ours_TFLOPs": b["flops"] / per["auto"] / 1e6}
            flash = None if smoke else flash_dense(b)
            if case == "prefix":
                row["reference_us"] = timed(lambda: run_reference(b), smoke)
                if flash is not None:
                    try:
                        err = rel_err(flash(), run_ours(b, "auto"))
                        row["flash_dense_err_vs_ours"] = err
                        row["flash_dense_us"] = timed(flash, smoke) if err < TOL else None
                    except Exception as exc:  # a baseline only: report and go on
                        log(f"FlashAttention dense baseline failed: {exc!r}", fh)
            else:
                k, v = b["k_dense"], b["v_dense"]  # fresh: the dense rows are the new tokens' own
                row["reference_us"] = timed(lambda: varlen_causal_attention(
                    b["q"], k, v, b["cu"], scale=d**-0.5, max_seqlen=b["max_new"]), smoke)
            rows.append(row)
            log(json.dumps({k2: (round(v2, 2) if isinstance(v2, float) else v2) for k2, v2 in row.items()
                            if k2 != "configs_us"}), fh)
            log("   configs: " + " ".join(f"{c}={t:.1f}" for c, t in per.items()), fh)
            del b
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes, fp32 (tests the script)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    args.out.mkdir(parents=True, exist_ok=True)
    fh = open(args.out / "bench_prefill_attention.log", "w")
    name = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name()
    log(f"device: {name}; torch {torch.__version__}; triton {triton.__version__}; python {platform.python_version()}; "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", fh)
    gen = torch.Generator(device=device).manual_seed(0)
    t0 = time.time()
    worst = check(device, dtype, fh, args.smoke, gen)
    log(f"checks done in {time.time() - t0:.0f} s", fh)
    rows = bench(device, dtype, fh, args.smoke, gen)
    log(f"timing done at {time.time() - t0:.0f} s", fh)
    (args.out / "bench_prefill_attention.json").write_text(json.dumps(
        {"device": name, "torch": torch.__version__, "triton": triton.__version__, "bf16_worst_err": worst,
         "failed": FAILED, "rows": rows}, indent=1))

    log("\n## paged prefill attention, one layer, page 16, 64 requests x 512-token prompts, µs per call", fh)
    log("prefix: 256-448 cached, the rest new; reference = per-request gather + SDPA (the former runner "
        "path); FA dense = FlashAttention varlen on pre-gathered K/V (gather not timed)", fh)
    log("fresh: nothing cached (512 new each); reference = FlashAttention varlen on the dense rows "
        "(the engine's fresh path)", fh)
    log("| heads | case | new tokens | ours | best cfg | reference | FA dense | reference / ours | ours TFLOP/s |", fh)
    log("|---|---|---|---|---|---|---|---|---|", fh)
    for r in rows:
        fa = r.get("flash_dense_us")
        log(f"| {r['heads']} (Hq {r['Hq']}, Hkv {r['Hkv']}, D {r['D']}) | {r['case']} | {r['new_tokens']} | "
            f"{r['ours_us']:.1f} | {r['best_cfg']} {r['best_us']:.1f} | {r['reference_us']:.1f} | "
            f"{'-' if fa is None else f'{fa:.1f}'} | {r['reference_us'] / r['ours_us']:.2f}x | "
            f"{r['ours_TFLOPs']:.0f} |", fh)
    log(f"\nbf16 checks: {'FAILED: ' + ', '.join(FAILED) if FAILED else 'all passed'} (worst {worst:.1e})", fh)
    fh.close()


if __name__ == "__main__":
    main()
