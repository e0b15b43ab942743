"""The unified GPU pool: KV-cache pages and adapter weights carved out of one budget of pages.

One flat storage tensor of ``num_pages * page_elems`` elements is viewed two ways:

- as the KV cache ``kv [P, L, 2, S, Hkv, D]``: a page holds ``S`` consecutive tokens of one
  sequence for every layer (keys and values);
- as a flat buffer holding adapters: an adapter occupies a contiguous run of whole pages and
  its matrices sit at element offsets inside it (``HostAdapter.slots``), so ranks of any size
  share the pool without padding to the largest one.

KV pages are taken lowest-first and adapter runs highest-first, so the two grow from opposite
ends. One more page past the ``num_pages`` of the budget, ``scratch_page``, is never handed
out: padded rows of a CUDA-graphed decode step write their keys and values there. When no free
run is long enough, KV pages inside the cheapest adapter-free window are
moved out (their owners' page lists are updated in place); when pages are short, adapters no
running request uses are evicted least-recently-used first. Host copies are never dropped, so
an evicted adapter pages back in on its next use.

Prefix caching: a full KV page may be registered under a ``PageKey`` (adapter identity, the
previous page's key, the page's token ids; see ``prefix_page_keys``) and shared by several
page lists (reference-counted: a page's owners). Prompt pages and pages filled while decoding
are registered alike (the scheduler decides when a page's keys and values are all written). A
registered page whose last owner lets it go stays cached (no owner, in an LRU) until its room
is needed: cached pages count as available and are dropped least-recently-used first, a
sequence's tail before its head, before any idle adapter is evicted (and so before the
scheduler preempts a request).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from .adapters import ALIGN, HostAdapter
from .page_in_layers import copy_waves, layer_chunks


@dataclass(eq=False)
class ResidentAdapter:
    """An adapter's run of pages in the pool."""

    adapter: HostAdapter
    first_page: int
    num_pages: int
    offset: int  # element offset of its first element in the flat storage
    users: int = 0  # running requests using it (not evictable while > 0)
    last_used: int = 0
    ready: torch.cuda.Event | None = None  # its host-to-device copy, when asynchronous
    # the copy in slices of layers (``page_in_layers``): (first layer, event after the slice), or None
    layer_ready: list[tuple[int, Any]] | None = None
    prefetched: bool = False  # paged in ahead of its requests' admission, none admitted since

    @cached_property
    def lora_offsets(self) -> torch.Tensor:
        """``[L, modules, 2]`` int64 element offsets of its A and B^T in the pool (its
        ``relative_offsets`` moved by where it sits), host tensor, computed once per residency."""
        return self.adapter.relative_offsets + self.offset


PageKey = bytes  # a 32-byte digest chaining the adapter, the previous page's key and the page's tokens


def prefix_page_keys(adapter_key: int | None, token_ids: Sequence[int], page_size: int,
                     num_pages: int, known: Sequence[PageKey] = (), salt: bytes = b"") -> list[PageKey]:
    """Keys of the first ``num_pages`` full pages of ``token_ids``: page i's key hashes the
    adapter identity (``HostAdapter.key``, unique per load; None = base), page i-1's key and
    page i's token ids, so equal keys mean the same adapter and the same leading tokens.
    ``known``: keys of the first pages from an earlier call over the same leading tokens (a
    sequence that grew by decoding); only the pages after them are hashed. ``salt``: what else
    the cached keys and values depend on (LongRoPE's short or long factors)."""
    keys = list(known[:num_pages])
    prev = keys[-1] if keys else (b"base" if adapter_key is None else b"adapter%d" % adapter_key) + salt
    for i in range(len(keys), num_pages):
        tokens = np.asarray(token_ids[i * page_size:(i + 1) * page_size], dtype=np.int64)
        prev = hashlib.sha256(prev + b"|" + tokens.tobytes()).digest()
        keys.append(prev)
    return keys


