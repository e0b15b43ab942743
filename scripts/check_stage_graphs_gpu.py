"""Do the CUDA graphs of a pipeline stage before the last train like the eager stage?

One process, one GPU, a small random Llama (``--hidden`` x ``--layers``) split into pipeline
stages that all live on that GPU. The stage under test (``first``: stage 0 of 2, embedding
included; ``middle``: stage 1 of 3, its input received from stage 0) runs its 1F1B order
(``schedule.one_f_one_b_order``: ``num_stages - stage`` microbatches in flight, one slot each,
``schedule.in_flight_slots``) through ``training.stage_graphs.SplitStageGraphs``: per slot a
captured forward and a captured backward, captured before the first step for the join of the
microbatches' shape keys (``precapture``). The stages before it run their eager forward at its
forward and their backward at its backward; the stages after it run forward and backward at once
(their result depends only on its output). The same microbatches (several shape keys, adapters of
different ranks, dropout on) run ``--passes`` times with the stage eager, then graphed, from the
same adapter weights; reported per variant: the largest relative difference of the stage's
outputs, of the losses and of every adapter gradient (accumulated over all passes), the graphs'
replays, captures and eager fallbacks, and the time of the last pass (both ways): the whole
emulated pipeline on one GPU, and the stage's own calls (CUDA events around each: device time
with the host's gaps, what a host-bound stage costs). Pass: outputs and gradients within ``--rtol`` (relative to the
largest eager value), losses within ``--rtol`` / 10, every microbatch replayed, none eager.

``--memory``: per variant, also what the stage's graphs leave reserved once captured
(``capture_memory``): a precapture of every slot from an empty cache, then the reserved bytes,
the eager allocator's cached but free bytes (``capture.pool_usage``), the graph pools', and what
one more cache release hands back; once as the stage does it (each warm-up's cached blocks handed
back before its capture) and once with that release left out (a synchronisation only).

    python3 scripts/check_stage_graphs_gpu.py --out $OUT/pp-graphs
    python3 scripts/check_stage_graphs_gpu.py --variants first_8b_layers,middle --memory
    python3 scripts/check_stage_graphs_gpu.py --device cpu --hidden 32 --layers 3 --capacity 128 \
        --microbatches 4 --dtype float32     # the logic on the CPU (no capture; Triton interpreter)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import time
from collections import Counter
from dataclasses import dataclass

from harness import Report, add_device_args, add_output_args, comma_list, dtype_of, logger, sync

import torch  # noqa: E402  (after harness, which puts the repository on sys.path)

from lightning_lorafusion.capture import pool_usage  # noqa: E402
from lightning_lorafusion.data.microbatch import IGNORE_INDEX  # noqa: E402
from lightning_lorafusion.data.packing import PackingConfig, SampleLookup, pack_microbatch  # noqa: E402
from lightning_lorafusion.data.synthetic import synthetic_token_samples  # noqa: E402
from lightning_lorafusion.data.tokenization import shifted_labels  # noqa: E402
from lightning_lorafusion.model.adapter_bank import AdapterBank  # noqa: E402
from lightning_lorafusion.model.decoder import DecoderConfig  # noqa: E402
from lightning_lorafusion.model.random_model import random_base_params  # noqa: E402
from lightning_lorafusion.parallel.partition import partition_layers  # noqa: E402
from lightning_lorafusion.parallel.schedule import Backward, Forward, in_flight_slots, one_f_one_b_order  # noqa: E402
from lightning_lorafusion.parallel.stage import DecoderStage  # noqa: E402
from lightning_lorafusion.planner import plan_microbatches  # noqa: E402
from lightning_lorafusion.specs import AdapterSpec  # noqa: E402
from lightning_lorafusion.training import stage_graphs  # noqa: E402
from lightning_lorafusion.training.cuda_graphs import graph_key  # noqa: E402
from lightning_lorafusion.training.graph_pool import release_cache  # noqa: E402
from lightning_lorafusion.training.stage_graphs import SplitStageGraphs, stage_key  # noqa: E402

# stages, stage under test, activation checkpointing, shape (None: the command line's)
VARIANTS = {"first": (2, 0, False, None), "first_ckpt": (2, 0, True, None), "middle": (3, 1, False, None),
            "first_8b_layers": (2, 0, False, "8b_layers")}
# two layers per stage of Llama-3.1-8B's dimensions at the 8B runs' capacity: what a replay saves
# per layer at that shape
SHAPES = {"8b_layers": {"hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8, "layers": 4,
                        "capacity": 8192, "microbatches": 4}}

log = logger("stage-graphs")


@dataclass(frozen=True)
class _Sample:
    input_ids: tuple
    labels: tuple


def specs(config: DecoderConfig) -> list[AdapterSpec]:
    top = min(32, config.num_kv_heads * config.head_dim)  # the smallest projection's width bounds the rank
    return [
        AdapterSpec(name="a", rank=min(8, top), alpha=16, dropout=0.1, seed=11, dataset={"kind": "synthetic"}),
        AdapterSpec(name="b", rank=min(16, top), alpha=16, dropout=0.0, seed=12,
                    target_modules=("q_proj", "v_proj", "o_proj", "down_proj"), dataset={"kind": "synthetic"}),
        AdapterSpec(name="c", rank=top, alpha=32, dropout=0.05, seed=13, dataset={"kind": "synthetic"}),
    ]


def packed(config: DecoderConfig, capacity: int, n: int, max_length: int, seed: int) -> list:
    """Planner-packed microbatches of synthetic samples of the three adapters (host tensors)."""
    datasets = []
    for a, name in enumerate(("xsum", "cnn_dailymail", "wikisum")):
        pairs = synthetic_token_samples(name, n, vocab_size=config.vocab_size, seed=seed + a, max_length=max_length)
        datasets.append([_Sample(tuple(x), shifted_labels(x, [t != IGNORE_INDEX for t in y])) for x, y in pairs])
    batches = [[list(range(len(d)))] for d in datasets]
    lookup = SampleLookup(datasets, batches)
    plan = plan_microbatches(lookup.lengths(), capacity=capacity, pad_multiple=16, method="greedy")
    cfg = PackingConfig(capacity=capacity, pad_multiple=16)
    return [pack_microbatch(p, lookup, config=cfg, num_adapters=3, denominators=lookup.denominators(),
                            step_adapters=(), index=0) for p in plan.microbatches if not p.is_noop]


def microbatches(config: DecoderConfig, capacity: int, count: int, device) -> list:
    """``count`` microbatches alternating between short samples (many attention blocks) and long
    ones (long blocks): at least two shape keys."""
    many = packed(config, capacity, 4 * capacity // 64, max(16, capacity // 16), seed=0)
    few = packed(config, capacity, 2 * capacity // 256 + 2, max(16, capacity // 2), seed=7)
    mixed = [mb for pair in zip(many, few) for mb in pair][:count]
    return [dataclasses.replace(mb, index=3000 + i).to(device) for i, mb in enumerate(mixed)]


def build_case(args, shape: str | None, device) -> dict:
    """The base, the microbatches and their shape keys of ``shape`` (None: the command line's)."""
    if shape is None:
        heads = max(2, args.hidden // 64)
        dims = {"hidden": args.hidden, "intermediate": args.hidden * 11 // 4, "heads": heads,
                "kv_heads": max(1, heads // 4), "layers": args.layers, "capacity": args.capacity,
                "microbatches": args.microbatches}
    else:
        dims = SHAPES[shape]
    config = DecoderConfig(vocab_size=4096, hidden_size=dims["hidden"], intermediate_size=dims["intermediate"],
                           num_layers=dims["layers"], num_heads=dims["heads"], num_kv_heads=dims["kv_heads"],
                           head_dim=dims["hidden"] // dims["heads"])
    params = random_base_params(config, device=device, dtype=args.dtype, seed=0, std=0.02)
    mbs = microbatches(config, dims["capacity"], dims["microbatches"], device)
    keys = sorted({(k.max_seqlen, k.num_blocks) for k in map(stage_key, mbs)})
    log(f"shape {shape or 'command line'}: {len(mbs)} microbatches of capacity {dims['capacity']}, "
        f"{len(keys)} shape keys (max_seqlen, blocks) {keys}")
    return {"config": config, "params": params, "mbs": mbs, "keys": keys, "dims": dims}


def bank_of(config, device) -> AdapterBank:
    bank = AdapterBank(specs(config), config, dtype=torch.float32, device=device)
    with torch.no_grad():  # B = 0 at init would hide most of the LoRA path
        g = torch.Generator().manual_seed(1)
        for p in bank.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(device) * 0.02)
    return bank


class _StageClock:
    """Time spent in stage ``g``'s calls: CUDA events around each (device time, host gaps
    included: what a host-bound stage costs), the host clock on the CPU."""

    def __init__(self, device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def add(self, t0) -> None:
        self.marks.append((t0, self.mark()))

    def seconds(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return sum(a.elapsed_time(b) for a, b in self.marks) / 1e3
        return sum(b - a for a, b in self.marks)


def one_pass(stages, g: int, n: int, slots: dict, graphed: bool, outputs: dict, losses: dict,
             clock: _StageClock) -> None:
    """Stage ``g``'s 1F1B order over ``n`` microbatches (see the module docstring)."""
    kept = {}
    for k, i in one_f_one_b_order(list(range(n)), g, len(stages)):
        if k == "F":
            h = None
            for s in stages[:g]:
                h = s.forward(h, i)
            x = None if h is None else h.detach()
            t0 = clock.mark()
            if graphed:
                out = stages[g].graphed_forward(x, i, slots[i])
                if out is None:
                    raise RuntimeError(f"microbatch {i} ran eagerly: {stages[g].graphs.refusals}")
            else:
                x = None if x is None else x.requires_grad_(True)
                out = stages[g].forward(x, i)
            clock.add(t0)
            outputs.setdefault(i, out.detach().float().clone())
            y = out.detach().requires_grad_(True)
            z = y
            for s in stages[g + 1:]:
                z = s.forward(z, i)
            z.backward()
            losses.setdefault(i, float(z.detach()))
            kept[i] = (h, x, out, y.grad)
        else:
            h, x, out, grad = kept.pop(i)
            t0 = clock.mark()
            if graphed:
                x_grad = stages[g].graphed_backward(i, slots[i], grad)
            else:
                out.backward(grad)
                x_grad = None if x is None else x.grad
            clock.add(t0)
            if h is not None:
                h.backward(x_grad)


def run(variant: str, graphed: bool, config, params, mbs, args, device) -> dict:
    num_stages, g, ckpt, _ = VARIANTS[variant]
    bank = bank_of(config, device)
    ranges = partition_layers(config.num_layers, num_stages)
    graphs = None
    if graphed:
        graphs = SplitStageGraphs(params=params, bank=bank, config=config, layers=ranges[g], is_first=g == 0,
                                  slots=num_stages - g, checkpoint_layers=ckpt, activation_dtype=args.dtype,
                                  capture=device.type == "cuda")
        graphs.precapture(Counter(graph_key(mb) for mb in mbs), device)
    stages = [DecoderStage(params=params, bank=bank, config=config, layers=r, is_first=s == 0,
                           is_last=s == num_stages - 1, microbatches=mbs.__getitem__, backend="triton",
                           checkpoint_layers=ckpt if s == g else False, graphs=graphs if s == g else None)
              for s, r in enumerate(ranges)]
    actions = [Forward(i) if k == "F" else Backward(i)
               for k, i in one_f_one_b_order(list(range(len(mbs))), g, num_stages)]
    slots = in_flight_slots(actions)
    outputs, losses, seconds = {}, {}, []
    for _ in range(args.passes):
        sync(device)
        t0 = time.perf_counter()
        clock = _StageClock(device)
        one_pass(stages, g, len(mbs), slots, graphed, outputs, losses, clock)
        sync(device)
        seconds.append(time.perf_counter() - t0)
    grads = {n: p.grad.detach().float().clone() for n, p in bank.named_parameters() if p.grad is not None}
    out = {"outputs": outputs, "losses": losses, "grads": grads, "last_pass_s": seconds[-1],
           "stage_s": clock.seconds(),
           "slots": max(slots.values()) + 1}
    if graphs is not None:
        out["graphs"] = {"forward_replays": graphs.forward_replays, "backward_replays": graphs.backward_replays,
                         "graphed_forwards": graphs.graphed_forwards, "captures": graphs.captures,
                         "precaptures": graphs.precaptures, "eager": graphs.eager_microbatches,
                         "refusals": {str(k): v for k, v in graphs.refusals.items()},
                         "keys": sorted(str(s.key) for s in graphs._slots if s is not None)}
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def compare(variant: str, case: dict, args, device) -> dict:
    config, params, mbs = case["config"], case["params"], case["mbs"]
    eager = run(variant, False, config, params, mbs, args, device)
    graphed = run(variant, True, config, params, mbs, args, device)
    n = len(mbs)
    out_rel = max(rel(graphed["outputs"][i], eager["outputs"][i]) for i in range(n))
    loss_rel = max(abs(graphed["losses"][i] - eager["losses"][i]) / max(abs(eager["losses"][i]), 1e-30)
                   for i in range(n))
    grad_rel = max((rel(graphed["grads"].get(k, torch.zeros_like(v)), v) for k, v in eager["grads"].items()
                    if v.abs().max() > 0), default=0.0)
    gs = graphed["graphs"]
    replayed = gs["graphed_forwards"] == n * args.passes and gs["eager"] == 0
    if device.type == "cuda":
        replayed = replayed and gs["forward_replays"] == gs["backward_replays"] == n * args.passes
    ok = replayed and out_rel <= args.rtol and grad_rel <= args.rtol and loss_rel <= args.rtol / 10
    return {"pass": ok, "slots": graphed["slots"], "mb_keys": len(case["keys"]), "output_rel": out_rel,
            "loss_rel": loss_rel, "grad_rel": grad_rel, "eager_s": eager["last_pass_s"], "graphed_s": graphed["last_pass_s"],
            "eager_stage_s": eager["stage_s"], "graphed_stage_s": graphed["stage_s"],
            **gs}


@contextlib.contextmanager
def warm_up_release(on: bool):
    """The stage's cache release between a warm-up and its capture as shipped (``on``), or a
    device synchronisation only (what the warm-up leaves cached stays in the eager allocator)."""
    if on:
        yield
        return
    shipped = stage_graphs.release_cache
    stage_graphs.release_cache = lambda device: torch.cuda.synchronize(device)
    try:
        yield
    finally:
        stage_graphs.release_cache = shipped


def capture_memory(variant: str, case: dict, args, device) -> dict:
    """GiB a precapture of every slot of ``variant``'s stage leaves reserved, with the warm-ups'
    release (``release``) and without it (``no_release``): the growth of the reserved bytes, the
    eager allocator's cached but free bytes and the graph pools' reserved bytes after the
    captures, what one more cache release hands back, and the peak reserved during the captures
    (all relative to the reserved bytes before them, the base and microbatches already there)."""
    num_stages, g, ckpt, _ = VARIANTS[variant]
    config, params, mbs = case["config"], case["params"], case["mbs"]
    planned = Counter(graph_key(mb) for mb in mbs)
    gib = 2.0**30
    out = {}
    for mode in ("release", "no_release"):
        bank = bank_of(config, device)
        gc.collect()
        release_cache(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_reserved(device)
        graphs = SplitStageGraphs(params=params, bank=bank, config=config, layers=partition_layers(
            config.num_layers, num_stages)[g], is_first=g == 0, slots=num_stages - g, checkpoint_layers=ckpt,
            activation_dtype=args.dtype, capture=True)
        with warm_up_release(mode == "release"):
            captured = graphs.precapture(planned, device)
        sync(device)
        usage = pool_usage(device=device)
        reserved = torch.cuda.memory_reserved(device)
        peak = torch.cuda.max_memory_reserved(device)
        release_cache(device)
        eager, pools = usage.get("eager", {}), usage.get("graphs", {})
        out[mode] = {"captures": len(captured), "disabled": graphs.disabled,
                     "reserved": round((reserved - before) / gib, 3), "peak": round((peak - before) / gib, 3),
                     "eager_free": round(eager.get("reserved", 0.0) - eager.get("allocated", 0.0), 3),
                     "graph_pools": pools.get("reserved", 0.0),
                     "release_frees": round((reserved - torch.cuda.memory_reserved(device)) / gib, 3)}
        del graphs, bank
        gc.collect()
        release_cache(device)
    return out


def memory_table(report: dict, variants) -> str:
    lines = ["| variant | warm-up release | captures | reserved GiB | peak GiB | eager cached free GiB | "
             "graph pools GiB | one more release frees GiB |", "|---|---|---|---|---|---|---|---|"]
    for v in variants:
        r = report.get(f"{v}/memory")
        if r is None:
            lines.append(f"| {v} | error: {report['errors'].get(f'{v}/memory', 'not measured')} |")
            continue
        for mode, m in r.items():
            lines.append(f"| {v} | {'on' if mode == 'release' else 'off'} | {m['captures']} | {m['reserved']:.3f} | "
                         f"{m['peak']:.3f} | {m['eager_free']:.3f} | {m['graph_pools']:.3f} | "
                         f"{m['release_frees']:.3f} |")
    return "\n".join(lines)


def table(report: dict, variants) -> str:
    lines = ["| variant | slots | keys of the microbatches | captures (up front) | forward / backward replays | "
             "eager | output rel | loss rel | grad rel | pass s eager / graphed | stage s eager / graphed | pass |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for v in variants:
        r = report.get(v)
        if r is None:
            lines.append(f"| {v} | error: {report['errors'].get(v, '?')} |")
            continue
        lines.append(f"| {v} | {r['slots']} | {r['mb_keys']} | {r['captures']} ({r['precaptures']}) | "
                     f"{r['forward_replays']} / {r['backward_replays']} | {r['eager']} | {r['output_rel']:.2e} | "
                     f"{r['loss_rel']:.2e} | {r['grad_rel']:.2e} | {r['eager_s']:.3f} / {r['graphed_s']:.3f} | "
                     f"{r['eager_stage_s']:.3f} / {r['graphed_stage_s']:.3f} | "
                     f"{'PASS' if r['pass'] else 'FAIL'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_args(ap)
    add_output_args(ap)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--capacity", type=int, default=4096)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--rtol", type=float, default=2e-2, help="outputs and gradients (bf16); losses: rtol / 10")
    ap.add_argument("--variants", type=comma_list(tuple(VARIANTS)), default=list(VARIANTS))
    ap.add_argument("--memory", action="store_true",
                    help="also what each variant's captures leave reserved, with and without the warm-up's "
                         "cache release (CUDA only)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    args.dtype = dtype_of(args.dtype)
    report = Report(device, args, out=args.out, file_name="stage_graphs.json", log=log,
                    describe=lambda r: ("PASS " if r["pass"] else "FAIL ") + str({k: r[k] for k in (
                        "output_rel", "loss_rel", "grad_rel", "forward_replays", "captures", "eager")})
                    if "pass" in r else str(r))
    cases: dict = {}
    for v in args.variants:
        shape = VARIANTS[v][3]

        def measure(v=v, shape=shape):
            if shape not in cases:
                cases.clear()  # one base on the device at a time
                cases[shape] = build_case(args, shape, device)
            return compare(v, cases[shape], args, device)

        report.measure(v, measure)
        if args.memory and device.type == "cuda":
            report.measure(f"{v}/memory", lambda v=v, shape=shape: capture_memory(v, cases[shape], args, device))
    text = table(report, args.variants)
    if args.memory and device.type == "cuda":
        text += "\n\n" + memory_table(report, args.variants)
    print(text)
    ok = all(report.get(v, {}).get("pass") for v in args.variants)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "stage_graphs.md"), "w") as f:
            f.write(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
