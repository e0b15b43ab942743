"""Device time inside engine steps, from a CUDA profiler trace: what each step kind's kernels
take, and how much of a step's device span the device sits idle waiting for the host.

``floor.breakdown`` times a step with two CUDA events around its device work, so a step whose
host launches cannot keep up shows the launch time as device time. This splits that span: with
``StepProfile`` around a run, every ``Engine.step`` call first launches a marker kernel
(``torch.cuda._sleep``, named ``spin_kernel``) on the engine's stream; the profiler (CUDA
activity only, so the host is barely slowed) records every kernel, and the kernels between two
markers on that stream are that call's. The engine's step ledger (``enable_step_ledger``) names
each call's step kind. ``summarize`` gives, per kind: steps, the device span (first kernel's start
to last kernel's end), the kernels' busy time (union of their intervals, copies included), the
idle inside the span, the compute kernels' own union (copies left out: a copy the step waits
for counts as busy above but not here) and how long after the span's start the first compute
kernel runs, and the kernels that take the most time.
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from typing import Any, Iterable, Sequence

MARKER = "spin_kernel"
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")

# what a step's device time is spent on (``kernel_category``), in table order; a layer's frozen
# products are told apart by their order (``label_products``)
PROJECTIONS = ("qkv", "o", "gate_up", "down")
CATEGORIES = tuple(f"gemm {p}" for p in PROJECTIONS) + (
    "gemm", "lm head", "attention decode", "attention prefill", "norm", "rope / swiglu", "lora", "sampling",
    "elementwise", "copies", "other")
_GEMM_NAMES = ("gemm", "cutlass", "nvjet", "xmma", "splitkreduce", "_skinny_kernel", "cublas")
_SAMPLING_NAMES = ("argmax", "softmax", "topk", "sort", "radix", "multinomial", "exponential", "distribution",
                   "cumsum", "scan", "gather_kernel", "index_kernel")


def union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def is_marker(event: dict) -> bool:
    """The marker kernel (its trace name is demangled, e.g. ``at::cuda::(anonymous
    namespace)::spin_kernel(long)``)."""
    return event.get("cat") == "kernel" and MARKER in event.get("name", "")


def call_windows(events: Sequence[dict]) -> list[list[dict]]:
    """Device events of a trace cut into calls: window ``i`` holds what ran after the ``i``-th
    marker (on the markers' stream, plus any other stream's events that start in that time) and
    before the next marker. Events before the first marker or after the last are dropped (the
    last marker closes the last window)."""
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES and "dur" in e]
    markers = sorted((e for e in device if is_marker(e)), key=lambda e: e["ts"])
    if not markers:
        return []
    starts = [m["ts"] for m in markers]
    windows: list[list[dict]] = [[] for _ in markers[:-1]]
    for e in device:
        if is_marker(e) or e["ts"] < starts[0] or e["ts"] >= starts[-1]:
            continue
        lo, hi = 0, len(starts) - 1  # the last marker at or before e's start
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if starts[mid] <= e["ts"]:
                lo = mid
            else:
                hi = mid - 1
        windows[lo].append(e)
    return windows


def kernel_category(event: dict) -> str:
    """A device event's category (``CATEGORIES``; frozen products are "gemm" until
    ``label_products`` names them) from its trace category and name."""
    if event.get("cat") in ("gpu_memcpy", "gpu_memset"):
        return "copies"
    n = event.get("name", "").lower()
    if "lora" in n or "segment" in n or "shrink" in n or "expand" in n:  # (prefill LoRA: _splitk_shrink, _live_expand)
        return "lora"
    if any(g in n for g in _GEMM_NAMES):
        return "gemm"
    if "paged_decode" in n or "combine_splits" in n or "combine_items" in n or "combine_stream" in n:
        return "attention decode"
    if "attention" in n or "attn" in n or "flash" in n or "fmha" in n or "paged_prefill" in n:
        return "attention decode" if "decode" in n else "attention prefill"
    if "norm" in n:
        return "norm"
    if "rope" in n or "swiglu" in n or "silu" in n or "write_kv" in n:
        return "rope / swiglu"
    if any(k in n for k in _SAMPLING_NAMES) or "reduce" in n:
        return "sampling"
    if "copy" in n or "memcpy" in n or "memset" in n or "fill" in n:
        return "copies"
    if "elementwise" in n or "vectorized" in n:
        return "elementwise"
    return "other"


def label_products(events: Sequence[dict]) -> list[str]:
    """Each event's category, in the order given (sorted by start), with the frozen products
    named: consecutive "gemm" events are one product (a split-K's reduce joins its GEMM); those
    after the window's last norm are the LM head; those before it, when there are 4 per layer,
    cycle q/k/v, o, gate/up, down as a decoder layer runs them (else they stay "gemm")."""
    cats = [kernel_category(e) for e in events]
    products: list[list[int]] = []
    for i, c in enumerate(cats):
        if c != "gemm":
            continue
        if products and products[-1][-1] == i - 1:
            products[-1].append(i)
        else:
            products.append([i])
    last_norm = max((i for i, c in enumerate(cats) if c == "norm"), default=-1)
    body = [p for p in products if p[0] < last_norm]
    for p in products:
        if p[0] > last_norm >= 0:
            for i in p:
                cats[i] = "lm head"
    if body and len(body) % len(PROJECTIONS) == 0:
        for j, p in enumerate(body):
            for i in p:
                cats[i] = f"gemm {PROJECTIONS[j % len(PROJECTIONS)]}"
    return cats


def idle_gaps(events: Sequence[dict], min_us: float = 20.0) -> list[tuple[str, str, float]]:
    """The device's idle stretches inside a window of at least ``min_us``: (the event that ran
    last before it, the one after it, idle us). Events of every stream count as busy."""
    out, end, last = [], None, ""
    for e in sorted(events, key=lambda e: e["ts"]):
        if end is not None and e["ts"] - end >= min_us:
            out.append((last, e["name"], e["ts"] - end))
        if end is None or e["ts"] + e["dur"] > end:
            end, last = e["ts"] + e["dur"], e["name"]
    return out


def summarize(windows: Sequence[Sequence[dict]], kinds: Sequence[str | None], top: int = 8) -> list[dict]:
    """Per step kind (``kinds[i]`` names window ``i``; None: a call that launched no step, skipped):
    steps, device span, busy and idle-inside ms in all, and the ``top`` kernels by time."""
    acc: dict[str, dict[str, Any]] = {}
    for events, kind in zip(windows, kinds):
        if kind is None or not events:
            continue
        row = acc.setdefault(kind, {"kind": kind, "steps": 0, "span_ms": 0.0, "busy_ms": 0.0, "compute_ms": 0.0,
                                    "lead_ms": 0.0, "kernels": defaultdict(lambda: [0, 0.0]),
                                    "gaps": defaultdict(lambda: [0, 0.0]),
                                    "categories": defaultdict(lambda: [0, 0.0])})
        ordered = sorted(events, key=lambda e: e["ts"])
        for e, cat in zip(ordered, label_products(ordered)):
            c = row["categories"][cat]
            c[0] += 1
            c[1] += e["dur"] / 1e3
        for before, after, idle in idle_gaps(events):
            g = row["gaps"][(before[:40], after[:40])]
            g[0] += 1
            g[1] += idle / 1e3
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in events]
        row["steps"] += 1
        row["span_ms"] += (max(e for _, e in spans) - min(s for s, _ in spans)) / 1e3
        row["busy_ms"] += union_us(spans) / 1e3
        # kernels only (copies overlap compute or hold it back): their union, and how long after
        # the window's first event the first kernel starts (e.g. behind adapter page-in copies)
        kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat", "kernel") == "kernel"]
        row["compute_ms"] += union_us(kernels) / 1e3
        row["lead_ms"] += (min(s for s, _ in kernels) - min(s for s, _ in spans)) / 1e3 if kernels else 0.0
        for e in events:
            k = row["kernels"][e["name"]]
            k[0] += 1
            k[1] += e["dur"] / 1e3
    rows = []
    for row in sorted(acc.values(), key=lambda r: -r["span_ms"]):
        kernels = sorted(row.pop("kernels").items(), key=lambda kv: -kv[1][1])
        gaps = sorted(row.pop("gaps").items(), key=lambda kv: -kv[1][1])
        cats = row.pop("categories")
        n = row["steps"]
        rows.append({**row, "idle_ms": row["span_ms"] - row["busy_ms"],
                     "all_kernels": {name[:90]: {"per_step": c / n, "ms_per_step": t / n} for name, (c, t) in kernels},
                     "busy_fraction": row["busy_ms"] / row["span_ms"] if row["span_ms"] > 0 else None,
                     "span_ms_per_step": row["span_ms"] / n, "busy_ms_per_step": row["busy_ms"] / n,
                     "compute_ms_per_step": row["compute_ms"] / n, "lead_ms_per_step": row["lead_ms"] / n,
                     "top": [{"name": name[:90], "per_step": c / n, "ms_per_step": t / n}
                             for name, (c, t) in kernels[:top]],
                     "idle_gaps": [{"after": a, "before": b, "per_step": c / n, "ms_per_step": t / n}
                                   for (a, b), (c, t) in gaps[:top]],
                     "categories": {k: {"per_step": cats[k][0] / n, "ms_per_step": cats[k][1] / n}
                                    for k in CATEGORIES if k in cats}})
    return rows


def table(rows: Sequence[dict]) -> str:
    lines = ["| step kind | steps | device span ms/step | kernels busy ms/step | busy / span | compute only ms/step "
             "| first kernel after ms | top kernels (ms/step) | largest idle, after -> before (ms/step) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tops = "; ".join(f"{t['name'][:40]} {t['ms_per_step']:.2f}" for t in r["top"][:4])
        gaps = "; ".join(f"{g['after'][:28]} -> {g['before'][:28]} {g['ms_per_step']:.2f}"
                         for g in r.get("idle_gaps", [])[:3])
        frac = "-" if r["busy_fraction"] is None else f"{r['busy_fraction']:.0%}"
        lines.append(f"| {r['kind']} | {r['steps']} | {r['span_ms_per_step']:.2f} | {r['busy_ms_per_step']:.2f} | "
                     f"{frac} | {r.get('compute_ms_per_step', 0.0):.2f} | {r.get('lead_ms_per_step', 0.0):.2f} | "
                     f"{tops} | {gaps} |")
    return "\n".join(lines)


def category_table(rows: Sequence[dict], kinds: Sequence[dict] | None = None) -> str:
    """Per step kind: its tokens fed, floor and GPU ms per step (``kinds``: ``floor.breakdown``'s
    rows of the same run, joined by kind), device span and idle, then ms per step in each category (launches
    per step in brackets where more than one)."""
    by_kind = {k["kind"]: k for k in kinds or ()}
    used = [c for c in CATEGORIES if any(c in r.get("categories", {}) for r in rows)]
    lines = ["| step kind | steps | tokens | floor ms | GPU ms | span ms | idle ms | " + " | ".join(used) + " |",
             "|---" * (7 + len(used)) + "|"]
    for r in rows:
        k = by_kind.get(r["kind"])
        floor = "-" if k is None else f"{1e3 * k['floor_s'] / k['steps']:.2f}"
        gpu = "-" if k is None or not k.get("gpu_s") else f"{1e3 * k['gpu_s'] / k['steps']:.2f}"
        tokens = "-" if k is None or "tokens" not in k else f"{k['tokens'] / k['steps']:.0f}"
        cells = []
        for c in used:
            v = r.get("categories", {}).get(c)
            cells.append("-" if v is None else f"{v['ms_per_step']:.2f}"
                         + (f" ({v['per_step']:.0f})" if v["per_step"] >= 1.5 else ""))
        lines.append(f"| {r['kind']} | {r['steps']} | {tokens} | {floor} | {gpu} | {r['span_ms_per_step']:.2f} | "
                     f"{r['span_ms_per_step'] - r['busy_ms_per_step']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# the profile's categories summed into the parts the floor prices on their own (``floor.PARTS``)
PART_CATEGORIES = {
    "products": tuple(f"gemm {p}" for p in PROJECTIONS) + ("gemm",), "lm_head": ("lm head",),
    "attention_decode": ("attention decode",), "attention_prefill": ("attention prefill",),
    "elementwise": ("norm", "rope / swiglu", "elementwise"), "lora": ("lora",),
}


def part_table(rows: Sequence[dict], kinds: Sequence[dict]) -> str:
    """Per step kind: GPU ms and floor ms per step, then each part's device ms per step with its
    own floor (``floor.part_floors``, summed by ``floor.breakdown`` as ``part_floor_s``) and the
    share of it reached, then copies, sampling and other kernels, and the device's idle time
    inside the step's span (no floor: all of it is waste)."""
    by_kind = {k["kind"]: k for k in kinds}
    lines = ["| step kind | steps | tokens | GPU ms | floor ms | " + " | ".join(
        f"{p.replace('_', ' ')} ms (floor, %)" for p in PART_CATEGORIES) + " | copies | sampling, other | idle |",
             "|---" * (10 + len(PART_CATEGORIES)) + "|"]
    for r in rows:
        k = by_kind.get(r["kind"])
        if k is None or not k.get("part_floor_s"):
            continue
        n = k["steps"]
        cats = r.get("categories", {})

        def ms(names) -> float:
            return sum(cats[c]["ms_per_step"] for c in names if c in cats)

        cells = []
        for part, names in PART_CATEGORIES.items():
            t, floor = ms(names), 1e3 * k["part_floor_s"][part] / n
            cells.append("-" if t == 0 and floor == 0 else
                         f"{t:.2f} ({floor:.2f}, {floor / t:.0%})" if t > 0 else f"0 ({floor:.2f})")
        gpu = "-" if not k.get("gpu_s") else f"{1e3 * k['gpu_s'] / n:.2f}"
        lines.append(f"| {r['kind']} | {r['steps']} | {k['tokens'] / n:.0f} | {gpu} | {1e3 * k['floor_s'] / n:.2f} | "
                     + " | ".join(cells) + f" | {ms(('copies',)):.2f} | {ms(('sampling', 'other')):.2f} | "
                     f"{r['span_ms_per_step'] - r['busy_ms_per_step']:.2f} |")
    return "\n".join(lines)