class FreedPageFences:
    """Where on the compute stream each page was last let go, so a host-to-device copy into
    pages (an adapter's page-in, on its own stream) waits for the kernels that could still
    read or write them, and for nothing queued after: a page-in issued right after a step is
    launched then overlaps that step. ``make_fence()`` marks the compute stream's position now
    (a recorded CUDA event; anything with ``query()`` -> done); fences complete in the order
    made, so the done ones are retired oldest first."""

    def __init__(self, num_pages: int, make_fence) -> None:
        self._make_fence = make_fence
        self._epoch = np.zeros(num_pages, dtype=np.int64)  # 0: nothing queued ever touched the page
        self._fences: OrderedDict[int, object] = OrderedDict()  # epoch -> its fence, not known done
        self._next = 1

    def freed(self, pages) -> None:
        """``pages`` (indices or a slice) are let go now: later copies into them wait for this point."""
        epoch = self._next
        self._next += 1
        self._fences[epoch] = self._make_fence()
        self._epoch[pages] = epoch
        if len(self._fences) > 256:  # (a pool serving no adapters never asks pending)
            self._retire()

    def pending(self, start: int, count: int):
        """The fence a copy into pages ``start .. start + count - 1`` must wait for, or None
        when every kernel that touched them is done."""
        self._retire()
        epoch = int(self._epoch[start:start + count].max(initial=0))
        return self._fences.get(epoch)

    def _retire(self) -> None:
        """Forget the done fences, oldest first (a page whose epoch has none left is free to write)."""
        while self._fences:
            epoch, fence = next(iter(self._fences.items()))
            if not fence.query():
                break
            del self._fences[epoch]


