"""Decode steps as CUDA graphs: the decode rows' persistent input buffers, padded to batch-size
buckets, and one captured graph per (bucket, with or without LoRA, rank variant)."""

from __future__ import annotations

import bisect
import itertools
import operator
import time
from typing import Callable, Sequence

import numpy as np
import torch

from ..capture import capture_batch, graph_capture
from ..kernels import lora_gather
from ..kernels.lora_gather import adapter_groups
from ..specs import ALL_TARGET_MODULES
from .request import RequestState
from .staging import SeparateTables, StagedTables


_pages_of = operator.attrgetter("pages")


def graph_buckets(max_rows: int) -> tuple[int, ...]:
    """Batch sizes a decode step is padded to: the powers of two below ``max_rows``, then
    ``max_rows`` (1, 2, 4, ..., 128, 256 for 256)."""
    if max_rows < 1:
        raise ValueError(f"max_rows={max_rows} must be >= 1")
    sizes = []
    b = 1
    while b < max_rows:
        sizes.append(b)
        b *= 2
    return (*sizes, max_rows)


# padded mixed steps of at least this many tokens get a bucket between each two powers of two
# (3 * 2^k): from here on an 8B step's products are compute-bound on an H100, so every padding
# row costs what a real one does (docs/serving.md "Mixed steps as graphs")
FINE_TOKEN_BUCKETS_FROM = 512
TOKEN_BUCKETS = ("quarters", "fine", "pow2")