# the parts a ceiling keeps at their measured device time: the frozen weights' products (cuBLAS,
# or the split-K skinny kernel where it is faster), which no kernel of ours replaces
MEASURED_PARTS = ("products", "lm_head")


def ceiling(rows: Sequence[dict], kinds: Sequence[dict]) -> dict:
    """The best fraction of its floor a run can reach while its frozen products run as they
    do: per step kind, the products' and LM head's device ms per step as profiled plus every
    other part (``floor.part_floors``: attention, elementwise, the adapters) at its own floor,
    nothing else (no copies, sampling, launches or idle), the parts one after another (a layer's
    parts wait on each other). Kinds are weighted by their steps in the whole run (``kinds``,
    ``floor.breakdown``'s rows), so a profile of the first steps of a kind stands for all of
    them. -> ``{"kinds": [per kind: floor, GPU, products and ceiling ms per step], "floor_s",
    "gpu_s", "ceiling_s", "fraction_now", "fraction_max"}`` over the profiled kinds; a kind
    without a profile row or part floors is left out (``left_out_s``: its floor seconds)."""
    by_row = {r["kind"]: r for r in rows}
    out: dict = {"kinds": [], "floor_s": 0.0, "gpu_s": 0.0, "ceiling_s": 0.0, "left_out_s": 0.0}
    for k in kinds:
        if k["kind"] == "all":  # (the breakdown's total row)
            continue
        r = by_row.get(k["kind"])
        if r is None or not k.get("part_floor_s") or not k.get("gpu_s"):
            out["left_out_s"] += k["floor_s"]
            continue
        n, cats = k["steps"], r.get("categories", {})
        measured = sum(cats[c]["ms_per_step"] for part in MEASURED_PARTS for c in PART_CATEGORIES[part] if c in cats)
        others = sum(1e3 * s / n for part, s in k["part_floor_s"].items() if part not in MEASURED_PARTS)
        row = {"kind": k["kind"], "steps": n, "floor_ms": 1e3 * k["floor_s"] / n, "gpu_ms": 1e3 * k["gpu_s"] / n,
               "products_ms": measured, "others_floor_ms": others, "ceiling_ms": measured + others}
        out["kinds"].append(row)
        out["floor_s"] += k["floor_s"]
        out["gpu_s"] += k["gpu_s"]
        out["ceiling_s"] += n * row["ceiling_ms"] / 1e3
    out["fraction_now"] = out["floor_s"] / out["gpu_s"] if out["gpu_s"] else None
    out["fraction_max"] = out["floor_s"] / out["ceiling_s"] if out["ceiling_s"] else None
    return out


