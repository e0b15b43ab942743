"""Activation memory against speed: tokens/s and peak memory of our training step over an NF4 (or
bf16) base for each capacity x recomputation setting, with the bf16 base's row for reference, in
one process (same samples, same kernels as scripts/bench_e2e.py's "triton" variant).

A setting is ``none`` or parts joined by ``+``: an ``mlp_recompute`` mode (``activation``,
``gate_up``), ``norms`` (``norm_recompute``: the input norms' outputs rebuilt in backward), either
with a count N (``activation24``, ``norms16``: only the first N layers rebuild, the others keep,
``mlp_recompute_layers`` / ``norm_recompute_layers``),
``ckptN`` (the first N layers checkpointed whole) and ``graphs`` (the step captured in CUDA
graphs, ``training/cuda_graphs.py``, covering every planned shape key before the first pass as
``fit`` does; with ``ckptN`` the captured step recomputes those layers, as ``fit`` does), e.g. ``activation+norms+graphs``. With ``graphs``, parts that
change how the captures use the allocator (``training/cuda_graphs.CaptureMemory``): ``largest``
(keys captured largest first), ``release`` (cached blocks handed back before every capture),
``poolwarm`` (the first warm-up allocates from the graphs' pool), ``preN`` (at most N graphs
captured up front per epoch, ``model.cuda_graph_precapture``), ``autogradacc`` (the factors'
gradients added by autograd, one ``add_`` per factor, instead of the fused kernels' one launch per
projection group: the step as it was, for comparison); and for any row ``expandable``
(the allocator's expandable segments, ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``,
switched on for that row only: segments made before it, the base's among them, stay as they
were; for the whole process set the variable before the start, and compare with a run without
it through ``--earlier-rows``); ``hostembed`` (the NF4 base's input embedding table in pinned host
memory, read in place by the gather: ``model/host_embedding.py``; the device copy is dropped for
the row and put back after it); ``fusedadam`` (torch's fused AdamW: no multi-tensor temporaries
in the allocator's cache); ``levelsN`` (``levels``: 3): the microbatches packed at up to N
capacities, each at the smallest holding its tokens, as ``fit`` packs them without a pipeline
(``data.replica_capacity_levels``; rows without it pack every microbatch at the row's capacity,
as ``fit`` with 0). Each row also shows what
``model.activation_memory`` says the decoder layers keep for backward at that capacity, the
allocator's peak allocated and reserved bytes (a graph's memory pool stays reserved), and
whether it meets the memory target: peak allocated (``alloc``) and peak reserved (``resv``) <=
--target-gib at >= --target-ratio of the best NF4 tokens/s of the run. A graph replay allocates
nothing the allocator counts: its intermediates live in the graphs' pool, which stays reserved,
so for graph rows the reserved peak is the memory the run needs. Graph rows also give the peaks
reached by the end of the captures (before any optimizer state exists) and what each pool holds
at the end (``capture.pool_usage``: the eager allocator's and the graph pools' reserved and
allocated GiB; ``eager_detail``: the eager allocator's small and large segments and its largest
free blocks). Each row starts with the cuBLAS workspaces of earlier rows' streams handed back, as
in a fresh process. ``--breakdown`` prints what is live at the peak of one eager step
(scripts/memory_peak.py). Rows past --time-budget seconds are skipped (listed as such).

    PYTHONPATH=. python3 scripts/bench_memory.py --capacities 4096 --settings none,gate_up+norms \\
        --extra-rows 2048:activation+norms+graphs,4096:none+graphs --bf16-capacity 0 --out $OUT
    PYTHONPATH=. python3 scripts/bench_memory.py --shape tiny --layers 2 --device cpu --backend torch \\
        --samples 4 --max-length 256 --capacities 256,512 --bf16-capacity 256   # smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import time
from dataclasses import dataclass

from harness import add_output_args, comma_list, device_info, write_json

import torch  # noqa: E402

from bench_e2e import add_workload_args, model_and_workload, run_ours  # noqa: E402
from lightning_lorafusion.capture import pool_usage  # noqa: E402
from lightning_lorafusion.model.activation_memory import step_activation_bytes  # noqa: E402
from lightning_lorafusion.model.decoder import DecoderOptions  # noqa: E402
from lightning_lorafusion.model.mlp_recompute import MLP_RECOMPUTE_MODES  # noqa: E402
from lightning_lorafusion.training.cuda_graphs import DEFAULT_CAPTURE_MEMORY, CaptureMemory  # noqa: E402
from lightning_lorafusion.training.graph_cover import DEFAULT_PRECAPTURE  # noqa: E402


GRAPH_MEMORY_PARTS = {"largest": "largest_first", "release": "release", "poolwarm": "warm_in_pool"}


@dataclass(frozen=True)
class Setting:
    mlp_recompute: str = "none"
    checkpoint_layers: int = 0
    norm_recompute: bool = False
    graphs: bool = False
    memory: CaptureMemory = DEFAULT_CAPTURE_MEMORY
    precapture: int = DEFAULT_PRECAPTURE
    expandable: bool = False
    host_embedding: bool = False
    fused_adam: bool = False
    autograd_accumulation: bool = False
    mlp_recompute_layers: int | None = None
    norm_recompute_layers: int | None = None
    capacity_levels: int = 0


def parse_setting(text: str) -> Setting:
    """``"ckpt8+activation"`` -> Setting(mlp_recompute="activation", checkpoint_layers=8);
    ``"activation24+norms"`` -> the activation rebuilt in the first 24 layers only."""
    fields: dict = {}
    memory: dict = {}
    for part in text.split("+"):
        name = part.rstrip("0123456789")
        count = int(part[len(name):]) if name != part else None
        if count is not None and (name in MLP_RECOMPUTE_MODES and name != "none" or name == "norms"):
            key = "norm_recompute" if name == "norms" else "mlp_recompute"
            fields[key] = True if name == "norms" else name
            fields[f"{key}_layers"] = count
        elif part.startswith("ckpt") and part[4:].isdigit():
            fields["checkpoint_layers"] = int(part[4:])
        elif part.startswith("pre") and part[3:].isdigit():
            fields["precapture"] = int(part[3:])
        elif part.startswith("levels") and (part[6:].isdigit() or part == "levels"):
            fields["capacity_levels"] = int(part[6:] or 3)
        elif part in MLP_RECOMPUTE_MODES:
            fields["mlp_recompute"] = part
        elif part in ("norms", "graphs", "expandable", "hostembed", "fusedadam", "autogradacc"):
            fields[{"norms": "norm_recompute", "hostembed": "host_embedding", "fusedadam": "fused_adam",
                    "autogradacc": "autograd_accumulation"}.get(part, part)] = True
        elif part in GRAPH_MEMORY_PARTS:
            memory[GRAPH_MEMORY_PARTS[part]] = True
        else:
            raise argparse.ArgumentTypeError(f"setting {text!r}: each '+' part is one of {MLP_RECOMPUTE_MODES}, "
                                             "norms (these two with a layer count N: activationN, normsN), graphs, "
                                             "ckptN (N layers checkpointed), expandable, hostembed, levelsN, "
                                             "fusedadam, or with "
                                             f"graphs {sorted(GRAPH_MEMORY_PARTS)}, preN or autogradacc")
    setting = Setting(**fields, memory=CaptureMemory(**memory))
    if not setting.graphs and (memory or "precapture" in fields or setting.autograd_accumulation):
        raise argparse.ArgumentTypeError(f"setting {text!r}: {sorted(GRAPH_MEMORY_PARTS)}, preN and autogradacc "
                                         "apply to graphs; add +graphs")
    return setting


@contextlib.contextmanager
def expandable_segments(on: bool, device: torch.device):
    """The CUDA allocator's expandable segments on for the block (then off again); nothing when
    ``on`` is False or off CUDA. New segments follow the setting, existing ones stay as they are."""
    process_wide = any("expandable_segments:true" in os.environ.get(v, "").lower()
                       for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    if not on or device.type != "cuda" or process_wide:  # on for the whole process: leave it on
        yield
        return
    # torch's runtime form of PYTORCH_CUDA_ALLOC_CONF (the older name where the new one is absent)
    setting = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setting("expandable_segments:True")
    try:
        yield
    finally:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        setting("expandable_segments:False")


@contextlib.contextmanager
def embedding_on_host_for_row(on: bool, w: dict, precision: str):
    """The quantized base's input embedding table in pinned host memory for the block
    (``model.host_embedding``): the device copy is dropped (the HF model's too, which shares
    its storage), then put back from the host copy; the row's ``at_start`` eager allocated
    shows the drop. Nothing when ``on`` is False."""
    if not on:
        yield
        return
    from lightning_lorafusion.model.host_embedding import embedding_on_host

    params = w["quantized"][precision]
    emb = w["model"].get_input_embeddings()
    device = params["embed"].device
    moved = embedding_on_host(params)
    params["embed"] = moved["embed"]
    emb.weight = torch.nn.Parameter(moved["embed"], requires_grad=False)
    del moved
    gc.collect()
    torch.cuda.empty_cache()
    try:
        yield
    finally:
        back = params["embed"].clone()  # a device copy of the pinned rows
        params["embed"] = back
        emb.weight = torch.nn.Parameter(back, requires_grad=False)
        gc.collect()
        torch.cuda.synchronize(device)


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
    ap.add_argument("--bf16-setting", default="none",
                    help="the bf16 reference row's setting (e.g. none+graphs, to compare with NF4 graph rows)")
    ap.add_argument("--backend", choices=("triton", "torch"), default="triton")
    ap.add_argument("--timed-passes", type=int, default=1,
                    help="passes over the workload timed per row, summed (after one untimed pass)")
    ap.add_argument("--target-gib", type=float, default=16.0)
    ap.add_argument("--target-ratio", type=float, default=0.9)
    ap.add_argument("--breakdown", action="store_true",
                    help="print what is live at the peak of one eager step of each eager row (memory_peak.py)")
    ap.add_argument("--profile-rows", type=comma_list(), default=[],
                    help="rows (CAPACITY:SETTING, as in the sweep) whose 4 first microbatches are profiled after "
                         "the timed pass: kernel table and kernels per microbatch (bench_e2e.kernel_time_summary)")
    ap.add_argument("--earlier-rows", default=None, metavar="JSON",
                    help="a JSON this script wrote in an earlier process (e.g. under another "
                         "PYTORCH_CUDA_ALLOC_CONF): its rows head the table and count for the best tok/s")
    ap.add_argument("--time-budget", type=float, default=270.0,
                    help="seconds from the start; a row that would end past it (as long as the longest so "
                         "far) is skipped")
    args = ap.parse_args(argv)
    for s in args.settings:
        try:
            parse_setting(s)
        except argparse.ArgumentTypeError as error:
            ap.error(f"--settings: {error}")
    try:
        parse_setting(args.bf16_setting)
    except argparse.ArgumentTypeError as error:
        ap.error(f"--bf16-setting: {error}")
    for row in args.extra_rows:
        capacity, _, setting = row.partition(":")
        try:
            if not capacity.isdigit():
                raise argparse.ArgumentTypeError(f"row {row!r} is not CAPACITY:SETTING")
            parse_setting(setting)
        except argparse.ArgumentTypeError as error:
            ap.error(f"--extra-rows: {error}")
    return args


def _run_row(args, w: dict, precision: str, capacity: int, text: str) -> dict:
    setting = parse_setting(text)
    # bench_e2e's arguments for one "triton" row (its quantize_all reads the precision list)
    row_args = argparse.Namespace(**{**vars(args), "capacity": capacity, "checkpoint_layers": setting.checkpoint_layers,
                                     "capacity_levels": setting.capacity_levels,
                                     "profile": f"{capacity}:{text}" in args.profile_rows, "memory_peak": args.breakdown and not setting.graphs,
                                     "variants": "triton", "base_precision": [precision], "fp8_exempt_layers": 0})
    device = w["device"]
    gc.collect()
    if device.type == "cuda":
        # cuBLAS keeps a workspace per stream it ran on (32 MiB on Hopper) for the process's life;
        # each row's graphs bring new streams, so without this a row would also hold the earlier
        # rows' (0.31 GiB by the fifth), which one fit process does not
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            torch.cuda.synchronize(device)
            clear_workspaces()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    row = {"base": precision, "capacity": capacity, "setting": text,
           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    options = DecoderOptions(mlp_recompute=setting.mlp_recompute, norm_recompute=setting.norm_recompute,
                             mlp_recompute_layers=setting.mlp_recompute_layers,
                             norm_recompute_layers=setting.norm_recompute_layers)
    graph_kwargs = {"memory": setting.memory, "max_precapture": setting.precapture,
                    "accumulate_grads": not setting.autograd_accumulation}
    cuda = device.type == "cuda"
    if setting.host_embedding and (precision not in w["quantized"] or not cuda):
        return {**row, "error": f"hostembed needs CUDA and an earlier {precision} row (the one that quantizes)"}
    try:
        with expandable_segments(setting.expandable, device), \
                embedding_on_host_for_row(setting.host_embedding, w, precision):
            if cuda:  # what the rows before and the model left in the eager allocator
                row["at_start"] = pool_usage(device=device)
                torch.cuda.reset_peak_memory_stats()
            tps, secs, toks, fill, n, extra = run_ours(
                row_args, w["hf_config"], w["model"], w["data"], device, w["dtype"], args.backend,
                base_precision=precision, graphs=setting.graphs, label=f"{precision}_{capacity}_{text}",
                fp8_params=w["quantized"], options=options, precapture=setting.graphs, graph_kwargs=graph_kwargs,
                fused_adam=setting.fused_adam)
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
            reserved = torch.cuda.max_memory_reserved() / 2**30 if cuda else float("nan")
    except torch.OutOfMemoryError:
        return {**row, "error": "out of memory"}
    except RuntimeError as error:  # e.g. an allocator setting this torch refuses
        return {**row, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    kept = step_activation_bytes(w["config"], args.rank, capacity, dtype=w["dtype"],
                                 mlp_recompute=setting.mlp_recompute, checkpoint_layers=setting.checkpoint_layers,
                                 elementwise_compiled=cuda, norm_recompute=setting.norm_recompute,
                                 mlp_recompute_layers=setting.mlp_recompute_layers,
                                 norm_recompute_layers=setting.norm_recompute_layers)
    return {**row, "tokens_per_s": round(tps, 1), "seconds": round(secs, 2), "real_tokens": toks,
            "peak_gib": round(peak, 2), "reserved_gib": round(reserved, 2), "kept_bytes": kept,
            "fill": round(fill, 3), "microbatches": n, **extra}


def planned_rows(args) -> list[tuple[str, int, str]]:
    rows = [("bf16", args.bf16_capacity, args.bf16_setting)] if args.bf16_capacity and args.base_precision == "nf4" else []
    extra = [(args.base_precision, int(c), s) for c, _, s in (r.partition(":") for r in args.extra_rows)]
    return rows + [(args.base_precision, c, s) for c in args.capacities for s in args.settings] + extra


def print_table(rows: list[dict], args, device_name: str) -> None:
    print(f"\n{device_name}, torch {torch.__version__}, shape={args.shape} layers={args.layers} "
          f"workload={args.workload} adapters={args.adapters}x{args.samples} r={args.rank} backend={args.backend} "
          f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r}")
    swept = [r for r in rows if r["base"] == args.base_precision and "tokens_per_s" in r]
    best = max((r["tokens_per_s"] for r in swept), default=float("nan"))
    rows = [{**r, "setting": r["setting"] + (f" [{r['alloc_conf']}]" if r.get("alloc_conf") else "")}
            for r in rows]  # a row of a process with its own allocator settings says so
    width = max([26] + [len(r["setting"]) for r in rows])
    print(f"{'base':5} {'capacity':>8} {'setting':{width}} {'tok/s':>9} {'vs best':>8} {'peak GiB':>9} "
          f"{'resv GiB':>9} {'kept GiB':>9} {'graphs':>7} {'start r/a':>11} {'cap a/r':>11} {'pool r/a':>11} "
          f"{'eager r/a':>11}  target")
    for r in rows:
        if "tokens_per_s" not in r:
            print(f"{r['base']:5} {r['capacity']:>8} {r['setting']:{width}} {r.get('error', 'skipped')}")
            continue
        ratio = r["tokens_per_s"] / best
        fast = r["base"] == args.base_precision and ratio >= args.target_ratio
        meets = [name for name, key in (("alloc", "peak_gib"), ("resv", "reserved_gib"))
                 if fast and r[key] <= args.target_gib]
        graphs = f"{r['replays']}/{r['microbatches'] * 2}" if "replays" in r else ""  # replays of both passes' steps
        cap = r.get("at_capture") or {}
        pools = r.get("pools") or {}
        start = (r.get("at_start") or {}).get("eager", {})

        def pair(a, b):
            return f"{a:.2f}/{b:.2f}" if a is not None and b is not None else ""

        print(f"{r['base']:5} {r['capacity']:>8} {r['setting']:{width}} {r['tokens_per_s']:>9.1f} {ratio:>7.3f}x "
              f"{r['peak_gib']:>9.2f} {r['reserved_gib']:>9.2f} {r['kept_bytes'] / 2**30:>9.2f} {graphs:>7} "
              f"{pair(start.get('reserved'), start.get('allocated')):>11} "
              f"{pair(cap.get('peak_gib'), cap.get('reserved_gib')):>11} "
              f"{pair(*(pools.get('graphs', {}).get(k) for k in ('reserved', 'allocated'))):>11} "
              f"{pair(*(pools.get('eager', {}).get(k) for k in ('reserved', 'allocated'))):>11}  {'+'.join(meets)}")
    print(f"target: peak <= {args.target_gib} GiB at >= {args.target_ratio:.0%} of the best {args.base_precision} "
          f"tok/s of this run ({best:.1f}), met on peak allocated (alloc) and/or peak reserved (resv); kept GiB: "
          "what the decoder layers keep for backward at that capacity (model.activation_memory); graphs: replayed "
          "steps / steps of both passes; start r/a: GiB the eager allocator reserved/allocated at the row's start; "
          "cap a/r: peak allocated/reserved GiB when the captures ended (no optimizer state yet); pool r/a, "
          "eager r/a: GiB reserved/allocated at the row's end by the graph pools and by the eager allocator")


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    # every capacity x grad mode compiles each elementwise group again (dynamic=False, as fit
    # does for its one capacity): a sweep of several capacities passes torch's default of 8
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    args.checkpoint_layers, args.memory_peak = 0, False
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
    earlier = []
    if args.earlier_rows:
        with open(args.earlier_rows) as f:
            earlier = json.load(f)["rows"]
    print_table(earlier + rows, args, info["device_name"])
    write_json(args.out, f"memory_{args.shape}_{args.base_precision}.json",
               {**info, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "args": vars(args), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
