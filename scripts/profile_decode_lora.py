"""Where one layer's decode LoRA spends its time: every kernel it launches, timed, with its grid and bytes.

The layer is ``bench_decode_groups``' (8B shape by default: the RoPE + KV epilogue with q/k/v's
LoRA, o's gather, the SwiGLU epilogue with gate/up's LoRA, down's gather; ``--layers`` layers of
their own adapter weights per pass, so a pass does not find the adapters in L2). For each case
(B rows over A adapters drawn uniformly, each rank set of ``--rank-sets``) and each mode of
``MODES`` (the LoRA paths: per row, the grouped shrink, both grouped, and variants of their
blocks and warps), it prints:

- per layer: the CUDA-graph time (``harness.kernel_ms``), the sum of its kernels' times under
  ``torch.profiler`` (eager; CUDA kernel events, grid and block from the trace), the launches
  per layer, and the time over ``base`` (the same kernels without LoRA);
- per kernel (summed over the layer's launches of it, by the piece of the layer that launched
  it: qkv, o, gate_up, down): µs per layer, launches, grid, achieved occupancy as the trace
  estimates it, the bytes it must move (the distinct adapters' A or Bᵀ once, the activations it
  reads and writes) and those bytes over its time (GB/s), beside the bytes the per-row kernels
  actually fetch (each row re-reads its adapter: "row bytes", from L2 when adapters repeat).

Every mode's outputs are checked against the per-row path's (``max_rel_diff``).

On CUDA each mode's pass is also captured as one CUDA graph, as the engine's decode graphs
capture a step: its nodes by kind per layer (kernels, memsets, copies; the graph's debug dump),
and from profiled replays each node's time and the gap before it (the GPU idle between the
previous node's end and its start), with the first layer's nodes one by one for the modes
"old" (the blocks before the few-rows ones) and "engine". Few rows (1-16), mixed ranks, rows on
their own adapters and sharing them, the engine against before:

    PYTHONPATH=. python3 scripts/profile_decode_lora.py --cases 1x1,4x4c,16x16c,64x64c,16x4,64x16 \
        --rank-sets "64,4,32,8,16" --modes base,old,engine,few_k64,few_k256,few_r32,few_n128,few_rows64 --out $OUT

    PYTHONPATH=. python3 scripts/profile_decode_lora.py --out $OUT
    PYTHONPATH=. TRITON_INTERPRET=1 python3 scripts/profile_decode_lora.py --device cpu --dtype float32 --tiny \\
        --cases 16x3,8x8c --rank-sets 4,8 --modes base,per_row,grouped --layers 1 --out /tmp/pdl

The grouped shrink's occupancy knobs at 256 / 128 rows over Zipf-drawn adapters, the fastest
mode's settings written for ``bench_tenants.py --decode-lora-knobs`` (``--best-knobs``):

    PYTHONPATH=.:scripts python3 scripts/profile_decode_lora.py --cases 256x104z,128x80z \
        --rank-sets "4,8,16,32,64" --modes base,engine,gsplit4,gs_w8,gs_r32,gs_r64_w8,gs_k128u,gs_r32_k128u,\
gs_r64_w8_k128u,gs_s256,gs_st1,ew8,g128_r64_w8 --gemms --best-knobs $OUT/best_knobs.txt --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from collections import defaultdict

from harness import add_device_args, add_output_args, comma_list, device_info, dtype_of, kernel_ms, logger, write_json

import torch  # noqa: E402

import bench_decode_groups as bdg  # noqa: E402
from lightning_lorafusion.kernels import lora_gather as lg  # noqa: E402
from lightning_lorafusion.kernels.lora_ahead import ShrinkAhead  # noqa: E402
from lightning_lorafusion.kernels.lora_epilogues import rope_write_kv, swiglu_ahead  # noqa: E402
from lightning_lorafusion.kernels.lora_gather import (GatheredLora, adapter_groups, expand_beside,  # noqa: E402
                                                       lora_gather, shrink_beside)
from lightning_lorafusion.kernels.rms_norm import add_rms_norm  # noqa: E402

log = logger("profile_decode_lora")

NEVER = 10**9
# mode -> lora_gather module settings (row bounds and knobs); "base" runs no LoRA
MODES = {
    "base": {},
    # the engine: per row below GROUPED_MIN_ROWS (256) rows, from there the grouped shrink with
    # its one-row groups per row, K tiles of 256 in splits of 512, the expands per row
    "engine": {},
    # the engine before that: the grouped shrink's K tile and split 512, every group by the dot
    "before": {"GROUPED_SHRINK_SINGLE_ROWS": False, "GROUPED_SHRINK_BLOCK_K": 512, "GROUPED_SHRINK_SPLIT_K": 512},
    "per_row": {"GROUPED_MIN_ROWS": NEVER, "GROUPED_EXPAND_MIN_ROWS": None},
    "shrink_grouped": {"GROUPED_MIN_ROWS": 0, "GROUPED_EXPAND_MIN_ROWS": None, "GROUPED_SHRINK_SINGLE_ROWS": False,
                       "GROUPED_SHRINK_BLOCK_K": 512, "GROUPED_SHRINK_SPLIT_K": 512},
    "shrink_hybrid": {"GROUPED_MIN_ROWS": 0, "GROUPED_EXPAND_MIN_ROWS": None},
    "shrink_hybrid_k512": {"GROUPED_MIN_ROWS": 0, "GROUPED_EXPAND_MIN_ROWS": None, "GROUPED_SHRINK_BLOCK_K": 512,
                           "GROUPED_SHRINK_SPLIT_K": 512},
    # the expands grouped too
    "grouped": {"GROUPED_MIN_ROWS": 0, "GROUPED_EXPAND_MIN_ROWS": 0, "GROUPED_SHRINK_SINGLE_ROWS": False,
                "GROUPED_SHRINK_BLOCK_K": 512, "GROUPED_SHRINK_SPLIT_K": 512},
    "grouped_hybrid": {"GROUPED_MIN_ROWS": 0, "GROUPED_EXPAND_MIN_ROWS": 0},
    "grouped_hybrid_half": {"GROUPED_MIN_ROWS": 0, "GROUPED_EXPAND_MIN_ROWS": 0, "GROUPED_EXPAND_DOT": "half"},
    "grouped_hybrid_n128": {"GROUPED_MIN_ROWS": 0, "GROUPED_EXPAND_MIN_ROWS": 0, "GROUPED_EXPAND_BLOCK_N": 128},
    # the expand's groups of at most 1 / 4 rows by the row loop, larger ones by the dot
    "grouped_hybrid_loop1": {"GROUPED_MIN_ROWS": 0, "GROUPED_EXPAND_MIN_ROWS": 0, "GROUPED_EXPAND_LOOP_ROWS": 1},
    "grouped_hybrid_loop4": {"GROUPED_MIN_ROWS": 0, "GROUPED_EXPAND_MIN_ROWS": 0, "GROUPED_EXPAND_LOOP_ROWS": 4},
    # the per-row kernels' blocks and warps (the engine's: K block 512, 4 warps; expand columns 256, 4 warps)
    "per_row_k256": {"GROUPED_MIN_ROWS": NEVER, "GROUPED_EXPAND_MIN_ROWS": None, "ROW_SHRINK_BLOCK_K": 256},
    "per_row_k1024": {"GROUPED_MIN_ROWS": NEVER, "GROUPED_EXPAND_MIN_ROWS": None, "ROW_SHRINK_BLOCK_K": 1024},
    "per_row_w8": {"GROUPED_MIN_ROWS": NEVER, "GROUPED_EXPAND_MIN_ROWS": None, "ROW_SHRINK_WARPS": 8,
                   "ROW_EXPAND_WARPS": 8},
    "per_row_n128": {"GROUPED_MIN_ROWS": NEVER, "GROUPED_EXPAND_MIN_ROWS": None, "ROW_EXPAND_BLOCK_N": 128},
    "per_row_n512": {"GROUPED_MIN_ROWS": NEVER, "GROUPED_EXPAND_MIN_ROWS": None, "ROW_EXPAND_BLOCK_N": 512,
                     "ROW_EXPAND_WARPS": 8},
    # few rows: the engine's path before the few-rows blocks (K blocks of 512, rank blocks of 16,
    # expand columns 256, the epilogues' column sets one after the other), the paired epilogues
    # alone, and variants of the few-rows blocks (at most FEW_ROWS rows; K 256, rank 64, columns 64)
    "old": {"FEW_ROWS": None, "PAIR_EPILOGUES": False, "RANK_SPLIT_MAX_ROWS": None, "PDL": False},
    "pair": {"FEW_ROWS": None, "RANK_SPLIT_MAX_ROWS": None},
    "few16": {"FEW_ROWS": 16},
    "few16_k128": {"FEW_ROWS": 16, "FEW_SHRINK_BLOCK_K": 128},
    # the shrink's rank blocks over 4 programs (up to 64 rows), with the blocks of before
    "rsplit": {"FEW_ROWS": None, "RANK_SPLIT_MAX_ROWS": 64},
    "rsplit_r32": {"FEW_ROWS": None, "RANK_SPLIT_MAX_ROWS": 64, "RANK_SPLIT": 2},
    "few_k64": {"FEW_SHRINK_BLOCK_K": 64},
    "few_k256": {"FEW_SHRINK_BLOCK_K": 256},
    "few_k512": {"FEW_SHRINK_BLOCK_K": 512},
    "few_r32": {"FEW_BLOCK_R": 32},
    "few_n32": {"FEW_EXPAND_BLOCK_N": 32},
    "few_n128": {"FEW_EXPAND_BLOCK_N": 128},
    "few_n256": {"FEW_EXPAND_BLOCK_N": 256},
    # SwiGLU's LoRA rows compute down's shrink (one launch less per layer) up to 16 / 64 rows
    "ahead": {"AHEAD_MAX_ROWS": 16},
    "ahead_rows64": {"AHEAD_MAX_ROWS": 64, "FEW_ROWS": 64},
    # the few-rows blocks up to 32 / 64 rows
    "few_rows32": {"FEW_ROWS": 32},
    "few_rows64": {"FEW_ROWS": 64},
    # programmatic dependent launch between each shrink and the kernel reading its partials, on / off
    "pdl": {"PDL": True},
    "nopdl": {"PDL": False},
    "pdl_nosplit": {"PDL": True, "RANK_SPLIT_MAX_ROWS": None},
    "nosplit": {"PDL": False, "RANK_SPLIT_MAX_ROWS": None},
    # the engine's rank variant (``lora_gather.decode_rank_bound`` of the case's largest rank: no
    # split and PDL where it is at most UNSPLIT_MAX_RANK), and that bound at 16 / 32 / 64
    "bound": {},
    "bound16": {"UNSPLIT_MAX_RANK": 16},
    "bound32": {"UNSPLIT_MAX_RANK": 32},
    "bound64": {"UNSPLIT_MAX_RANK": 64},
    # each group's shrink on a second stream beside the frozen GEMM reading its input (with
    # --gemms; the engine's decode steps of at most BESIDE_MAX_ROWS rows), with the rank variant
    # (o's expand beside its GEMM too, its delta added by the norm after o: EXPAND_BESIDE)
    "beside": {"BESIDE_MAX_ROWS": 64},
    "beside_shrinks": {"BESIDE_MAX_ROWS": 64, "EXPAND_BESIDE": False},
    # the same up to 256 rows, the grouped shrink (from GROUPED_MIN_ROWS) beside too
    "beside256": {"BESIDE_MAX_ROWS": 256, "BESIDE_GROUPED": True},
    "beside256_shrinks": {"BESIDE_MAX_ROWS": 256, "BESIDE_GROUPED": True, "EXPAND_BESIDE": False},
    # the grouped shrink's rank chunks over 2 / 4 programs, its warps 8; the per-row expands' (and
    # SwiGLU's LoRA rows') column blocks of 128
    "gsplit2": {"GROUPED_RANK_SPLIT": 2},
    "gsplit4": {"GROUPED_RANK_SPLIT": 4},
    "gs_w8": {"GROUPED_SHRINK_WARPS": 8},
    "n128": {"ROW_EXPAND_BLOCK_N": 128},
    # the grouped shrink's occupancy and bytes in flight: rank chunks of 32 / 64 (a rank-64 group's
    # A tile in one load), with 8 warps, K tiles of 128, splits of 256 (twice the programs, twice the
    # partials for the expands), pipelining stages 1 / 2, rank split with 8 warps
    "gs_r32": {"GROUPED_SHRINK_BLOCK_R": 32},
    "gs_r64": {"GROUPED_SHRINK_BLOCK_R": 64},
    "gs_r64_w8": {"GROUPED_SHRINK_BLOCK_R": 64, "GROUPED_SHRINK_WARPS": 8},
    "gs_r64_w8_k128": {"GROUPED_SHRINK_BLOCK_R": 64, "GROUPED_SHRINK_WARPS": 8, "GROUPED_SHRINK_BLOCK_K": 128},
    "gs_r32_k128": {"GROUPED_SHRINK_BLOCK_R": 32, "GROUPED_SHRINK_BLOCK_K": 128},
    "gs_s256": {"GROUPED_SHRINK_BLOCK_K": 256, "GROUPED_SHRINK_SPLIT_K": 256},
    "gs_r64_w8_s256": {"GROUPED_SHRINK_BLOCK_R": 64, "GROUPED_SHRINK_WARPS": 8, "GROUPED_SHRINK_BLOCK_K": 256,
                       "GROUPED_SHRINK_SPLIT_K": 256},
    "gs_st1": {"GROUPED_SHRINK_STAGES": 1},
    "gs_st3": {"GROUPED_SHRINK_STAGES": 3},
    # the grouped shrink as before its pipelining stages were set (Triton's default)
    "gs_st_default": {"GROUPED_SHRINK_STAGES": None},
    "gs_st2": {"GROUPED_SHRINK_STAGES": 2},
    "gsplit4_w8": {"GROUPED_RANK_SPLIT": 4, "GROUPED_SHRINK_WARPS": 8},
    # K tiles of 128 in the splits of 512, unrolled (all four tiles' loads in flight at once), with
    # rank chunks of 16 / 32 / 64
    "gs_k128u": {"GROUPED_SHRINK_BLOCK_K": 128, "GROUPED_SHRINK_UNROLL_K": True},
    "gs_r32_k128u": {"GROUPED_SHRINK_BLOCK_R": 32, "GROUPED_SHRINK_BLOCK_K": 128, "GROUPED_SHRINK_UNROLL_K": True},
    "gs_r64_w8_k128u": {"GROUPED_SHRINK_BLOCK_R": 64, "GROUPED_SHRINK_WARPS": 8, "GROUPED_SHRINK_BLOCK_K": 128,
                        "GROUPED_SHRINK_UNROLL_K": True},
    "gsplit2_r32": {"GROUPED_RANK_SPLIT": 2, "GROUPED_SHRINK_BLOCK_R": 32},
    # the per-row expands' (and SwiGLU's LoRA rows') warps 8, with column blocks of 256 / 512
    "ew8": {"ROW_EXPAND_WARPS": 8},
    "n512_w8": {"ROW_EXPAND_BLOCK_N": 512, "ROW_EXPAND_WARPS": 8},
    # the grouped shrink from 128 rows (the per-row one below), with the engine's blocks and 64-rank chunks
    "g128": {"GROUPED_MIN_ROWS": 128},
    "g128_r64_w8": {"GROUPED_MIN_ROWS": 128, "GROUPED_SHRINK_BLOCK_R": 64, "GROUPED_SHRINK_WARPS": 8},
    "g128_r64": {"GROUPED_MIN_ROWS": 128, "GROUPED_SHRINK_BLOCK_R": 64},
    # the engine's decode steps ("wide": every shrink beside its GEMM, EngineTuning.decode_lora_beside;
    # the grouped shrink from GROUPED_MIN_ROWS, 32), "wide_g256": the grouped shrink from 256 rows
    # only (the default before), "g32": from 32 rows whatever the default; the hybrid expands from
    # 32 rows (groups of 2+ rows by one dot each, in the per-row launches of o, down and SwiGLU;
    # "sep": launches of their own; "g4": groups of 4+ rows)
    "wide": {"BESIDE_MAX_ROWS": 256, "BESIDE_GROUPED": True},
    "wide_g256": {"BESIDE_MAX_ROWS": 256, "BESIDE_GROUPED": True, "GROUPED_MIN_ROWS": 256},
    "wide_g32": {"BESIDE_MAX_ROWS": 256, "BESIDE_GROUPED": True, "GROUPED_MIN_ROWS": 32},
    "wide_hyb": {"BESIDE_MAX_ROWS": 256, "BESIDE_GROUPED": True, "HYBRID_MIN_ROWS": 32},
    "wide_g32_hyb": {"BESIDE_MAX_ROWS": 256, "BESIDE_GROUPED": True, "GROUPED_MIN_ROWS": 32, "HYBRID_MIN_ROWS": 32},
    "wide_g32_hyb_sep": {"BESIDE_MAX_ROWS": 256, "BESIDE_GROUPED": True, "GROUPED_MIN_ROWS": 32,
                         "HYBRID_MIN_ROWS": 32, "HYBRID_FUSED": False},
    "wide_g32_hyb_g4": {"BESIDE_MAX_ROWS": 256, "BESIDE_GROUPED": True, "GROUPED_MIN_ROWS": 32,
                        "HYBRID_MIN_ROWS": 32, "HYBRID_MIN_GROUP": 4},
    # the hybrid launches with Triton's default pipelining stages (3) instead of 1
    "wide_g32_hyb_st3": {"BESIDE_MAX_ROWS": 256, "BESIDE_GROUPED": True, "GROUPED_MIN_ROWS": 32,
                         "HYBRID_MIN_ROWS": 32, "HYBRID_STAGES": None},
    # the hybrid with q/k/v's groups in the RoPE + KV epilogue too (HYBRID_QKV); its group programs'
    # columns 256 at a time instead of 64 (HYBRID_GROUP_N)
    "wide_g32_hyb_qkv": {"BESIDE_MAX_ROWS": 256, "BESIDE_GROUPED": True, "GROUPED_MIN_ROWS": 32,
                         "HYBRID_MIN_ROWS": 32, "HYBRID_QKV": True},
    "wide_g32_hyb_n256": {"BESIDE_MAX_ROWS": 256, "BESIDE_GROUPED": True, "GROUPED_MIN_ROWS": 32,
                          "HYBRID_MIN_ROWS": 32, "HYBRID_GROUP_N": 256},
}
BOUND_MODES = ("bound", "bound16", "bound32", "bound64", "beside", "beside_shrinks", "beside256",
               "beside256_shrinks") + tuple(m for m in MODES if m.startswith("wide"))  # (the case's rank bound)
SETTINGS = tuple(sorted({k for m in MODES.values() for k in m}))
# settings off in every mode that does not name them (the others take the module's default)
OFF_UNLESS_NAMED = ("BESIDE_MAX_ROWS",)
# (name, projections, input width key, outputs' widths keys) of the layer's four pieces
PIECES = (("qkv", (0, 1, 2)), ("o", (3,)), ("gate_up", (4, 5)), ("down", (6,)))


def apply_mode(mode: str, defaults: dict) -> None:
    for name in SETTINGS:
        setattr(lg, name, MODES[mode].get(name, None if name in OFF_UNLESS_NAMED else defaults[name]))


def run_layers(s: dict, lora: bool, groups, annotate: bool = False) -> list[torch.Tensor]:
    """``bench_decode_groups.run_layers`` with each piece in a ``record_function`` range (the
    profile maps every kernel to the piece that launched it); with ``s["weights"]`` (``--gemms``)
    each piece's frozen GEMM first, its LoRA shrink beside it where ``BESIDE_MAX_ROWS`` says so
    (``shrink_beside`` on ``s["stream"]``, as the engine's paged forward), and the residual add
    + RMSNorm after o (o's expand beside too with ``EXPAND_BESIDE``, its delta added there).
    -> each layer's SwiGLU output, and with the norm its output too."""
    hq, hkv, d, inter = s["heads"]
    b, outs = s["b"], []
    weights, stream = s.get("weights"), s.get("stream")

    def gemm(name, x):
        if weights is not None:
            torch.matmul(x, weights[name].t(), out=s[name])

    def piece(name):
        return torch.profiler.record_function(f"piece:{name}") if annotate else _Null()

    for t in s["tables"]:
        def gathered(name, x):
            return GatheredLora(x, s["pool"], *t[name], s["scales"], groups=groups,
                                rank_bound=s.get("rank_bound")) if lora else None
        q, k, v = s["qkv"].split([hq * d, hkv * d, hkv * d], dim=1)
        with piece("qkv"):
            with shrink_beside(gathered("qkv", s["x"]), stream) as qkv_lora:
                gemm("qkv", s["x"])
            rope_write_kv(q.view(b, hq, d), k.view(b, hkv, d), v.view(b, hkv, d), s["cos"], s["sin"], s["kv"], 0,
                          s["slot_pages"], s["slot_offsets"], lora=qkv_lora, backend="triton")
        with piece("o"):
            with shrink_beside(gathered("o", s["attn"]), stream) as o_lora:
                delta = None
                if o_lora is not None and o_lora.partials is not None and lg.EXPAND_BESIDE and weights is not None:
                    delta = expand_beside(o_lora, s["o"].shape[1], stream)
                gemm("o", s["attn"])
            if weights is not None:
                if lora and delta is None:
                    a_off, b_off, rk = t["o"]
                    lora_gather(s["attn"], s["pool"], a_off[0], b_off[0], rk[0], s["scales"], s["o"].shape[1],
                                out=s["o"], backend="triton", groups=groups, rank_bound=s.get("rank_bound"),
                                partials=o_lora.partials)
                outs.append(add_rms_norm(s["h"], s["o"], s["norm_w"], 1e-5, backend="triton",
                                         lora=None if delta is None else (delta, 0)))
            elif lora:
                a_off, b_off, rk = t["o"]
                lora_gather(s["attn"], s["pool"], a_off[0], b_off[0], rk[0], s["scales"], s["o"].shape[1],
                            out=s["o"], backend="triton", groups=groups, rank_bound=s.get("rank_bound"),
                            partials=o_lora.partials)
        with piece("gate_up"):  # down's shrink folded in where AHEAD_MAX_ROWS says so (as the engine)
            with shrink_beside(gathered("gate_up", s["x"]), stream) as gate_up_lora:
                gemm("gu", s["x"])
            ahead = ShrinkAhead(s["pool"], t["down"][0][0], t["down"][2][0]) if lora else None
            act, partials = swiglu_ahead(s["gu"][:, :inter], s["gu"][:, inter:], lora=gate_up_lora,
                                         ahead=ahead, backend="triton")
        with piece("down"):  # down reads SwiGLU's output, as in the engine
            with shrink_beside(gathered("down", act) if partials is None else None, stream) as down_lora:
                gemm("down", act)
            if lora:
                a_off, b_off, rk = t["down"]
                lora_gather(act, s["pool"], a_off[0], b_off[0], rk[0], s["scales"], s["down"].shape[1],
                            out=s["down"], backend="triton", groups=groups,
                            partials=partials or (down_lora and down_lora.partials), rank_bound=s.get("rank_bound"))
        outs.append(act)
    return outs


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def piece_bytes(s: dict, args, row_adapter: list[int], rank_of: list[int], esz: int) -> dict:
    """Per piece: the distinct adapters' A and Bᵀ bytes, what the per-row kernels fetch of them
    (every row its own copy), the input's and the outputs' bytes."""
    dims = bdg.projection_dims(args.shape)
    distinct = sorted(set(row_adapter))
    out = {}
    for name, ps in PIECES:
        k = dims[ps[0]][0]
        n = sum(dims[p][1] for p in ps)
        out[name] = {"a": sum(rank_of[a] for a in distinct) * k * len(ps) * esz,
                     "b": sum(rank_of[a] for a in distinct) * n * esz,
                     "a_rows": sum(rank_of[a] for a in row_adapter) * k * len(ps) * esz,
                     "b_rows": sum(rank_of[a] for a in row_adapter) * n * esz,
                     "x": len(row_adapter) * k * esz, "y": len(row_adapter) * n * esz}
    return out


def parse_trace(path: str, reps: int, layers: int) -> list[dict]:
    """The chrome trace's CUDA kernels -> one entry per (piece, kernel name, grid): µs and
    launches per layer, block, occupancy. A kernel's piece is the ``piece:`` range whose CPU
    span holds the launch call with the kernel's correlation id."""
    events = json.load(open(path))["traceEvents"]
    ranges = sorted((e["ts"], e["ts"] + e["dur"], e["name"][6:]) for e in events
                    if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("piece:"))
    gpu_ranges = sorted((e["ts"], e["ts"] + e["dur"], e["name"][6:]) for e in events
                        if e.get("cat") == "gpu_user_annotation" and str(e.get("name", "")).startswith("piece:"))
    launch_ts = {e["args"]["correlation"]: e["ts"] for e in events
                 if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}

    def piece_of(kernel):
        ts = launch_ts.get(kernel.get("args", {}).get("correlation"))
        found = next((p for lo, hi, p in ranges if ts is not None and lo <= ts <= hi), None)
        # no launch record for it: the GPU-side range its start falls in
        return found or next((p for lo, hi, p in gpu_ranges if lo <= kernel["ts"] < hi), "?")

    table = defaultdict(lambda: {"us": 0.0, "launches": 0, "occupancy": []})
    for e in events:
        if e.get("cat") != "kernel":
            continue
        a = e.get("args", {})
        key = (piece_of(e), e["name"], tuple(a.get("grid", ())), tuple(a.get("block", ())))
        row = table[key]
        row["us"] += e["dur"]
        row["launches"] += 1
        if "est. achieved occupancy %" in a:
            row["occupancy"].append(a["est. achieved occupancy %"])
    per = reps * layers
    return [{"piece": p, "kernel": name, "grid": list(grid), "block": list(block), "us": v["us"] / per,
             "launches": v["launches"] / per,
             "occupancy_pct": sum(v["occupancy"]) / len(v["occupancy"]) if v["occupancy"] else None}
            for (p, name, grid, block), v in table.items()]


def kernel_bytes(k: dict, pieces: dict, lora: bool) -> tuple[int | None, int | None]:
    """(bytes the kernel must move, bytes the per-row form fetches) from its piece and role: a
    shrink reads A and x; an expand or epilogue reads Bᵀ and reads + writes the outputs."""
    p = pieces.get(k["piece"])
    if p is None:
        return None, None
    if "shrink" in k["kernel"]:
        return p["a"] + p["x"], p["a_rows"] + p["x"]
    adapters = (p["b"], p["b_rows"]) if lora else (0, 0)
    return adapters[0] + 2 * p["y"], adapters[1] + 2 * p["y"]


def profile_mode(s: dict, mode: str, device, groups, reps: int) -> dict:
    """Graph time per layer and the profiler's kernels of ``reps`` eager passes."""
    lora = mode != "base"
    layers = len(s["tables"])
    run_layers(s, lora, groups)  # compiles
    res = {"mode": mode}
    if device.type != "cuda":
        return res
    res["graph_us"] = 1e3 * kernel_ms(lambda: run_layers(s, lora, groups), graph=True) / layers
    torch.cuda.synchronize()
    try:
        res["graph"] = graph_profile(s, lora, groups, reps)
    except Exception as exc:  # (no CUPTI on the machine): keep the graph time
        log(f"graph profile failed: {type(exc).__name__}: {exc}")
    torch.cuda.synchronize()
    try:
        kernels = _profiled_kernels(s, lora, groups, reps, layers)
    except Exception as exc:  # (no CUPTI on the machine): keep the graph time
        log(f"profiler failed: {type(exc).__name__}: {exc}")
        return res
    for k in kernels:
        k["bytes"], k["row_bytes"] = kernel_bytes(k, s["pieces"], lora)
        k["gbps"] = k["bytes"] / (k["us"] * 1e3) if k["bytes"] and k["us"] else None
    res["kernels"] = sorted(kernels, key=lambda k: ("qkv o gate_up down ?".split().index(k["piece"]), -k["us"]))
    res["kernel_us"] = sum(k["us"] for k in kernels)
    res["launches"] = sum(k["launches"] for k in kernels)
    return res


def _profiled_kernels(s: dict, lora: bool, groups, reps: int, layers: int) -> list[dict]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run_layers(s, lora, groups, annotate=True)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        return parse_trace(path, reps, layers)


NODE_KINDS = ("KERNEL", "MEMSET", "MEMCPY", "EMPTY", "HOST", "EVENT_RECORD", "WAIT_EVENT", "MEM_ALLOC", "MEM_FREE")
KIND_WORD = re.compile(r"(?<![A-Z_])(" + "|".join(NODE_KINDS) + r")(?![A-Z_])")


def count_nodes(dot: str) -> dict:
    """A CUDA graph's debug dump (DOT) -> nodes by kind (KERNEL, MEMSET, ...; "other"): each node
    definition (``"graph_i_node_j"[...]``, its label over one line or several) by the first kind
    word in it."""
    starts = list(re.finditer(r'"graph_\d+_node_\d+"\s*\[', dot))
    counts: dict = defaultdict(int)
    for i, m in enumerate(starts):
        body = dot[m.end():starts[i + 1].start() if i + 1 < len(starts) else len(dot)]
        found = [(w.start(), w.group(1)) for w in KIND_WORD.finditer(body)]
        counts[min(found)[1] if found else "other"] += 1
    return dict(counts)


def graph_profile(s: dict, lora: bool, groups, reps: int) -> dict:
    """One pass captured as a CUDA graph, as the engine's decode graphs capture a step: its nodes
    by kind (the graph's debug dump: kernels, memsets, copies) and, from ``reps`` profiled
    replays, each node's time and the gap before it (the GPU idle between the previous node's
    end and this one's start: what a node waits on besides its predecessor's work). Per layer."""
    layers = len(s["tables"])
    graph = torch.cuda.CUDAGraph()
    graph.enable_debug_mode()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run_layers(s, lora, groups)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        run_layers(s, lora, groups)
    res: dict = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "graph.dot")
            graph.debug_dump(path)
            res["nodes"] = {k: v / layers for k, v in count_nodes(open(path).read()).items()}
    except Exception as exc:  # (a torch without the dump): keep the times
        log(f"graph dump failed: {type(exc).__name__}: {exc}")
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = sorted((e for e in json.load(open(path))["traceEvents"]
                         if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")), key=lambda e: e["ts"])
    per = len(events) // reps if reps else 0
    if not per:
        return res
    timeline = []
    for i in range(per):
        these = [events[j * per + i] for j in range(reps)]
        gaps = [e["ts"] - (events[j * per + i - 1]["ts"] + events[j * per + i - 1]["dur"])
                for j, e in enumerate(these) if i > 0]
        timeline.append({"kernel": these[0]["name"], "kind": these[0].get("cat"),
                         "grid": these[0].get("args", {}).get("grid"), "us": sum(e["dur"] for e in these) / reps,
                         "gap_us": sum(gaps) / len(gaps) if gaps else None})
    res["timeline"] = timeline[: per // layers]  # the first layer
    res["busy_us"] = sum(t["us"] for t in timeline) / layers
    res["gap_us"] = sum(t["gap_us"] or 0.0 for t in timeline) / layers
    res["nodes_traced"] = per / layers
    kinds = {"kernel": "KERNEL", "gpu_memset": "MEMSET", "gpu_memcpy": "MEMCPY"}
    res["nodes_traced_by_kind"] = {kinds[k]: sum(t["kind"] == k for t in timeline) / layers for k in kinds}
    return res


def outputs(s: dict, groups) -> list[torch.Tensor]:
    """One pass from the in-place buffers' first values -> what it wrote (fp32): q|k|v, down, and o
    (without the norm: with ``--gemms`` the residual stream instead, o's LoRA may be added there)."""
    for k in bdg.IN_PLACE + (("h",) if "h" in s else ()):
        s[k].copy_(s["init"][k])
    outs = run_layers(s, True, groups)
    keys = ("qkv", "down") + (("h",) if "h" in s else ("o",))
    return [s[k].float().clone() for k in keys] + [a.float() for a in outs]


def case(args, b: int, a: int, ranks: list[int], device, dtype, defaults: dict, gbps, cycle: bool = False,
         weights: dict | None = None) -> dict:
    s = bdg.layer_step(b, a, ranks, args, device, dtype, cycle=cycle)
    if weights is not None:
        s["weights"] = weights
        s["stream"] = torch.cuda.Stream(device) if device.type == "cuda" else None
        s["h"] = torch.randn(b, weights["o"].shape[0], device=device, dtype=dtype)
        s["norm_w"] = torch.rand(weights["o"].shape[0], device=device, dtype=dtype) + 0.5
    s["init"] = {k: s[k].clone() for k in bdg.IN_PLACE + (("h",) if "h" in s else ())}
    rank_of = [ranks[i % len(ranks)] for i in range(a)]
    row_adapter = [k - 1 for k in s["keys"]]
    s["pieces"] = piece_bytes(s, args, row_adapter, rank_of, s["pool"].element_size())
    groups = adapter_groups(s["keys"], b).to(device)
    apply_mode("per_row", defaults)
    want = outputs(s, groups)
    row = {"rows": b, "adapters": a, "cycled": cycle, "ranks": ",".join(map(str, ranks)),
           "distinct": len(set(row_adapter)),
           "adapter_bytes": s["bytes_present"], "floor_us": s["bytes_present"] / (gbps * 1e3) if gbps else None,
           "modes": []}
    for mode in args.modes:
        apply_mode(mode, defaults)
        s["rank_bound"] = lg.decode_rank_bound(b, max((rank_of[x] for x in row_adapter if x >= 0), default=0)) \
            if mode in BOUND_MODES else None
        try:
            res = profile_mode(s, mode, device, groups, args.reps)
        except Exception as exc:  # noqa: BLE001 - keep the other modes' numbers
            log(f"{b}x{a} {mode} failed: {type(exc).__name__}: {exc}")
            if device.type == "cuda":
                torch.cuda.synchronize()
            row["modes"].append({"mode": mode, "error": f"{type(exc).__name__}: {exc}"})
            continue
        res["rank_bound"] = s["rank_bound"]
        if mode != "base":
            got = outputs(s, groups)
            res["max_rel_diff"] = max(float((g - w).abs().max() / w.abs().max().clamp_min(1e-30))
                                      for g, w in zip(got, want))
        row["modes"].append(res)
        log(f"{b}x{a} r={row['ranks']} {mode}: graph {res.get('graph_us')} µs/layer, "
            f"{res.get('launches')} launches, diff {res.get('max_rel_diff')}")
    apply_mode("per_row", defaults)
    s["rank_bound"] = None
    return row


def fmt(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


def kernel_tables(rows: list[dict]) -> list[str]:
    """Per case and mode: each kernel's line."""
    lines = []
    for r in rows:
        for m in r["modes"]:
            if not m.get("kernels"):
                continue
            lines += [f"\n{r['rows']} x {r['adapters']}{_draw(r)} (ranks {r['ranks']}), {m['mode']}: graph {fmt(m.get('graph_us'))} "
                      f"µs per layer, kernels {fmt(m.get('kernel_us'))} µs, {fmt(m.get('launches'), '.0f')} launches",
                      "| piece | kernel | µs | launches | grid | occ % | MB needed | MB per-row | GB/s |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for k in m["kernels"]:
                lines.append(f"| {k['piece']} | {k['kernel'][:40]} | {k['us']:.1f} | {k['launches']:.0f} | "
                             f"{'x'.join(map(str, k['grid']))} | {fmt(k['occupancy_pct'], '.0f')} | "
                             f"{fmt(k['bytes'] and k['bytes'] / 1e6, '.2f')} | "
                             f"{fmt(k['row_bytes'] and k['row_bytes'] / 1e6, '.2f')} | {fmt(k['gbps'], '.0f')} |")
    return lines


def graph_tables(rows: list[dict]) -> list[str]:
    """Per case: each mode's captured layer (nodes by kind, busy and gap µs); then the first
    layer's node timeline of the modes "old" and "engine"."""
    lines = ["| case | mode | graph µs | nodes per layer (kernel / memset / other) | busy µs | gaps µs |",
             "|" + "---|" * 6]
    timelines = []
    for r in rows:
        name = f"{r['rows']} x {r['adapters']}{_draw(r)} ({r['ranks']})"
        for m in r["modes"]:
            g = m.get("graph")
            if not g:
                continue
            n = g.get("nodes") or g.get("nodes_traced_by_kind", {})  # the dump, else the traced replays
            other = sum(v for k, v in n.items() if k not in ("KERNEL", "MEMSET"))
            lines.append(f"| {name} | {m['mode']} | {fmt(m.get('graph_us'))} | {fmt(n.get('KERNEL'), '.0f')} / "
                         f"{fmt(n.get('MEMSET', 0), '.0f')} / {fmt(other, '.0f')} | {fmt(g.get('busy_us'))} "
                         f"| {fmt(g.get('gap_us'))} |")
            if m["mode"] in ("old", "engine", "bound", "beside", "wide", "wide_g32_hyb", "wide_g32_hyb_qkv") \
                    and g.get("timeline"):
                timelines += [f"\n{name}, {m['mode']}: one captured layer, node by node",
                              "| node | grid | µs | gap before µs |", "|---|---|---|---|"]
                timelines += [f"| {t['kernel'][:48]} | {'x'.join(map(str, t['grid'] or []))} | {t['us']:.1f} "
                              f"| {fmt(t['gap_us'])} |" for t in g["timeline"]]
    return lines + timelines


def summary_table(rows: list[dict]) -> list[str]:
    """One line per case and mode: graph time, its part over base (× the per-row path's, × the
    engine's before and × the rank variant's "bound", where run), kernel time, launches."""
    lines = ["| rows x adapters ('c': every adapter present) (ranks) | floor µs | mode | graph µs | LoRA +µs "
             "| × old | × before | × bound | × wide | kernels µs | launches | max rel diff |", "|" + "---|" * 12]
    for r in rows:
        modes = {m["mode"]: m for m in r["modes"]}
        base = modes.get("base", {}).get("graph_us")

        def lora_us(name):
            g = modes.get(name, {}).get("graph_us")
            return None if g is None or base is None else g - base

        for m in r["modes"]:
            over = lora_us(m["mode"])
            ratios = [None if over is None or not lora_us(ref) else over / lora_us(ref)
                      for ref in ("old", "before", "bound", "wide")]
            lines.append(f"| {r['rows']} x {r['adapters']}{_draw(r)} ({r['ranks']}) "
                         f"| {fmt(r['floor_us'])} | {m['mode']} | {fmt(m.get('graph_us'))} | {fmt(over)} "
                         f"| {fmt(ratios[0], '.2f')} | {fmt(ratios[1], '.2f')} | {fmt(ratios[2], '.2f')} "
                         f"| {fmt(ratios[3], '.2f')} | {fmt(m.get('kernel_us'))} "
                         f"| {fmt(m.get('launches'), '.0f')} | {fmt(m.get('max_rel_diff'), '.1e')} |")
    return lines


def layer_weights(shape: str, device, dtype) -> dict:
    """The layer's frozen weights ``[N, K]`` by the buffer their GEMM writes (qkv, o, gu, down)."""
    dims = bdg.projection_dims(shape)
    g = torch.Generator(device=device).manual_seed(11)

    def w(n, k):
        return (torch.randn(n, k, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype)

    return {"qkv": w(sum(n for _, n in dims[:3]), dims[0][0]), "o": w(dims[3][1], dims[3][0]),
            "gu": w(dims[4][1] + dims[5][1], dims[4][0]), "down": w(dims[6][1], dims[6][0])}


def _draw(r: dict) -> str:
    """A case's suffix: "c" (row i on adapter i % adapters), "z" (Zipf popularity), "" (uniform)."""
    return {True: "c", "zipf": "z"}.get(r["cycled"], "")


def parse_cases(text: str) -> list[tuple[int, int, bool | str]]:
    """"64x8,64x64c,256x96z" -> [(64, 8, False), (64, 64, True), (256, 96, "zipf")] (rows, adapters,
    how rows draw them: uniformly, cycled, by Zipf(0.8) popularity)."""
    cases = []
    for c in text.split(","):
        cycle = True if c.endswith("c") else "zipf" if c.endswith("z") else False
        b, a = c.rstrip("cz").split("x")
        cases.append((int(b), int(a), cycle))
    return cases


def main(argv=None) -> dict:
    """The profile; the kernels' module settings are put back after it."""
    defaults = {name: getattr(lg, name) for name in SETTINGS}
    try:
        return _main(argv, defaults)
    finally:
        for name, value in defaults.items():
            setattr(lg, name, value)


def _main(argv, defaults: dict) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_args(ap)
    ap.add_argument("--tiny", action="store_const", const="tiny", dest="shape", default="8b",
                    help="a tiny layer (for the interpreter) instead of the 8B shape")
    ap.add_argument("--cases", type=parse_cases, default=parse_cases("64x64c,64x64,64x8,256x8,256x64"),
                    help="rows x adapters, comma-separated; a trailing 'c': row i on adapter i %% adapters (every "
                         "adapter in the batch, S-LoRA's setting), a trailing 'z': drawn by Zipf(0.8) popularity (the "
                         "many-tenant trace's), else rows drawn uniformly")
    ap.add_argument("--rank-sets", type=lambda t: [[int(r) for r in x.split(",")] for x in t.split(";")],
                    default=[[16], [4, 8, 16, 32, 64]], help="';'-separated rank lists, each cycled over adapters")
    ap.add_argument("--modes", type=comma_list(tuple(MODES)), default=list(MODES))
    ap.add_argument("--layers", type=int, default=4, help="layers of their own adapter weights per pass")
    ap.add_argument("--reps", type=int, default=5, help="profiled passes")
    ap.add_argument("--stop-s", type=float, default=1e9, help="no new case after this many seconds")
    ap.add_argument("--gemms", action="store_true",
                    help="each piece runs its frozen GEMM too (one set of the layer's weights, shared by the "
                         "--layers layers): what the LoRA adds is then over a layer with its GEMMs, and the "
                         "'beside' modes can hide the shrinks behind them")
    ap.add_argument("--best-knobs", default=None,
                    help="write the settings of the fastest mode (the least captured-layer time summed over the "
                         "cases, outputs within 2 %% of the per-row path's; not 'base') to this file as "
                         "NAME=VALUE,... (bench_tenants.py --decode-lora-knobs); empty: no mode beat 'engine'")
    add_output_args(ap)
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), dtype_of(args.dtype)
    start = time.monotonic()
    gbps = bdg.copy_gbps(device)
    weights = layer_weights(args.shape, device, dtype) if args.gemms else None
    rows = []
    for ranks in args.rank_sets:
        for b, a, cycle in args.cases:
            if time.monotonic() > start + args.stop_s:
                log(f"--stop-s reached: {b}x{a} r={ranks} not run")
                continue
            rows.append(case(args, b, a, ranks, device, dtype, defaults, gbps, cycle, weights))
            write_json(args.out, "profile_decode_lora.json", {**device_info(device), "args": vars(args),
                                                              "copy_gbps": gbps, "modes": MODES, "rows": rows})
    head = f"per layer ({args.shape} shape, {args.dtype}, {args.layers} layers per pass, copy {fmt(gbps, '.0f')} GB/s)"
    text = "\n".join([head] + kernel_tables(rows) + ["", "captured layers"] + graph_tables(rows)
                     + ["", head] + summary_table(rows))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "profile_decode_lora.md"), "w") as f:
            f.write(text + "\n")
    print(text)
    if args.best_knobs:
        best = best_mode(rows)
        with open(args.best_knobs, "w") as f:
            f.write(",".join(f"{k}={v!r}" for k, v in MODES.get(best, {}).items()))
        log(f"fastest mode: {best} {MODES.get(best)}")
    return {"rows": rows}


def best_mode(rows: list[dict], max_diff: float = 0.02) -> str | None:
    """The mode (not "base") of the least captured-layer time summed over every case, among those
    run in all of them without error and within ``max_diff`` of the per-row path's outputs."""
    total: dict = defaultdict(float)
    seen: dict = defaultdict(int)
    for r in rows:
        for m in r["modes"]:
            ok = m.get("graph_us") is not None and (m.get("max_rel_diff") or 0.0) <= max_diff
            if m["mode"] != "base" and "error" not in m and ok:
                total[m["mode"]] += m["graph_us"]
                seen[m["mode"]] += 1
    fits = [m for m in total if seen[m] == len(rows)]
    return min(fits, key=total.__getitem__) if fits else None


if __name__ == "__main__":
    main()