def ceiling_table(c: dict) -> str:
    """``ceiling``'s result as a table: per step kind, floor, GPU now, the products as measured,
    the other parts' floors, the ceiling and the share of the floor each reaches; then the run."""
    lines = ["| step kind | steps | floor ms | GPU ms (share) | products + LM head as measured | other parts' floors "
             "| ceiling ms (share) |", "|---|---|---|---|---|---|---|"]
    for r in c["kinds"]:
        lines.append(f"| {r['kind']} | {r['steps']} | {r['floor_ms']:.2f} | {r['gpu_ms']:.2f} "
                     f"({r['floor_ms'] / r['gpu_ms']:.0%}) | {r['products_ms']:.2f} | {r['others_floor_ms']:.2f} | "
                     f"{r['ceiling_ms']:.2f} ({r['floor_ms'] / r['ceiling_ms']:.0%}) |")
    if c["ceiling_s"]:
        lines.append(f"| run | {sum(r['steps'] for r in c['kinds'])} | {1e3 * c['floor_s']:.0f} | "
                     f"{1e3 * c['gpu_s']:.0f} ({c['fraction_now']:.1%}) | | | "
                     f"{1e3 * c['ceiling_s']:.0f} ({c['fraction_max']:.1%}) |")
    return "\n".join(lines)


