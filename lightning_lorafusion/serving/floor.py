"""The engine's per-step ledger and the physical floor of a run: what its steps must compute and read.

``StepLedger`` records, per engine step (``Engine.enable_step_ledger``), what the step had to do:
its prefill pieces (tokens and the context before them), its decode rows and the KV tokens they
read, the rows that sample a token, and the distinct adapters present with their module ranks.
``run_floor`` turns a ledger and the model's shape (``FloorShape``) into the least time those
steps can take on a device of ``peak_flops`` and ``bandwidth``: per step

    max(FLOPs / peak_flops, bytes / bandwidth)

FLOPs: 2 * (projection weights) per token fed, 2 * hidden * vocab per sampled row (the LM head
runs on those rows only), 4 * heads * head_dim per (query, key) pair per layer (scores and the
weighted sum), 2 * (adapter weights) per token of that adapter. Bytes: the base weights once per
step (whatever the row count), the KV each row reads (a decode row its context and its own token,
a prefill piece its context and itself), each distinct adapter present in the step once. KV
writes and activations are left out (a few percent at most), so the floor is a lower bound;
sliding windows are not modelled (every layer reads the whole context).

The ledger's ``clock`` holds how long each step took, its kind and the time between steps
(``step_times.py``); ``breakdown`` sets them beside each kind's floor.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Iterable, Mapping, Sequence

import torch

from ..specs import ALL_TARGET_MODULES
from .step_times import StepClock


@dataclass(frozen=True)
class LedgerAdapter:
    """An adapter as the floor needs it: ``module_ranks`` ((module, rank) of each target, every layer)."""

    name: str
    module_ranks: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class StepRecord:
    """One step: ``prefill`` (tokens fed, tokens already in the KV cache before them) per piece;
    ``decode_rows`` rows of one token reading ``decode_kv_tokens`` KV tokens in all (each its
    context and its own token); ``sampled_rows``: rows whose logits are computed; ``adapters``:
    (adapter key, tokens of that adapter in the step), one entry per distinct adapter;
    ``decode_adapters``: (adapter key, decode rows of that adapter), the decode rows' share of
    those tokens (what the LoRA kernels' traffic depends on: per-row kernels read an adapter once
    per row, row tiles once per tile)."""

    prefill: tuple[tuple[int, int], ...]
    decode_rows: int
    decode_kv_tokens: int
    sampled_rows: int
    adapters: tuple[tuple[int, int], ...]
    decode_adapters: tuple[tuple[int, int], ...] = ()

    @property
    def tokens(self) -> int:
        return sum(n for n, _ in self.prefill) + self.decode_rows


@dataclass
class StepLedger:
    """The steps an engine ran since ``Engine.enable_step_ledger``, and the byte sizes the floor
    needs that the engine knows best: ``base_weight_bytes`` (what one step reads of the frozen
    weights: projections, norms, the LM head; not the embedding table, of which a step reads a
    few rows), ``kv_bytes_per_token`` (all layers, keys and values), ``adapter_elem_bytes``."""

    base_weight_bytes: int
    kv_bytes_per_token: int
    adapter_elem_bytes: int
    steps: list[StepRecord] = field(default_factory=list)
    adapters: dict[int, LedgerAdapter] = field(default_factory=dict)  # HostAdapter.key -> shape
    # each step's kind and times, and the time between steps (step_times.py), as the engine ran them
    clock: StepClock = field(default_factory=lambda: StepClock(cuda=False))

    def record(self, prefill: Sequence[Any], prefill_lens: Sequence[int], decode: Sequence[Any]) -> None:
        """Append the step about to run (request states as the scheduler planned them, before
        the step advances their ``num_cached``)."""
        pieces = tuple((int(n), st.num_cached) for st, n in zip(prefill, prefill_lens))
        sampled = sum(st.num_cached + n == st.num_tokens for st, n in zip(prefill, prefill_lens)) + len(decode)
        tokens: Counter[int] = Counter()
        for st, n in zip(prefill, prefill_lens):
            if st.adapter is not None:
                tokens[self._adapter_key(st.adapter)] += int(n)
        # decode rows: one token each, counted per adapter object in one pass (no per-row call)
        adapters = list(map(_adapter_of, decode))
        by_id = dict(zip(map(id, adapters), adapters))
        rows: dict[int, int] = {}
        for aid, n in Counter(map(id, adapters)).items():
            if by_id[aid] is not None:
                key = self._adapter_key(by_id[aid])
                tokens[key] += n
                rows[key] = n
        self.steps.append(StepRecord(prefill=pieces, decode_rows=len(decode),
                                     decode_kv_tokens=sum(map(_num_cached, decode)) + len(decode),
                                     sampled_rows=sampled, adapters=tuple(tokens.items()),
                                     decode_adapters=tuple(rows.items())))

    def _adapter_key(self, adapter: Any) -> int:
        if adapter.key not in self.adapters:
            ranks = adapter.module_ranks.tolist()
            self.adapters[adapter.key] = LedgerAdapter(adapter.name, tuple(
                (m, int(r)) for m, r in zip(ALL_TARGET_MODULES, ranks) if r > 0))
        return adapter.key

    def summary(self) -> dict[str, float]:
        """Totals over the steps: tokens by kind, distinct adapters per step (mean, max)."""
        per_step = [len(s.adapters) for s in self.steps]
        return {"steps": len(self.steps), "prefill_tokens": sum(n for s in self.steps for n, _ in s.prefill),
                "decode_rows": sum(s.decode_rows for s in self.steps),
                "decode_kv_tokens": sum(s.decode_kv_tokens for s in self.steps),
                "distinct_adapters": len({k for s in self.steps for k, _ in s.adapters}),
                "adapters_per_step_mean": sum(per_step) / len(per_step) if per_step else 0.0,
                "adapters_per_step_max": max(per_step, default=0)}


_adapter_of = attrgetter("adapter")
_num_cached = attrgetter("num_cached")


@dataclass(frozen=True)
class FloorShape:
    """The model's sizes the FLOPs need: ``module_dims`` (in, out) of each projection a LoRA
    may target (all seven, fused checkpoints split), per layer."""

    num_layers: int
    num_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    module_dims: Mapping[str, tuple[int, int]]

    @classmethod
    def from_config(cls, config: Any) -> "FloorShape":
        """From a ``DecoderConfig``."""
        return cls(num_layers=config.num_layers, num_heads=config.num_heads, head_dim=config.head_dim,
                   hidden_size=config.hidden_size, vocab_size=config.vocab_size,
                   module_dims={m: tuple(config.module_dims(m)) for m in ALL_TARGET_MODULES})

    @property
    def projection_params(self) -> int:
        """Weights of every layer's seven projections (2 FLOPs each per token)."""
        return self.num_layers * sum(k * n for k, n in self.module_dims.values())

    def adapter_elems(self, module_ranks: Iterable[tuple[str, int]]) -> int:
        """Elements of an adapter's A and B over every layer."""
        return self.num_layers * sum(r * sum(self.module_dims[m]) for m, r in module_ranks)