def token_buckets(max_tokens: int, mode: str = "fine") -> tuple[int, ...]:
    """Token counts a padded mixed step is padded to: ``graph_buckets(max_tokens)`` ("pow2"),
    from ``FINE_TOKEN_BUCKETS_FROM`` on with "fine" also 3 * 2^k between the powers of two (768,
    1,536, 3,072, 6,144 up to 8,192: a step fills its bucket to at least two thirds, not one half),
    with "quarters" 5, 6 and 7 * 2^(k-2) (640, 768, 896, 1,280, ...: at least four fifths)."""
    if mode not in TOKEN_BUCKETS:
        raise ValueError(f"token buckets {mode!r}; allowed: {', '.join(TOKEN_BUCKETS)}")
    sizes = set(graph_buckets(max_tokens))
    steps = {"fine": (6,), "quarters": (5, 6, 7), "pow2": ()}[mode]
    p = FINE_TOKEN_BUCKETS_FROM
    while p < max_tokens:
        sizes.update(n * p // 4 for n in steps if n * p // 4 < max_tokens)
        p *= 2
    return tuple(sorted(sizes))


# "auto" ``EngineTuning.mixed_graph_max_tokens``: base-only mixed steps padded (captured pieces)
# up to the token count at which the frozen products take this many FLOPs (2 * projection weights
# per token: 2,149 tokens at the 8B shape, so its buckets up to 2,048), larger ones unpadded and
# eager. From there a step is device-bound (an 8B step of 2,048 tokens: ~53 ms on an H100
# against ~10-25 ms of eager launches), so a graph saves no time, while padding to the next
# bucket costs up to a third of the step's products (docs/serving.md "Mixed steps as graphs")
GRAPH_MAX_FLOPS = 3e13


def graph_token_limit(setting: int | str, projection_params: int) -> int | None:
    """The most real tokens of a mixed step padded to a token bucket (``EngineTuning.
    mixed_graph_max_tokens``): ``setting`` tokens, "all" (None: every bucket) or "auto"
    (``GRAPH_MAX_FLOPS`` of a model of ``projection_params`` projection weights)."""
    if setting == "all":
        return None
    if setting == "auto":
        return int(GRAPH_MAX_FLOPS // (2 * max(projection_params, 1)))
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ValueError(f"mixed_graph_max_tokens={setting!r}; allowed: auto, all or a token count >= 1")
    return setting


def bucket_for(rows: int, buckets: Sequence[int]) -> int:
    """The smallest bucket holding ``rows`` rows."""
    i = bisect.bisect_left(buckets, rows)
    if i == len(buckets):
        raise ValueError(f"{rows} decode rows exceed the largest bucket {buckets[-1]}")
    return buckets[i]


class DecodeInputs:
    """The decode rows' inputs of a step, in device buffers that live as long as the engine (a
    captured graph reads them at fixed addresses). Sized for ``max_rows``; a step of B decode
    rows fills rows ``[:B]``; padded to a bucket, rows ``[B:bucket)`` are inert: token 0 at
    position 0, whose key and value go to the pool's scratch page, LoRA rank 0.

    - ``step [3, max_rows]`` int64: each row's token, its position, and the page its KV slot
      is in (rewritten every step; the slot's offset and the row's length follow from the
      position);
    - ``page_table [max_rows, max_pages]`` int32, ``lora_offsets [L, modules, 2, max_rows]``
      int64 (element offsets of A and B^T in the pool), ``lora_ranks [modules, max_rows]``
      int32 (0 = no LoRA), ``lora_scales [max_rows]`` fp32, ``lora_groups [4, max_rows]`` int32
      (the rows grouped by adapter, ``lora_gather.adapter_groups``): rebuilt when the decode rows change
      (a request joins, leaves or is preempted, or KV pages were moved); between rebuilds only
      the page-table entries of rows that gained a page are written.
    """

    def __init__(self, *, max_rows: int, max_pages: int, num_layers: int, page_size: int, scratch_page: int,
                 device: torch.device) -> None:
        self.max_rows, self.page_size, self.scratch_page = max_rows, page_size, scratch_page
        self.device = device
        n_mod = len(ALL_TARGET_MODULES)
        self.step = torch.zeros(3, max_rows, dtype=torch.int64, device=device)
        self.step[2] = scratch_page
        self.page_table = torch.full((max_rows, max_pages), scratch_page, dtype=torch.int32, device=device)
        self.lora_offsets = torch.zeros(num_layers, n_mod, 2, max_rows, dtype=torch.int64, device=device)
        self.lora_ranks = torch.zeros(n_mod, max_rows, dtype=torch.int32, device=device)
        self.lora_scales = torch.zeros(max_rows, dtype=torch.float32, device=device)
        self.lora_groups = torch.zeros(4, max_rows, dtype=torch.int32, device=device)  # (adapter_groups)
        self._no_offsets = np.zeros(num_layers * n_mod * 2, dtype=np.int64)  # table column 0: no adapter
        self._no_ranks = np.zeros(n_mod, dtype=np.int32)
        self.modules: frozenset[str] = frozenset()  # modules some current row adapts
        self.max_rank = 0  # the largest rank of any module of any current row (0: no LoRA)
        self._rows: list[RequestState] = []  # the requests the tables hold, in row order
        self._pages_written: list[int] = []
        self._pages_moved = -1
        # what step[:, :rows] was last given, on the host: on CUDA two pinned mirrors used in
        # turn (a copy from one may still be queued behind a running step while the next step's
        # inputs are written into the other; engine.py's overlapped decode), else one
        pinned = self.device.type == "cuda"
        self._mirrors = [torch.zeros(3, max_rows, dtype=torch.int64, pin_memory=pinned) for _ in range(1 + pinned)]
        self._mirror = 0
        self._host_tensor = self._mirrors[0]
        self._host = self._host_tensor.numpy()  # the same memory
        self._step_rows: list[RequestState] = []  # the rows of the last load_step, in order
        self._step_bucket = 0
        # how the rebuilt tables reach the device (staging.py; the runner's ``host_tables`` sets it)
        self.tables: StagedTables | SeparateTables = SeparateTables(device)

    @property
    def has_lora(self) -> bool:
        return bool(self.modules)

    def load_step(self, decode: Sequence[RequestState], rows: int, next_tokens: Sequence[int] | None = None,
                  token_tensor: torch.Tensor | None = None) -> None:
        """Write ``step[:, :rows]``: the decode rows' newest tokens, then ``rows - len(decode)``
        padding rows. ``next_tokens``: the rows' newest tokens when each row is one token
        further than at the previous call, which had the same rows in the same order (a
        decode-only step after a decode-only step): positions are advanced and only rows that
        entered a new page look their page up (no per-row Python otherwise). ``token_tensor``
        (``[len(decode)]`` on the device): the rows' newest tokens not yet on the host (the
        previous step sampled them and may still be running; the engine's overlapped decode):
        copied on the device; each row's state then lacks that token, so its position is
        ``num_tokens``, not ``num_tokens - 1``."""
        s, b = self.page_size, len(decode)
        same = (rows == self._step_bucket and len(self._step_rows) == b
                and all(map(operator.is_, decode, self._step_rows)))
        ahead = token_tensor is not None
        if len(self._mirrors) > 1:  # the other pinned mirror, starting from what the last step was given
            previous = self._host
            self._mirror ^= 1
            self._host_tensor = self._mirrors[self._mirror]
            self._host = self._host_tensor.numpy()
            self._host[:, :rows] = previous[:, :rows]
        host = self._host
        if same and (next_tokens is not None or token_tensor is not None):
            if next_tokens is not None:
                host[0, :b] = next_tokens
            positions = host[1, :b]
            positions += 1
            for i in np.flatnonzero(positions % s == 0).tolist():
                host[2, i] = decode[i].pages[int(positions[i]) // s]
        else:
            tokens, positions, pages = [], [], []
            for st in decode:
                p = st.num_tokens - 1 + ahead
                tokens.append(0 if ahead else st.last_token)  # (ahead: written on the device below)
                positions.append(p)
                pages.append(st.pages[p // s])
            host[0, :b], host[1, :b], host[2, :b] = tokens, positions, pages
            host[:2, b:rows] = 0
            host[2, b:rows] = self.scratch_page
            self._step_rows, self._step_bucket = list(decode), rows
        self.step[:, :rows].copy_(self._host_tensor[:, :rows], non_blocking=True)
        if ahead:  # then the rows' tokens from the device (host[0, :b] is stale)
            self.step[0, :b].copy_(token_tensor)

    def forget_step(self) -> None:
        """The rows moved on without ``load_step`` (a step with prefill rows ran): the next
        ``load_step`` rewrites every row."""
        self._step_rows = []

    def load_tables(self, decode: Sequence[RequestState], pages_moved: int) -> bool:
        """Bring the page table and LoRA tables up to date for ``decode`` (in row order);
        ``pages_moved``: the pool's counter of moved KV pages. True if rebuilt from scratch."""
        same = (pages_moved == self._pages_moved and len(decode) == len(self._rows)
                and all(map(operator.is_, decode, self._rows)))
        if not same:
            self._rebuild(decode)
            self._pages_moved = pages_moved
            return True
        counts = list(map(len, map(_pages_of, decode)))  # no per-row Python unless a row grew
        if counts == self._pages_written:
            return False
        rows, cols, pages = [], [], []
        for i, st in enumerate(decode):
            done = self._pages_written[i]
            if counts[i] != done:
                new = st.pages[done:]
                rows += [i] * len(new)
                cols += range(done, done + len(new))
                pages += new
                self._pages_written[i] = len(st.pages)
        if pages:  # pinned on CUDA: a copy from pageable memory may wait for the running step
            idx = torch.tensor([rows, cols, pages], dtype=torch.int64,
                               pin_memory=self.device.type == "cuda").to(self.device, non_blocking=True)
            self.page_table.index_put_((idx[0], idx[1]), idx[2].to(torch.int32))
        return False

    def _rebuild(self, decode: Sequence[RequestState]) -> None:
        b = len(decode)
        self._rows = list(decode)
        self._pages_written = [len(st.pages) for st in decode]
        tables = self.tables  # the host tables queued, then uploaded (one copy when packed)
        queued = {}
        if b:
            lens = np.array(self._pages_written)
            width = int(lens.max())
            table = np.full((b, width), self.scratch_page, dtype=np.int32)
            # every row's pages at once: the mask's True cells in row order are the pages in row order
            table[np.arange(width) < lens[:, None]] = np.fromiter(
                itertools.chain.from_iterable(st.pages for st in decode), dtype=np.int32, count=int(lens.sum()))
            queued["table"] = tables.add(table, torch.int32)
        # distinct adapters of the rows (index 0 = no adapter), then one gather per table
        slot: dict[int, int] = {}
        residents = []
        index = []
        for st in decode:
            r = st.resident
            if r is None:
                index.append(0)
                continue
            if id(r) not in slot:
                slot[id(r)] = len(residents) + 1
                residents.append(r)
            index.append(slot[id(r)])
        # one table per kind, a column per distinct adapter (0: none), then one gather of the
        # rows' columns: numpy (torch's CPU gather of these ~115k offsets took ~8 ms a rebuild)
        offsets = np.stack([self._no_offsets] + [r.lora_offsets.numpy().reshape(-1) for r in residents], axis=1)
        ranks = np.stack([self._no_ranks] + [r.adapter.module_ranks.numpy() for r in residents], axis=1)
        scales = np.array([0.0] + [r.adapter.scale for r in residents], dtype=np.float32)
        idx = np.asarray(index, dtype=np.int64)
        if b:
            queued["offsets"] = tables.add(offsets[:, idx].reshape(*self.lora_offsets.shape[:3], b), torch.int64)
            queued["ranks"] = tables.add(ranks[:, idx], torch.int32)
            queued["scales"] = tables.add(scales[idx], torch.float32)
        if self.max_rows >= lora_gather.grouped_min_rows():  # (else no batch is large enough to read them)
            queued["groups"] = tables.add(adapter_groups(index, self.max_rows), torch.int32)  # (empty past b)
        up = tables.upload() if queued else []
        if b:
            self.page_table[:b, :table.shape[1]].copy_(up[queued["table"]])
            self.lora_offsets[..., :b].copy_(up[queued["offsets"]])
            self.lora_ranks[:, :b].copy_(up[queued["ranks"]])
            self.lora_scales[:b].copy_(up[queued["scales"]])
        if "groups" in queued:
            self.lora_groups.copy_(up[queued["groups"]])
        # rows past the real ones are inert in any bucket: the scratch page, rank 0
        self.page_table[b:, 0] = self.scratch_page
        self.lora_ranks[:, b:] = 0
        self.lora_scales[b:] = 0.0
        self.modules = frozenset(m for r in residents for m in r.adapter.target_modules)
        self.max_rank = int(ranks.max())


def graph_key(rows: int, lora: bool, dora: bool, max_rank: int) -> tuple[int, bool, bool, int | None]:
    """The decode graph a step over ``rows`` (a bucket) rows replays: ``(bucket, lora, dora,
    rank bound)``, the bound ``lora_gather.decode_rank_bound`` of the rows' largest rank
    ``max_rank`` (None without LoRA): the kernels' rank variant, one of at most two per bucket."""
    return rows, lora, dora, lora_gather.decode_rank_bound(rows, max_rank) if lora else None


def captured_keys(buckets: Sequence[int]) -> list[tuple[int, bool, bool, int | None]]:
    """The keys ``DecodeGraphs.capture`` captures, in order (largest bucket first, LoRA first):
    every bucket without LoRA, and with LoRA once per rank variant of that bucket
    (``lora_gather.decode_rank_bounds``). Nothing here depends on the adapters loaded."""
    return [(rows, lora, False, bound) for lora in (True, False) for rows in sorted(buckets, reverse=True)
            for bound in (lora_gather.decode_rank_bounds(rows) if lora else (None,))]


class DecodeGraphs:
    """One CUDA graph per key (``graph_key``) of ``run(rows, lora, dora, rank_bound)``, a decode
    forward over the first ``rows`` rows of the static inputs that writes its logits into a
    static buffer. Captured largest bucket first into one shared memory pool (a smaller graph
    reuses the larger ones' intermediates; graphs never run concurrently). A bucket's graph with
    DoRA rows (their gains read from the fixed-shape slot table, ``dora_rows.DoraSlots``) is
    captured on its first such step, into the same pool."""

    def __init__(self, buckets: Sequence[int], run: Callable[[int, bool, bool, int | None], None]) -> None:
        self.buckets = tuple(buckets)
        self._run = run
        self._graphs: dict[tuple[int, bool, bool, int | None], torch.cuda.CUDAGraph] = {}
        self.pool = None  # the graphs' memory pool (mixed-step pieces share it)

    def capture(self) -> float:
        """Capture every ``captured_keys`` key (none with DoRA); returns the seconds it took."""
        t0 = time.perf_counter()
        with capture_batch(torch.device("cuda", torch.cuda.current_device())):
            for key in captured_keys(self.buckets):
                self._capture(*key)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def _capture(self, rows: int, lora: bool, dora: bool, rank_bound: int | None) -> None:
        self._run(rows, lora, dora, rank_bound)  # warm-up: Triton compiles, cuBLAS picks its kernels
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread-local: another engine's thread in this process may use the GPU meanwhile
        with graph_capture(graph, pool=self.pool):
            self._run(rows, lora, dora, rank_bound)
        self.pool = graph.pool() if self.pool is None else self.pool
        self._graphs[(rows, lora, dora, rank_bound)] = graph

    @property
    def keys(self) -> list[tuple[int, bool, bool, int | None]]:
        """The captured ``(bucket, lora, dora, rank bound)`` keys, sorted (bound None first): the
        ranks of the rows and their DoRA gains are values in the tables the graphs read; the bound
        takes at most two values per bucket (``graph_key``), so no key depends on which ranks
        are loaded."""
        return sorted(self._graphs, key=lambda key: (*key[:3], -1 if key[3] is None else key[3]))

    def replay(self, rows: int, lora: bool, dora: bool = False, max_rank: int = 0) -> None:
        """Replay the graph of a step over ``rows`` rows whose largest rank is ``max_rank``
        (a DoRA one captured now if it is the first: its warm-up runs the step, whose KV writes
        the replay repeats with the same values)."""
        key = graph_key(rows, lora, dora, max_rank)
        if key not in self._graphs:
            self._capture(*key)
        self._graphs[key].replay()