class StepProfile:
    """Profile the next ``steps`` calls of ``engine.step`` (CUDA activity only); after the
    context, ``rows`` holds ``summarize``'s table. The engine's step ledger must be on (it
    names each call's kind); ``trace_path``: where the raw trace is written (large);
    ``steps_path``: the profiled steps' device events by step (gzipped JSON, small)."""

    def __init__(self, engine, steps: int, trace_path: str, steps_path: str | None = None) -> None:
        self.engine, self.steps, self.trace_path = engine, steps, trace_path
        self.steps_path = steps_path or trace_path.replace(".json", "_steps.json.gz")
        self.kinds: list[str | None] = []
        self.records: list = []  # the ledger's record of each profiled step (None where kinds is None)
        self.rows: list[dict] = []
        self.ledger = None

    def __enter__(self) -> "StepProfile":
        import torch

        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        self._prof.__enter__()
        original = self._original = self.engine.step
        ledger = self.ledger = self.engine.step_ledger()
        if ledger is None:
            raise RuntimeError("StepProfile needs the engine's step ledger on (enable_step_ledger)")

        def step():
            if self.kinds and self.kinds[-1] is None and sum(k is not None for k in self.kinds) >= self.steps:
                return original()  # counted steps and the closing marker are done
            before = len(ledger.clock.times)
            torch.cuda._sleep(1)  # the marker that opens this call's window (and closes the last one)
            if sum(k is not None for k in self.kinds) >= self.steps:
                self.kinds.append(None)  # a call past the count: its marker only closes the last window
                return original()
            try:
                return original()
            finally:
                times = ledger.clock.times
                self.kinds.append(times[-1].kind.label if len(times) > before and times[-1].kind else None)
                self.records.append(ledger.steps[-1] if self.kinds[-1] is not None and ledger.steps else None)

        self.engine.step = step
        return self

    def __exit__(self, *exc) -> None:
        import torch

        self.engine.step = self._original
        torch.cuda.synchronize()
        self._prof.__exit__(*exc)
        self._prof.export_chrome_trace(self.trace_path)
        with open(self.trace_path) as f:
            events = json.load(f).get("traceEvents", [])
        windows = call_windows(events)
        self.rows = summarize(windows, self.kinds)
        kept = [{"kind": k, "events": [{"name": e["name"][:80], "ts": e["ts"], "dur": e["dur"],
                                        "stream": e.get("args", {}).get("stream")} for e in w]}
                for w, k in zip(windows, self.kinds) if k is not None]
        with gzip.open(self.steps_path, "wt") as f:
            json.dump(kept, f)


