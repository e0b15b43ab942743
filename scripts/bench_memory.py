"""Activation memory against speed: tokens/s and peak memory of our training step over an NF4 (or
bf16) base for each capacity x recomputation setting, with the bf16 base's row for reference, in
one process (same samples, same kernels as scripts/bench_e2e.py's "triton" variant).

A setting is ``none``, an ``mlp_recompute`` mode (``activation``, ``gate_up``), ``ckptN`` (the
first N layers checkpointed whole) or both joined by ``+`` (``ckpt8+activation``). Each row also
shows what ``model.activation_memory`` says the decoder layers keep for backward at that
capacity, and whether it meets the memory target: peak <= --target-gib at >= --target-ratio of the
best NF4 tokens/s of the run. Rows past --time-budget seconds are skipped (listed as such).

    PYTHONPATH=. python3 scripts/bench_memory.py --capacities 4096,8192 \\
        --settings none,activation,gate_up,ckpt4+gate_up --extra-rows 2048:none,2048:activation,2048:ckpt2+activation --out $OUT
    PYTHONPATH=. python3 scripts/bench_memory.py --shape tiny --layers 2 --device cpu --backend torch \\
        --samples 4 --capacities 256,512 --bf16-capacity 256   # smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import time

from harness import add_output_args, comma_list, device_info, write_json

import torch  # noqa: E402

from bench_e2e import add_workload_args, model_and_workload, run_ours  # noqa: E402
from lightning_lorafusion.model.activation_memory import step_activation_bytes  # noqa: E402
from lightning_lorafusion.model.decoder import DecoderOptions  # noqa: E402
from lightning_lorafusion.model.mlp_recompute import MLP_RECOMPUTE_MODES  # noqa: E402


def parse_setting(text: str) -> tuple[str, int]:
    """``"ckpt8+activation"`` -> (mlp_recompute, checkpointed layers)."""
    mode, layers = "none", 0
    for part in text.split("+"):
        if part.startswith("ckpt") and part[4:].isdigit():
            layers = int(part[4:])
        elif part in MLP_RECOMPUTE_MODES:
            mode = part
        else:
            raise argparse.ArgumentTypeError(f"setting {text!r}: each '+' part is one of {MLP_RECOMPUTE_MODES} "
                                             "or ckptN (N layers checkpointed)")
    return mode, layers


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap, layers=32)
    add_output_args(ap)
    ap.set_defaults(samples=16)
    ap.add_argument("--capacities", type=comma_list(cast=int), default=[4096, 8192])
    ap.add_argument("--settings", type=comma_list(), default=["none", "activation", "gate_up", "ckpt4+gate_up"])
    ap.add_argument("--extra-rows", type=comma_list(), default=[],
                    help="more rows after the sweep, each CAPACITY:SETTING (e.g. 2048:none,2048:activation)")
    ap.add_argument("--base-precision", choices=("nf4", "bf16"), default="nf4", help="the swept base")
    ap.add_argument("--bf16-capacity", type=int, default=8192,
                    help="capacity of the bf16-base reference row, run first (0: none)")
    ap.add_argument("--backend", choices=("triton", "torch"), default="triton")
    ap.add_argument("--target-gib", type=float, default=16.0)
    ap.add_argument("--target-ratio", type=float, default=0.9)
    ap.add_argument("--time-budget", type=float, default=270.0,
                    help="seconds from the start; a row that would end past it (as long as the longest so "
                         "far) is skipped")
    args = ap.parse_args(argv)
    for s in args.settings:
        try:
            parse_setting(s)
        except argparse.ArgumentTypeError as error:
            ap.error(f"--settings: {error}")
    for row in args.extra_rows:
        capacity, _, setting = row.partition(":")
        try:
            if not capacity.isdigit():
                raise argparse.ArgumentTypeError(f"row {row!r} is not CAPACITY:SETTING")
            parse_setting(setting)
        except argparse.ArgumentTypeError as error:
            ap.error(f"--extra-rows: {error}")
    return args


def _run_row(args, w: dict, precision: str, capacity: int, setting: str) -> dict:
    mode, ckpt = parse_setting(setting)
    # bench_e2e's arguments for one "triton" row (its quantize_all reads the precision list)
    row_args = argparse.Namespace(**{**vars(args), "capacity": capacity, "checkpoint_layers": ckpt,
                                     "profile": False, "memory_peak": False, "variants": "triton",
                                     "base_precision": [precision], "fp8_exempt_layers": 0})
    device = w["device"]
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    row = {"base": precision, "capacity": capacity, "setting": setting}
    try:
        tps, secs, toks, fill, n, _ = run_ours(row_args, w["hf_config"], w["model"], w["data"], device, w["dtype"],
                                               args.backend, base_precision=precision, label=f"{precision}_{setting}",
                                               fp8_params=w["quantized"], options=DecoderOptions(mlp_recompute=mode))
    except torch.OutOfMemoryError:
        return {**row, "error": "out of memory"}
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    kept = step_activation_bytes(w["config"], args.rank, capacity, dtype=w["dtype"], mlp_recompute=mode,
                                 checkpoint_layers=ckpt, elementwise_compiled=device.type == "cuda")
    return {**row, "tokens_per_s": round(tps, 1), "seconds": round(secs, 2), "real_tokens": toks,
            "peak_gib": round(peak, 2), "kept_bytes": kept, "fill": round(fill, 3),
            "microbatches": n}


def planned_rows(args) -> list[tuple[str, int, str]]:
    rows = [("bf16", args.bf16_capacity, "none")] if args.bf16_capacity and args.base_precision == "nf4" else []
    extra = [(args.base_precision, int(c), s) for c, _, s in (r.partition(":") for r in args.extra_rows)]
    return rows + [(args.base_precision, c, s) for c in args.capacities for s in args.settings] + extra


def print_table(rows: list[dict], args, device_name: str) -> None:
    print(f"\n{device_name}, torch {torch.__version__}, shape={args.shape} layers={args.layers} "
          f"workload={args.workload} adapters={args.adapters}x{args.samples} r={args.rank} backend={args.backend}")
    swept = [r for r in rows if r["base"] == args.base_precision and "tokens_per_s" in r]
    best = max((r["tokens_per_s"] for r in swept), default=float("nan"))
    print(f"{'base':5} {'capacity':>8} {'setting':22} {'tok/s':>9} {'vs best':>8} {'peak GiB':>9} "
          f"{'kept GiB':>9}  target")
    for r in rows:
        if "tokens_per_s" not in r:
            print(f"{r['base']:5} {r['capacity']:>8} {r['setting']:22} {r.get('error', 'skipped')}")
            continue
        ratio = r["tokens_per_s"] / best
        meets = r["base"] == args.base_precision and r["peak_gib"] <= args.target_gib and ratio >= args.target_ratio
        print(f"{r['base']:5} {r['capacity']:>8} {r['setting']:22} {r['tokens_per_s']:>9.1f} {ratio:>7.3f}x "
              f"{r['peak_gib']:>9.2f} {r['kept_bytes'] / 2**30:>9.2f}  {'yes' if meets else ''}")
    print(f"target: peak <= {args.target_gib} GiB at >= {args.target_ratio:.0%} of the best {args.base_precision} "
          f"tok/s of this run ({best:.1f}); kept GiB: what the decoder layers keep for backward at that "
          "capacity (model.activation_memory)")


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    args.checkpoint_layers, args.profile, args.memory_peak = 0, False, False
    start = time.perf_counter()
    device, dtype, hf_config, model, data = model_and_workload(args)
    from lightning_lorafusion.model.hf_loading import params_from_hf_model

    w = {"device": device, "dtype": dtype, "hf_config": hf_config, "model": model, "data": data, "quantized": {},
         "config": params_from_hf_model(model)[0]}
    rows, longest = [], 0.0
    for precision, capacity, setting in planned_rows(args):
        began = time.perf_counter()
        if began - start + longest > args.time_budget:  # a row like the longest so far would not fit
            rows.append({"base": precision, "capacity": capacity, "setting": setting, "error": "skipped (time budget)"})
        else:
            rows.append(_run_row(args, w, precision, capacity, setting))
            longest = max(longest, time.perf_counter() - began)
        print(json.dumps({**rows[-1], "elapsed_s": round(time.perf_counter() - start, 1)}), flush=True)
    info = device_info(device)
    print_table(rows, args, info["device_name"])
    write_json(args.out, f"memory_{args.shape}_{args.base_precision}.json", {**info, "args": vars(args), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