class UnifiedPool:
    """``num_pages`` pages of ``page_size`` tokens for every layer (plus the scratch page); see
    the module docstring."""

    def __init__(self, *, num_pages: int, page_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"pool needs num_pages >= 1 and page_size >= 1; got {num_pages}, {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self.page_elems = num_layers * 2 * page_size * num_kv_heads * head_dim
        # every adapter matrix's element offset is a multiple of this (pages start adapters, and
        # matrices sit at multiples of adapters.ALIGN inside them): the prefill LoRA's vector loads
        self.factor_align = math.gcd(self.page_elems, ALIGN)
        self.device = torch.device(device)
        self.scratch_page = num_pages  # outside the accounting: where padded decode rows write
        self.storage = torch.zeros((num_pages + 1) * self.page_elems, dtype=dtype, device=self.device)
        self.kv = self.storage.view(num_pages + 1, num_layers, 2, page_size, num_kv_heads, head_dim)
        self._free = np.ones(num_pages, dtype=bool)
        self._kv_owner: dict[int, list[list[int]]] = {}  # KV page in use -> the page lists holding it
        self._cached: OrderedDict[int, None] = OrderedDict()  # registered pages with no owner, LRU first
        self._page_key: dict[int, PageKey] = {}  # registered page -> its key
        self._prefix: dict[PageKey, int] = {}  # key -> registered page
        self._adapter_pages = np.zeros(num_pages, dtype=bool)
        self._resident: dict[int, ResidentAdapter] = {}  # HostAdapter.key -> its run
        self._tick = 0
        self.num_layers = num_layers
        # an admission's page-in copy in this many slices of layers, one event each (1: one copy);
        # ``EngineTuning.page_in_wait`` "layer" sets it (``page_in_layers.page_in_groups``)
        self.page_in_groups = 1
        self._pending_copies: list[tuple[ResidentAdapter, int, int]] = []  # admissions' page-ins, not issued yet
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # pages let go on the compute stream -> what a page-in copy into them waits for (CUDA only)
        self._fences = FreedPageFences(num_pages, self._compute_fence) if self._copy_stream is not None else None
        if self._fences is not None:
            self._fences.freed(slice(None))  # the storage's zero fill
        self.page_ins = 0
        self.evictions = 0
        # page-ins ahead of admission (``page_in(prefetch=True)``): how many, how many a request
        # was admitted on (hits), how many were evicted before any was (wasted)
        self.prefetch_page_ins = 0
        self.prefetch_hits = 0
        self.prefetch_wasted = 0
        self.pages_moved = 0
        self.prefix_evictions = 0

    def _compute_fence(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _freed(self, pages) -> None:
        if self._fences is not None:
            self._fences.freed(pages)

    # ------------------------------------------------------------------ accounting

    @property
    def num_free(self) -> int:
        """Pages available to a new allocation: free ones plus cached prefix pages (dropped on demand)."""
        return np.count_nonzero(self._free) + len(self._cached)

    @property
    def kv_pages_used(self) -> int:
        """KV pages some page list holds (a shared page counts once)."""
        return len(self._kv_owner)

    @property
    def kv_pages_cached(self) -> int:
        """Registered prefix pages no page list holds (kept until their room is needed)."""
        return len(self._cached)

    @property
    def adapter_pages_used(self) -> int:
        return int(self._adapter_pages.sum())

    def pages_for_tokens(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def pages_for_adapter(self, adapter: HostAdapter) -> int:
        return -(-adapter.numel // self.page_elems)

    def check(self) -> None:
        """Internal invariant: every page is exactly one of free, KV, adapter."""
        kv = np.zeros(self.num_pages, dtype=bool)
        kv[list(self._kv_owner) + list(self._cached)] = True
        assert not set(self._kv_owner) & set(self._cached), "a cached page has owners"
        assert not (kv & self._adapter_pages).any(), "a page is both KV and adapter"
        assert ((kv | self._adapter_pages) == ~self._free).all(), "free map out of sync"
        runs = sum(r.num_pages for r in self._resident.values())
        assert runs == self.adapter_pages_used, "adapter runs out of sync"
        for page, owners in self._kv_owner.items():
            assert owners, "a KV page in use with no owner"
            for owner in owners:
                assert sum(p == page for p in owner) == 1, "KV page not exactly once in its owner's list"
        assert all(p in self._page_key for p in self._cached), "an unregistered page is cached"
        assert {self._prefix[k]: k for k in self._prefix} == self._page_key, "prefix index out of sync"

    # ------------------------------------------------------------------ KV pages

    def allocate_kv(self, pages: list[int], count: int) -> bool:
        """Append ``count`` free pages (lowest first) to ``pages``; False (nothing taken) when
        fewer are free."""
        if count <= 0:
            return True
        if self.num_free < count:
            return False
        while np.count_nonzero(self._free) < count:
            self._drop_cached()
        taken = np.flatnonzero(self._free)[:count].tolist()
        self._free[taken] = False
        for p in taken:
            self._kv_owner[p] = [pages]
        pages.extend(taken)
        return True

    def allocate_kv_rows(self, lists: Sequence[list[int]], counts: Sequence[int]) -> bool:
        """``allocate_kv(lists[i], counts[i])`` for every i in order, in one pass over the free
        map (a decode step's rows that each need a page), when enough pages are free without
        dropping cached prefix pages; otherwise False and nothing is taken (the caller goes row
        by row). The same pages as the calls one by one."""
        total = sum(counts)
        if total == 0:
            return True
        free = np.flatnonzero(self._free)
        if free.size < total:
            return False
        taken = free[:total].tolist()
        self._free[taken] = False
        i = 0
        for pages, n in zip(lists, counts):
            for p in taken[i:i + n]:
                self._kv_owner[p] = [pages]
            pages.extend(taken[i:i + n])
            i += n
        return True

    def free_kv(self, pages: list[int]) -> None:
        """Let go of every page of ``pages`` and empty the list: a page no other list holds is
        freed, or cached (most recently used) if it is registered under a prefix key. Pages are
        let go last first, so a sequence's leading pages are cached as the more recently used
        and dropped after its tail (a dropped page makes every page after it unreachable)."""
        if pages:  # (a shared page too: this owner's kernels may still read it)
            self._freed(pages)
        for p in reversed(pages):
            owners = [o for o in self._kv_owner[p] if o is not pages]
            if owners:
                self._kv_owner[p] = owners
                continue
            del self._kv_owner[p]
            if p in self._page_key:
                self._cached[p] = None
            else:
                self._free[p] = True
        pages.clear()

    # ------------------------------------------------------------------ prefix cache

    def match_prefix(self, keys: Sequence[PageKey]) -> list[int]:
        """Registered pages of the longest run of ``keys`` from the first (in use or cached)."""
        found: list[int] = []
        for key in keys:
            page = self._prefix.get(key)
            if page is None:
                break
            found.append(page)
        return found

    def share(self, pages: list[int], shared: Sequence[int]) -> None:
        """Append registered pages (from ``match_prefix``) to ``pages``, which becomes one more
        owner of each; a cached one leaves the LRU."""
        for p in shared:
            if p in self._cached:
                del self._cached[p]
                self._kv_owner[p] = [pages]
            else:
                self._kv_owner[p].append(pages)
            pages.append(p)

    def register(self, page: int, key: PageKey) -> None:
        """Record that KV page ``page`` (in use, full, computed) holds the tokens of ``key``; a
        no-op if another page already holds that key or this one is registered."""
        if key in self._prefix or page in self._page_key:
            return
        assert page in self._kv_owner, "registering a page no list holds"
        self._prefix[key] = page
        self._page_key[page] = key

    def forget_prefixes(self, pages: Sequence[int]) -> None:
        """Unregister ``pages`` from the prefix cache (their KV must not be reused, e.g. a
        request's whose logits turned NaN): no later request matches them; whoever holds one
        keeps it, and it is freed rather than cached when let go."""
        for p in pages:
            key = self._page_key.pop(p, None)
            if key is not None:
                del self._prefix[key]
                if p in self._cached:  # not held (cannot happen for a running request's pages)
                    del self._cached[p]
                    self._free[p] = True

    def drop_cached_prefixes(self) -> int:
        """Free every cached prefix page (no owner); pages in use stay registered. Returns how
        many were freed."""
        n = len(self._cached)
        for _ in range(n):
            self._drop_cached()
        return n

    def _drop_cached(self) -> None:
        """Free the least recently used cached page."""
        page, _ = self._cached.popitem(last=False)
        del self._prefix[self._page_key.pop(page)]
        self._free[page] = True
        self.prefix_evictions += 1

    # ------------------------------------------------------------------ adapters

    def resident(self, adapter: HostAdapter) -> ResidentAdapter | None:
        return self._resident.get(adapter.key)

    def resident_adapters(self) -> list[ResidentAdapter]:
        return list(self._resident.values())

    def acquire(self, adapter: HostAdapter) -> ResidentAdapter:
        """Mark a resident adapter used by one more running request."""
        r = self._resident[adapter.key]
        r.users += 1
        if r.prefetched:
            r.prefetched = False
            self.prefetch_hits += 1
        self.touch(r)
        return r

    def release(self, adapter: HostAdapter) -> None:
        r = self._resident[adapter.key]
        assert r.users > 0, "release without acquire"
        r.users -= 1

    def touch(self, r: ResidentAdapter) -> None:
        self._tick += 1
        r.last_used = self._tick

    def page_in(self, adapter: HostAdapter, *, may_evict: bool = True, protect: Iterable[int] = (),
                prefetch: bool = False, may_move: bool = True) -> ResidentAdapter | None:
        """Make ``adapter`` resident (a no-op if it is). Uses free pages, moving KV pages to
        open a contiguous run if needed (and ``may_move``), and, if ``may_evict``, evicts idle
        adapters (not in ``protect``, a set of adapter keys) least recently used first. None if
        it cannot fit now. ``prefetch``: paged in ahead of any request's admission (counted in
        ``prefetch_*``)."""
        r = self._resident.get(adapter.key)
        if r is not None:
            self.touch(r)
            return r
        n = self.pages_for_adapter(adapter)
        if n > self.num_pages:
            return None
        protect = set(protect)
        while True:
            start = self._find_run(n)
            if start is None and may_move and int(self._free.sum()) >= n:
                start = self._open_run(n)
            if start is not None:
                break
            if may_evict and self._cached:  # cached prefix pages go before any adapter
                self._drop_cached()
                continue
            if not (may_evict and self.evict_lru_idle(protect)):
                return None
        self._free[start:start + n] = False
        self._adapter_pages[start:start + n] = True
        r = ResidentAdapter(adapter, start, n, start * self.page_elems)
        self._copy_in(r, start, n, sliced=not prefetch)
        self._resident[adapter.key] = r
        self.touch(r)
        self.page_ins += 1
        if prefetch:
            r.prefetched = True
            self.prefetch_page_ins += 1
        return r

    def _copy_in(self, r: ResidentAdapter, start: int, n: int, sliced: bool = False) -> None:
        """Copy ``r``'s adapter into its pages ``start .. start + n - 1``: on CUDA on the copy
        stream, with an event after it (``r.ready``); ``sliced`` (a page-in for an admission,
        with ``page_in_groups`` > 1): left pending for ``flush_copies``, which copies every
        pending adapter in slices of layers; else (CPU) synchronously."""
        adapter = r.adapter
        dst = self.storage[r.offset:r.offset + adapter.numel]
        if self._copy_stream is None:
            dst.copy_(adapter.flat)
            return
        if sliced and self.page_in_groups > 1:
            self._pending_copies.append((r, start, n))
            return
        self._wait_fence(start, n)
        with torch.cuda.stream(self._copy_stream):
            dst.copy_(adapter.flat, non_blocking=True)
            r.ready = torch.cuda.Event()
            r.ready.record()

    def _wait_fence(self, start: int, n: int) -> None:
        # queued kernels of the pages' previous owners may still read them: wait for those
        # (only: a step launched since they were let go runs beside the copy)
        fence = self._fences.pending(start, n)
        if fence is not None:
            self._copy_stream.wait_event(fence)

    def flush_copies(self) -> None:
        """Issue the pending page-in copies (``_copy_in(sliced=True)``) layer-major: wave g
        copies slice g (``layer_chunks``) of every pending adapter, then records one event; each
        adapter's ``layer_ready`` lists (its slice's first layer, that event), so layer 0 of all
        of them lands after the first wave, not after the whole copy of all but the last."""
        todo, self._pending_copies = self._pending_copies, []
        if not todo:
            return
        for _, start, n in todo:
            self._wait_fence(start, n)
        plans = [layer_chunks(r.adapter, self.num_layers, self.page_in_groups) for r, _, _ in todo]
        with torch.cuda.stream(self._copy_stream):
            for wave in copy_waves(plans):
                for i, (_first, a, b) in wave:
                    r = todo[i][0]
                    self.storage[r.offset + a:r.offset + b].copy_(r.adapter.flat[a:b], non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                for i, (first, _a, _b) in wave:
                    r = todo[i][0]
                    r.layer_ready = (r.layer_ready or []) + [(first, event)]
                    r.ready = event

    def order_after(self, event) -> None:
        """Order the current (compute) stream after ``event`` (a page-in copy's)."""
        torch.cuda.current_stream(self.device).wait_event(event)

    def wait_ready(self, residents: Iterable[ResidentAdapter]) -> None:
        """Order the current stream after the page-in copies of ``residents`` (pending ones
        issued first)."""
        self.flush_copies()
        for r in residents:
            if r.ready is not None:
                self.order_after(r.ready)
                r.ready, r.layer_ready = None, None

    def evict(self, adapter: HostAdapter) -> None:
        """Drop an idle adapter's pages (its host copy stays)."""
        r = self._resident.pop(adapter.key)
        assert r.users == 0, "evicting an adapter in use"
        self.prefetch_wasted += r.prefetched
        self.wait_ready([r])  # a pending page-in copy must land before the pages are reused
        self._freed(slice(r.first_page, r.first_page + r.num_pages))  # queued steps may still read it
        self._free[r.first_page:r.first_page + r.num_pages] = True
        self._adapter_pages[r.first_page:r.first_page + r.num_pages] = False
        self.evictions += 1

    def evict_lru_idle(self, protect: Iterable[int] = ()) -> bool:
        """Evict the least recently used adapter with no users (and not in ``protect``)."""
        protect = set(protect)
        idle = [r for r in self._resident.values() if r.users == 0 and r.adapter.key not in protect]
        if not idle:
            return False
        self.evict(min(idle, key=lambda r: r.last_used).adapter)
        return True

    # ------------------------------------------------------------------ runs of pages

    def _find_run(self, n: int) -> int | None:
        """Start of the highest run of ``n`` free pages, or None."""
        return highest_free_run(self._free, n)

    def free_map(self) -> np.ndarray:
        """A copy of the free-page map (True: free), for planning allocations without making them."""
        return self._free.copy()

    def _open_run(self, n: int) -> int | None:
        """Free a run of ``n`` pages by moving the KV pages (in use or cached) of the
        adapter-free window that holds the fewest of them to free pages outside it (needs
        ``n`` free pages)."""
        if n > self.num_pages:
            return None
        kv = (~self._free & ~self._adapter_pages).astype(np.int64)
        ad = self._adapter_pages.astype(np.int64)
        kv_in = np.convolve(kv, np.ones(n, dtype=np.int64), "valid")  # window starting at i
        ad_in = np.convolve(ad, np.ones(n, dtype=np.int64), "valid")
        cost = np.where(ad_in == 0, kv_in, np.iinfo(np.int64).max)
        start = int(len(cost) - 1 - np.argmin(cost[::-1]))  # cheapest, highest on ties
        if ad_in[start] != 0:
            return None
        src = [p for p in range(start, start + n) if not self._free[p]]
        outside = np.flatnonzero(self._free)
        outside = outside[(outside < start) | (outside >= start + n)][:len(src)]
        if outside.size < len(src):
            return None
        dst = outside.tolist()
        if src:
            self.kv[dst] = self.kv[src]
            self._freed(src)  # after the move that reads them
            for s, d in zip(src, dst):
                self._relocate(s, d)
            self._free[dst] = False
            self._free[src] = True
            self.pages_moved += len(src)
        return start

    def _relocate(self, src: int, dst: int) -> None:
        """Move the bookkeeping of KV page ``src`` to ``dst`` (contents already copied)."""
        if src in self._kv_owner:
            owners = self._kv_owner.pop(src)
            for owner in owners:
                owner[owner.index(src)] = dst
            self._kv_owner[dst] = owners
        else:  # cached: keep its place in the LRU
            self._cached = OrderedDict((dst if p == src else p, None) for p in self._cached)
        key = self._page_key.pop(src, None)
        if key is not None:
            self._page_key[dst] = key
            self._prefix[key] = dst


def highest_free_run(free: np.ndarray, n: int) -> int | None:
    """Start of the highest run of ``n`` True entries of ``free``, or None (where ``page_in``
    puts an adapter of ``n`` pages without moving or evicting anything)."""
    edges = np.diff(np.concatenate(([0], free.astype(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    fits = np.flatnonzero(ends - starts >= n)
    return None if fits.size == 0 else int(ends[fits[-1]] - n)