def load_steps(path: str) -> tuple[list[list[dict]], list[str]]:
    """``StepProfile``'s kept steps (``steps_path``) back as (windows of device events, kinds),
    the input ``summarize`` takes: a profile summarized again, e.g. after a category changed."""
    with gzip.open(path, "rt") as f:
        kept = json.load(f)
    windows = [[{"ph": "X", "cat": "gpu_memcpy" if e["name"].startswith("Memcpy") else
                 "gpu_memset" if e["name"].startswith("Memset") else "kernel",
                 "name": e["name"], "ts": e["ts"], "dur": e["dur"], "args": {"stream": e.get("stream")}}
                for e in step["events"]] for step in kept]
    return windows, [step["kind"] for step in kept]


# ---------------------------------------------------------------------------------------------
# the adapters' kernels by step kind: what they take against the base alone, what they must move


LORA_NAMES = ("lora", "segment", "splitk", "_live_", "_rope_kv", "_swiglu", "_add_rms_norm")


def _launch_rows(kind: str, max_rows: int) -> int:
    """The rows a step kind's decode LoRA launches cover: a decode step's batch bucket, a mixed
    step's ``min(max_rows, token bucket)`` (mixed_graphs.MixedPieces)."""
    for word in kind.split():
        if word[:1] in "bt" and word[1:].isdigit():
            n = int(word[1:])
            return n if word[0] == "b" else min(n, max_rows)
    return 0