@dataclass(frozen=True)
class StepCost:
    flops: float
    base_bytes: float
    kv_bytes: float
    adapter_bytes: float

    @property
    def bytes(self) -> float:
        return self.base_bytes + self.kv_bytes + self.adapter_bytes


def step_floor_s(step: StepRecord, ledger: StepLedger, shape: FloorShape, *, peak_flops: float,
                 bandwidth: float) -> float:
    """The least time ``step`` can take: max(FLOPs / peak_flops, bytes / bandwidth)."""
    cost = step_cost(step, ledger, shape)
    return max(cost.flops / peak_flops, cost.bytes / bandwidth)


def step_cost(step: StepRecord, ledger: StepLedger, shape: FloorShape) -> StepCost:
    """What ``step`` must compute and read (see the module docstring)."""
    pairs = sum(n * ctx + n * (n + 1) // 2 for n, ctx in step.prefill) + step.decode_kv_tokens
    flops = (2 * shape.projection_params * step.tokens + 2 * shape.hidden_size * shape.vocab_size * step.sampled_rows
             + 4 * shape.num_layers * shape.num_heads * shape.head_dim * pairs)
    adapter_elems = 0
    for key, tokens in step.adapters:
        elems = shape.adapter_elems(ledger.adapters[key].module_ranks)
        flops += 2 * elems * tokens
        adapter_elems += elems
    kv_tokens = sum(ctx + n for n, ctx in step.prefill) + step.decode_kv_tokens
    return StepCost(flops=float(flops), base_bytes=float(ledger.base_weight_bytes),
                    kv_bytes=float(kv_tokens * ledger.kv_bytes_per_token),
                    adapter_bytes=float(adapter_elems * ledger.adapter_elem_bytes))


# the parts of a step's device work, each with a floor of its own (``part_floors``)
PARTS = ("products", "lm_head", "attention_decode", "attention_prefill", "elementwise", "lora")


def part_floors(step: StepRecord, ledger: StepLedger, shape: FloorShape, *, peak_flops: float,
                bandwidth: float) -> dict[str, float]:
    """The least time of each part of ``step`` on its own (``PARTS``), each max(FLOPs / peak,
    bytes / bandwidth): the frozen projections (their weights once, 2 FLOPs per weight per token),
    the LM head (its weight once, its sampled rows), decode and prefill attention (their KV
    reads, their (query, key) pairs), the elementwise work between the products (residual add +
    RMSNorm twice a layer, RoPE + the KV write, SwiGLU: the activations they must read and
    write, which the step's floor leaves out) and the adapters (their bytes once, their FLOPs).
    Their sum is at least the step's floor; a part's measured time against its own floor says
    where the step loses it."""
    elem = ledger.adapter_elem_bytes
    dims = shape.module_dims
    hidden, q_size, kv_size = shape.hidden_size, dims["q_proj"][1], dims["k_proj"][1]
    inter = dims["gate_proj"][1] if "gate_proj" in dims else 0
    attn_flops = 4 * shape.num_layers * shape.num_heads * shape.head_dim
    pre_pairs = sum(n * ctx + n * (n + 1) // 2 for n, ctx in step.prefill)
    pre_kv = sum(ctx + n for n, ctx in step.prefill)
    # per token and layer: add + norm twice (read h and d, write h and x), RoPE + KV write (read
    # q, k, v; write q and k, and k and v into their pages), SwiGLU (read gate and up, write one)
    act = shape.num_layers * (8 * hidden + 2 * q_size + 5 * kv_size + 3 * inter) * elem
    adapter_elems = sum(shape.adapter_elems(ledger.adapters[k].module_ranks) for k, _ in step.adapters)
    adapter_flops = sum(2 * shape.adapter_elems(ledger.adapters[k].module_ranks) * n for k, n in step.adapters)

    def part(flops: float, nbytes: float) -> float:
        return max(flops / peak_flops, nbytes / bandwidth)

    return {
        "products": part(2 * shape.projection_params * step.tokens, shape.projection_params * elem),
        "lm_head": part(2 * hidden * shape.vocab_size * step.sampled_rows,
                        hidden * shape.vocab_size * elem if step.sampled_rows else 0),
        "attention_decode": part(attn_flops * step.decode_kv_tokens, step.decode_kv_tokens * ledger.kv_bytes_per_token),
        "attention_prefill": part(attn_flops * pre_pairs, pre_kv * ledger.kv_bytes_per_token),
        "elementwise": part(0, act * step.tokens),
        "lora": part(adapter_flops, adapter_elems * elem),
    }


def run_floor(ledger: StepLedger, shape: FloorShape, *, peak_flops: float, bandwidth: float) -> dict[str, float]:
    """The floor of the ledger's steps (seconds) with its parts: FLOPs and bytes by kind, and how
    many steps were bound by compute rather than by memory."""
    if peak_flops <= 0 or bandwidth <= 0:
        raise ValueError(f"run_floor needs peak_flops > 0 and bandwidth > 0; got {peak_flops}, {bandwidth}")
    out = {"floor_s": 0.0, "compute_bound_steps": 0, "flops": 0.0, "base_bytes": 0.0, "kv_bytes": 0.0,
           "adapter_bytes": 0.0}
    for step in ledger.steps:
        cost = step_cost(step, ledger, shape)
        compute, memory = cost.flops / peak_flops, cost.bytes / bandwidth
        out["floor_s"] += max(compute, memory)
        out["compute_bound_steps"] += compute > memory
        out["flops"] += cost.flops
        out["base_bytes"] += cost.base_bytes
        out["kv_bytes"] += cost.kv_bytes
        out["adapter_bytes"] += cost.adapter_bytes
    out["steps"] = len(ledger.steps)
    return out


def base_weight_bytes(params: Mapping[str, Any]) -> int:
    """Bytes of the frozen weights a step reads: the storage of every tensor of ``params``, each
    once (fused projections' members are views of one matrix), but the embedding table's (a step
    reads a few of its rows) unless the LM head is that table (tied)."""
    storages: dict[int, int] = {}

    def walk(node: Any) -> None:
        if isinstance(node, torch.Tensor):
            storage = node.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(node, Mapping):
            for v in node.values():
                walk(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)

    walk({k: v for k, v in params.items() if k != "embed"})
    if params.get("lm_head") is None or params.get("lm_head") is params.get("embed"):  # tied: the head reads it all
        walk(params.get("embed"))
    return sum(storages.values())


def breakdown(ledger: StepLedger, shape: FloorShape, *, peak_flops: float, bandwidth: float) -> dict[str, Any]:
    """A ledger's steps grouped by kind: per kind its steps, tokens fed (a mixed step's real
    rows: against its token bucket, how full its padded products were), wall s, GPU s (None on a CPU),
    floor s and floor / GPU (floor / wall without a GPU time), each part's own floor s
    (``part_floor_s``, ``part_floors``), host phases; and the totals with
    the host time between steps (``gap_s``) and, on CUDA, the device's idle time between steps
    (``gpu_gap_s``). Needs a ledger recorded by an engine (one time per step)."""
    clock = ledger.clock
    if len(ledger.steps) != len(clock.times):
        raise ValueError(f"the ledger has {len(ledger.steps)} steps but {len(clock.times)} step times: "
                         "breakdown needs a ledger an engine recorded from its enable_step_ledger")
    clock.resolve()
    keys = ("steps", "tokens", "wall_s", "gpu_s", "floor_s", "schedule_s", "launch_s", "wait_s", "emit_s")
    kinds: dict[str, dict[str, Any]] = {}
    total = dict.fromkeys(keys, 0.0)
    total.update(gap_s=clock.gap_s, gpu_gap_s=0.0, drain_s=clock.drain_s)
    has_gpu = bool(clock.times) and all(t.gpu_s is not None for t in clock.times)
    total["part_floor_s"] = dict.fromkeys(PARTS, 0.0)
    for record, t in zip(ledger.steps, clock.times):
        floor = step_floor_s(record, ledger, shape, peak_flops=peak_flops, bandwidth=bandwidth)
        label = t.kind.label if t.kind is not None else "unknown"
        row = kinds.setdefault(label, {**dict.fromkeys(keys, 0.0), "part_floor_s": dict.fromkeys(PARTS, 0.0)})
        values = {"steps": 1, "tokens": record.tokens, "wall_s": t.wall_s, "gpu_s": t.gpu_s or 0.0, "floor_s": floor,
                  "schedule_s": t.schedule_s, "launch_s": t.launch_s, "wait_s": t.wait_s, "emit_s": t.emit_s}
        for k, v in values.items():
            row[k] += v
            total[k] += v
        for k, v in part_floors(record, ledger, shape, peak_flops=peak_flops, bandwidth=bandwidth).items():
            row["part_floor_s"][k] += v
            total["part_floor_s"][k] += v
        total["gpu_gap_s"] += t.gpu_gap_s or 0.0
    rows = []
    for label, row in sorted(kinds.items(), key=lambda kv: -kv[1]["wall_s"]):
        rows.append(_finish(label, row, has_gpu))
    total = _finish("all", total, has_gpu)
    if not has_gpu:
        total["gpu_gap_s"] = None
    return {"kinds": rows, "total": total, "gpu_times": has_gpu}


def _finish(label: str, row: dict[str, Any], has_gpu: bool) -> dict[str, Any]:
    row["steps"], row["tokens"] = int(row["steps"]), int(row["tokens"])
    if not has_gpu:
        row["gpu_s"] = None
    device = row["gpu_s"] if has_gpu else row["wall_s"]
    row["floor_over_gpu"] = row["floor_s"] / device if device > 0 else None
    return {"kind": label, **row}