def lora_traffic(kinds: Sequence[str | None], records: Sequence, ledger, shape, *, max_rows: int,
                 grouped_min_rows: int, group_rows: int, block_m: int) -> dict[str, dict]:
    """Per step kind, per step on average: the distinct adapters' A and Bᵀ bytes (what the LoRA
    kernels must move: each adapter of the step once) and an estimate of what they fetch (L2 or
    HBM): the decode rows' shrink one A per row (per group of up to ``group_rows`` rows of one
    adapter where the launch covers at least ``grouped_min_rows`` rows), their expands one Bᵀ per
    row; the prefill rows one A and one Bᵀ per row tile of ``block_m`` rows of an adapter."""
    esz = ledger.adapter_elem_bytes
    layers = shape.num_layers
    sizes: dict[int, tuple[int, int]] = {}

    def ab(key: int) -> tuple[int, int]:
        if key not in sizes:
            ranks = ledger.adapters[key].module_ranks
            sizes[key] = (layers * esz * sum(r * shape.module_dims[m][0] for m, r in ranks),
                          layers * esz * sum(r * shape.module_dims[m][1] for m, r in ranks))
        return sizes[key]

    out: dict[str, dict] = {}
    for kind, rec in zip(kinds, records):
        if kind is None or rec is None:
            continue
        row = out.setdefault(kind, dict.fromkeys(("steps", "adapters", "decode_rows", "prefill_tokens", "a_must",
                                                  "b_must", "a_decode", "b_decode", "a_prefill", "b_prefill"), 0.0))
        grouped = _launch_rows(kind, max_rows) >= grouped_min_rows
        decode = dict(getattr(rec, "decode_adapters", ()))
        row["steps"] += 1
        row["adapters"] += len(rec.adapters)
        row["decode_rows"] += rec.decode_rows
        for key, tokens in rec.adapters:
            a, b = ab(key)
            rows = decode.get(key, 0)
            pre = tokens - rows
            row["a_must"] += a
            row["b_must"] += b
            row["prefill_tokens"] += pre
            row["a_decode"] += a * (-(-rows // group_rows) if grouped else rows)
            row["b_decode"] += b * rows
            tiles = -(-pre // block_m)
            row["a_prefill"] += a * tiles
            row["b_prefill"] += b * tiles
    for row in out.values():
        n = row.pop("steps")
        for k in row:
            row[k] /= n
        row["steps"] = n
    return out


def lora_kernel_table(lora_rows: Sequence[dict], base_rows: Sequence[dict], traffic: dict[str, dict] | None = None,
                      bandwidth: float | None = None, kinds: Sequence[str] | None = None,
                      min_ms: float = 0.03) -> str:
    """Per step kind of the run with adapters (``kinds``: these, in this order; default all):
    each kernel whose time differs from the base alone's (the same kind with "base" for "lora")
    by ``min_ms`` or more a step, or whose name is a LoRA kernel's: ms per step with adapters, without,
    and added; then the step's adapter bytes (``lora_traffic``): MB it must move (distinct
    adapters' A and Bᵀ once) against the estimated MB its kernels fetch, and the must-move
    bytes' time at ``bandwidth``."""
    base = {r["kind"]: r for r in base_rows}
    lines = []
    for r in lora_rows:
        kind = r["kind"]
        if kinds is not None and kind not in kinds:
            continue
        b = base.get(kind.replace(" lora ", " base "), {})
        mine, theirs = r.get("all_kernels", {}), b.get("all_kernels", {})
        names = set(mine) | set(theirs)
        rows = []
        for name in names:
            x = mine.get(name, {}).get("ms_per_step", 0.0)
            y = theirs.get(name, {}).get("ms_per_step", 0.0)
            if abs(x - y) >= min_ms or any(k in name for k in LORA_NAMES):
                launches = mine.get(name, theirs.get(name, {})).get("per_step", 0.0)
                rows.append((x - y, name, x, y, launches))
        added = sum(d for d, *_ in rows)
        span = r["span_ms_per_step"] - b.get("span_ms_per_step", 0.0) if b else None
        head = f"{kind}: {r['steps']} steps, device span {r['span_ms_per_step']:.2f} ms/step"
        if b:
            head += f" ({b['span_ms_per_step']:.2f} base alone: +{span:.2f}); these kernels add {added:.2f}"
        t = (traffic or {}).get(kind)
        if t:
            must = t["a_must"] + t["b_must"]
            floor = f", {1e3 * must / bandwidth:.2f} ms at {bandwidth / 1e9:.0f} GB/s" if bandwidth else ""
            head += (f"\n  {t['adapters']:.1f} adapters, {t['decode_rows']:.0f} decode rows, "
                     f"{t['prefill_tokens']:.0f} adapted prefill tokens a step; must move A {t['a_must'] / 1e6:.0f} + "
                     f"Bt {t['b_must'] / 1e6:.0f} MB{floor}; fetch (est.): decode shrink A {t['a_decode'] / 1e6:.0f}, "
                     f"decode expands Bt {t['b_decode'] / 1e6:.0f}, prefill A {t['a_prefill'] / 1e6:.0f} / "
                     f"Bt {t['b_prefill'] / 1e6:.0f} MB")
        lines.append(head)
        lines.append(f"    {'kernel':<60} {'launches':>8} {'ms lora':>8} {'ms base':>8} {'added':>7}")
        for d, name, x, y, n in sorted(rows, key=lambda v: -abs(v[0])):
            lines.append(f"    {name[:60]:<60} {n:>8.0f} {x:>8.3f} {y:>8.3f} {d:>+7.3f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Summarize a ``bench_tenants.py`` run's kept steps again (after a category changed): for each
    profiled run of the report, its parts against their floors and its ceiling."""
    import argparse
    import os

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("report", help="bench_tenants_<shape>.json")
    ap.add_argument("--steps-dir", default=None, help="where profile_<run>_<arrivals>_steps.json.gz are "
                    "(default: beside the report)")
    args = ap.parse_args(argv)
    with open(args.report) as f:
        report = json.load(f)
    where = args.steps_dir or os.path.dirname(os.path.abspath(args.report))
    for r in report["runs"]:
        if not r.get("profile"):
            continue
        name = r["run"].removesuffix("-profiled")
        path = os.path.join(where, f"profile_{name}_{r['arrivals']}_steps.json.gz".replace(" ", "_"))
        if not os.path.exists(path):
            print(f"{r['run']} {r['arrivals']}: no kept steps at {path}")
            continue
        rows = summarize(*load_steps(path))
        kinds = r["breakdown"]["kinds"]
        print(f"\n{r['run']} {r['arrivals']}: device ms per step by part, each against its own floor\n"
              + part_table(rows, kinds))
        print(f"\n{r['run']} {r['arrivals']}: its ceiling\n" + ceiling_table(ceiling(rows, kinds)))


if __name__ == "__main__":
    main()
