"""Continuous batching: who runs this step (decodes first, then new prefills) under a token budget."""

from __future__ import annotations

from collections import deque
import operator
from dataclasses import dataclass, field

import numpy as np

from .fair_share import FairShare
from .pool import UnifiedPool, highest_free_run, prefix_page_keys
from .request import RequestState, Status


@dataclass
class StepPlan:
    """One iteration: ``prefill[i]`` feeds ``prefill_lens[i]`` tokens from its first uncached
    one (a chunk, or the rest of its tokens), ``decode`` requests feed their newest token;
    ``preempted`` lost their KV pages and wait again."""

    prefill: list[RequestState] = field(default_factory=list)
    prefill_lens: list[int] = field(default_factory=list)
    decode: list[RequestState] = field(default_factory=list)
    preempted: list[RequestState] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode

    @property
    def num_tokens(self) -> int:
        return sum(self.prefill_lens) + len(self.decode)

    def add_prefill(self, state: RequestState, tokens: int) -> None:
        self.prefill.append(state)
        self.prefill_lens.append(tokens)


class Scheduler:
    """FIFO admission into a running set; every running request decodes one token per step
    once its prefill is done.

    Token budget (``max_num_batched_tokens``, Sarathi-Serve's / vLLM's chunked prefill): each
    step first takes one token per decoding request, then, with ``chunked_prefill``, fills the
    rest with prefill chunks: requests whose prefill is under way (admission order), then
    newly admitted ones, each getting ``min(its uncached tokens, budget left)``. A running
    request with exactly one uncached token decodes it (the same computation as prefilling
    it). Without ``chunked_prefill`` a prompt is prefilled whole in the step that admits it
    and one longer than the budget runs in a step with no other prefill.

    Pages: a running request grows by one KV page every ``page_size`` tokens; when none is free,
    idle adapters are evicted first, then the most recently admitted request is preempted (its
    pages freed; it waits at the head of the queue and is prefilled again, prompt and generated
    tokens, when there is room). A waiting request is admitted when its adapter is (or can be
    paged) in and its prompt's pages fit above the watermark; otherwise it waits, and so do the
    requests behind it (no reordering, so no starvation).

    With ``prefix_caching``, an admitted request first takes the longest run of cached full
    pages with its adapter and leading tokens (never its last token's page: that token's logits
    are needed; never when it wants prompt logprobs) and is prefilled from there. Its own full
    pages are registered once computed: prompt pages after each prefill piece, pages filled by
    decoding before it grows, finishes or is preempted (so a next chat turn, a resent
    completion or its own re-admission reuses prompt and generated tokens alike).

    Prefill coalescing (``prefill_wait_steps`` k > 0): a step with prefill rows cannot replay a
    decode CUDA graph, so requests that arrive a step or two apart (clients over HTTP, answers
    that ended together and whose next requests come back one round trip later) would each turn
    a cheap decode step into an eager mixed one. While requests are decoding, new arrivals are
    held back for at most k steps (counted from the oldest of them), then admitted together.
    They go in at once when nothing is decoding, when a prefill runs this step anyway, when
    their prompts fill the step's token budget, when they are as many as the rows decoding
    (TGI's waiting-served ratio, at 1: held rows are missing from a batch that runs anyway) or
    when they would fill every free running slot. A preempted request never waits (it goes back
    at the head of the queue and is admitted as before).

    LongRoPE (``rope_switch``: the checkpoint's ``original_max_position_embeddings``): a
    request holding more tokens than the switch runs on the long factors. One admitted on the
    short factors that grows past the switch while decoding is recomputed, as HF's Phi-3 does
    at that token: its pages are given back (those before the switch stay cached, keyed as
    short) and it is prefilled again, prompt and generated tokens, on the long factors, before
    it decodes on (``rope_recomputes`` counts them).

    Prefetch: after a step's admissions (and once a step planned ahead is launched), the
    adapters of the queued requests next in line are paged in, into free pages only, so their
    copies run beside the step on the device and the step that admits them does not wait for
    them (``_prefetch``; ``pool.prefetch_hits`` / ``prefetch_misses`` here count how often that
    worked).

    ``scheduling="fair"`` changes which waiting request is admitted next: instead of the
    oldest, the oldest of the tenant (adapter) that has been served least (``FairShare``);
    preempted requests still go first, and admission still stops at the first request that
    does not fit (no skipping, so no starvation).
    """

    def __init__(self, pool: UnifiedPool, *, max_num_seqs: int, max_num_batched_tokens: int,
                 prefetch_depth: int, watermark_pages: int, prefix_caching: bool = False,
                 prefetch_ahead: bool = True,
                 chunked_prefill: bool = False, prefill_wait_steps: int = 0, scheduling: str = "fifo",
                 rope_switch: int | None = None) -> None:
        self.pool = pool
        # LongRoPE: a request holding more tokens than this runs on the long factors (runner.py),
        # so its cached keys differ from a shorter request's over the same tokens
        self.rope_switch = rope_switch
        self.rope_recomputes = 0  # requests re-prefilled on the long factors after growing past it
        self.fair = FairShare() if scheduling == "fair" else None
        self.prefill_wait_steps = prefill_wait_steps
        self.steps = 0  # schedule() calls: the clock of prefill_wait_steps
        self.held_steps = 0  # steps in which arrivals were held back to be prefilled together
        self.chunked_prefill = chunked_prefill
        self.prefill_chunks = 0  # prefill pieces that left part of their request's tokens for later
        self.prefix_caching = prefix_caching
        self.prefix_cache_hits = 0  # admissions that reused at least one cached page
        self.prefix_tokens_reused = 0
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefetch_depth = prefetch_depth
        # prefetch also every queued request the next step could admit (``_prefetch``)
        self.prefetch_ahead = prefetch_ahead
        self.prefetch_misses = 0  # admissions that paged their adapter in themselves (the step waits on it)
        self.watermark_pages = watermark_pages
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.num_preemptions = 0

    def add(self, state: RequestState) -> None:
        state.status = Status.WAITING
        state.queued_step = self.steps
        self.waiting.append(state)
        if self.fair is not None:
            self.fair.queued(state, self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        self.steps += 1
        plan = StepPlan()
        prefilling: list[RequestState] = []
        if self.rope_switch is not None:
            self._recompute_past_rope_switch(plan)
        if not self._grow_all(plan, prefilling):
            for state in list(self.running):
                if state.status is not Status.RUNNING:  # preempted earlier in this loop
                    continue
                if state.num_tokens - state.num_cached > 1:  # a chunked prefill under way (pages all taken)
                    prefilling.append(state)
                elif self._grow(state, plan):
                    plan.decode.append(state)
        budget = self.max_num_batched_tokens - len(plan.decode)
        for state in prefilling:  # budget >= max_num_seqs: each gets at least one token
            if state.status is Status.RUNNING and budget > 0:
                budget -= self._add_prefill(plan, state, budget)
        if self.waiting and self._hold_arrivals(plan.decode, bool(plan.prefill), budget, len(self.running),
                                                self.steps):
            self.held_steps += 1
        else:
            self._admit_waiting(plan, budget)
        if not self.prefetch_ahead:  # (else once the step is launched: ``prefetch``)
            self._prefetch()
        if self.fair is not None:  # (prefill pieces are charged as they are added)
            self.fair.charge_decode(plan.decode)
        return plan

    def _crosses_rope_switch(self, state: RequestState, tokens: int) -> bool:
        """Whether ``state``, once holding ``tokens`` tokens, runs past the LongRoPE switch with
        keys computed on the short factors."""
        return self.rope_switch is not None and state.rope_salt == b"short" and tokens > self.rope_switch

    def _recompute_past_rope_switch(self, plan: StepPlan) -> None:
        """Send the decoding requests that now hold more tokens than the LongRoPE switch, with
        their cache on the short factors, back to be prefilled again (on the long ones)."""
        for state in [st for st in self.running
                      if st.num_tokens - st.num_cached == 1 and self._crosses_rope_switch(st, st.num_tokens)]:
            self._preempt(state, count=False)
            plan.preempted.append(state)
            self.rope_recomputes += 1

    def _admit_waiting(self, plan: StepPlan, budget: int) -> None:
        """Admit queued requests into ``plan`` while slots, ``budget`` tokens and pages last."""
        while self.waiting and len(self.running) < self.max_num_seqs:
            state = self._next_waiting()
            if self.chunked_prefill:
                if budget <= 0:
                    break
            elif state.num_tokens > budget and (plan.prefill or plan.decode):
                break  # a prompt longer than the whole budget runs when the step is otherwise empty
            if not self._admit(state):
                break
            self._dequeue(state)
            budget -= self._add_prefill(plan, state, budget)

    def _next_waiting(self) -> RequestState:
        """The request to admit next: the queue's head (FIFO, or a preempted request), else the
        fair pick."""
        head = self.waiting[0]
        if self.fair is None or head.num_preemptions:
            return head
        return self.fair.next() or head

    def _dequeue(self, state: RequestState) -> None:
        if self.waiting[0] is state:
            self.waiting.popleft()
        else:
            self.waiting.remove(state)
        if self.fair is not None:
            self.fair.remove(state)

    def plan_ahead(self, decode: list[RequestState], *, admit: bool = False) -> StepPlan | None:
        """The step after the one whose sampled rows are ``decode`` (in its row order) is running
        on the device, planned before that step's tokens are known (the engine's overlapped
        decode): its rows that the running step's token does not bring to their length limit, in
        ``decode``'s order, each one token further; the rows ``schedule`` would run once those
        tokens are known (in its own order), short of a row whose request stops on one of them
        (that row's output is then discarded). The running step may be a decode-only step or one
        whose prefills all completed. With ``admit``, queued requests are admitted into it as
        ``schedule`` would admit them once the rows ending now are gone (a mixed step planned
        ahead, ``_admit_ahead``). None, with nothing changed, when it might not be: a running
        request is not in ``decode`` (a chunked prefill under way, a request admitted since), or
        one is missing (finished, aborted); a queued request could be admitted (a free running
        slot, counting the rows that end now) and ``admit`` is off or cannot tell what
        ``schedule`` would admit; no row goes on and nothing is admitted; or the rows' next KV
        pages are not all free without eviction or preemption. Prefetch is left to the caller
        (a page-in may move KV pages)."""
        running = self.running
        if len(running) != len(decode) or (not all(map(operator.is_, running, decode))
                                           and set(map(id, running)) != set(map(id, decode))):
            return None
        # the running step's token is the last of these rows' (length): they end when it is read
        going_on = [state for state in decode if len(state.output_ids) + 1 < state.max_output]
        if self.rope_switch is not None and any(self._crosses_rope_switch(st, st.num_tokens + 1)
                                                for st in going_on):
            return None  # one goes past the LongRoPE switch: schedule() re-prefills it
        size = self.pool.page_size
        growing: list[RequestState] = []
        counts: list[int] = []
        for state in going_on:
            # room for the running step's token, which this step feeds (num_tokens lacks it)
            need = -(-(state.num_tokens + 1) // size) - len(state.pages)
            if need > 0:
                growing.append(state)
                counts.append(need)
        admitted: list[tuple[RequestState, int]] | str = []  # (or "held": arrivals coalescing)
        if self.waiting and len(going_on) < self.max_num_seqs:
            if not admit:
                return None
            ended = len(going_on) < len(decode)
            admitted = self._admit_ahead(going_on, sum(counts), ended)
            if admitted is None:
                return None
        if not going_on and not admitted:
            return None
        if growing and not self.pool.allocate_kv_rows([st.pages for st in growing], counts):
            return None
        for state in growing:  # as in _grow_all: its full pages' KV is computed or being written
            self.register_computed_pages(state)
        self.steps += 1
        plan = StepPlan(decode=going_on)
        if self.fair is not None:
            self.fair.charge_decode(going_on)
        if admitted == "held":
            self.held_steps += 1
            return plan
        for state, _ in admitted:
            a = state.adapter
            missed = a is not None and self.pool.resident(a) is None
            if missed:  # into the free run planned: nothing evicted or moved
                r = self.pool.page_in(a, may_evict=False, may_move=False)
                assert r is not None, "a page-in planned ahead found no free run"
            ok = self._admit(state)
            assert ok, "an admission checked ahead failed"
            self.prefetch_misses += missed
            self._dequeue(state)
            self._add_prefill(plan, state, self.max_num_batched_tokens - plan.num_tokens)
        return plan

    def _admit_ahead(self, going_on: list[RequestState], growth: int, ended: bool):
        """The queued requests ``schedule`` would admit into the step after the running one, given
        that step's decode rows ``going_on``, which take ``growth`` new KV pages first: [(state,
        tokens)], "held" (the arrivals wait, prefill coalescing), or None where that is not
        certain before the running step's tokens are read. Certain: FIFO order (fair picks
        depend on charges made as they go); every admission's adapter resident, or (no prefix
        caching) going into a run of free pages ``page_in`` would take as it is (no eviction or
        KV page move: either could touch what the running step reads); its KV pages free above
        the watermark now, before the ending rows give theirs back (no eviction); with prefix
        caching, no row ending now (its pages are registered when it is read). The pages are
        planned on a copy of the free map, in ``schedule``'s order: growth (lowest free
        pages), then per admission its adapter (the highest run) and its KV pages (lowest)."""
        if self.fair is not None or (self.prefix_caching and ended):
            return None
        budget = self.max_num_batched_tokens - len(going_on)
        if self._hold_arrivals(going_on, False, budget, len(going_on), self.steps + 1):
            return "held"
        pool = self.pool
        free_map = None  # planned only when an adapter is to be paged in (runs matter then)
        free = pool.num_free - growth
        paged: set[int] = set()
        out: list[tuple[RequestState, int]] = []
        for state in self.waiting:
            if len(going_on) + len(out) >= self.max_num_seqs:
                break
            if self.chunked_prefill:
                if budget <= 0:
                    break
            elif state.num_tokens > budget and (out or going_on):
                break
            a = state.adapter
            if a is not None and pool.resident(a) is None and a.key not in paged:
                if self.prefix_caching or pool.kv_pages_cached:
                    return None
                if free_map is None:
                    free_map = pool.free_map()
                    free_map[np.flatnonzero(free_map)[:growth]] = False
                    for st, _ in out:  # (none paged in before: their KV pages, lowest first)
                        free_map[np.flatnonzero(free_map)[:pool.pages_for_tokens(st.num_tokens)]] = False
                n = pool.pages_for_adapter(a)
                start = highest_free_run(free_map, n)
                if start is None:
                    return None
                free_map[start:start + n] = False
                free -= n
                paged.add(a.key)
            pages = pool.pages_for_tokens(state.num_tokens)
            # (the watermark whether or not ``schedule`` would keep it: ``_admit`` keeps it here,
            # the ending rows still running)
            if free - pages < self.watermark_pages:
                return None
            free -= pages
            if free_map is not None:
                free_map[np.flatnonzero(free_map)[:pages]] = False
            n = state.num_tokens - state.num_cached
            if self.chunked_prefill:
                n = min(n, budget)
            out.append((state, n))
            budget -= n
        return out

    def prefetch(self) -> None:
        """``_prefetch`` once a step is launched: one planned by ``plan_ahead``, and with
        ``prefetch_ahead`` every step (its page-in copies then queue behind the step's own
        host-to-device copies instead of before them, and overlap its kernels)."""
        if self.waiting:
            self._prefetch()

    def _hold_arrivals(self, decode: list[RequestState], prefill: bool, budget: int, running: int,
                       step: int) -> bool:
        """Whether the queue waits this step, to be prefilled with later arrivals (see the class
        docstring's prefill coalescing): the step's ``decode`` rows, whether it has prefill rows,
        its token budget left, the count of running requests and the step's number (``steps``)."""
        k = self.prefill_wait_steps
        head = self.waiting[0]
        if k <= 0 or not decode or prefill or head.num_preemptions:
            return False
        if step - head.queued_step > k:  # it was held in k steps already
            return False
        # holding is worth it while the arrivals are fewer than the rows decoding without them
        # (each held step leaves them out of a batch that runs anyway)
        limit = min(self.max_num_seqs - running, len(decode))
        tokens = 0
        for i, state in enumerate(self.waiting):
            if i + 1 >= limit:
                return False
            tokens += state.num_tokens - state.num_cached
            if tokens >= budget:
                return False
        return True

    def _add_prefill(self, plan: StepPlan, state: RequestState, budget: int) -> int:
        """Schedule ``state``'s next prefill piece (all its uncached tokens, or with chunking at
        most ``budget``); -> tokens scheduled."""
        n = state.num_tokens - state.num_cached
        if self.chunked_prefill and n > budget:
            n = budget
            self.prefill_chunks += 1
        plan.add_prefill(state, n)
        if self.fair is not None:  # now, so the next pick of this same step already sees it
            self.fair.charge_prefill(state, n)
        return n

    def finish(self, state: RequestState) -> None:
        """Take a request out (finished or aborted), giving back its pages."""
        if state.status is Status.RUNNING:
            self._release(state)
            self.running.remove(state)
        elif state.status is Status.WAITING and state in self.waiting:
            self.waiting.remove(state)
            if self.fair is not None:
                self.fair.remove(state)
        state.status = Status.FINISHED

    # ------------------------------------------------------------------ internals

    def _grow_all(self, plan: StepPlan, prefilling: list[RequestState]) -> bool:
        """The decode rows' KV room in one pool allocation when enough pages are free (no
        eviction, no preemption: what ``_grow`` row by row would do then); fills
        ``plan.decode`` and ``prefilling``. False, with both left empty, when it cannot."""
        size = self.pool.page_size
        decode: list[RequestState] = []
        growing: list[list[int]] = []
        counts: list[int] = []
        for state in self.running:
            tokens = state.num_tokens
            if tokens - state.num_cached > 1:  # a chunked prefill under way (pages all taken)
                prefilling.append(state)
                continue
            decode.append(state)
            need = -(-tokens // size) - len(state.pages)
            if need > 0:  # as in _grow: its full pages are computed and cacheable now
                self.register_computed_pages(state)
                growing.append(state.pages)
                counts.append(need)
        if growing and not self.pool.allocate_kv_rows(growing, counts):
            prefilling.clear()
            return False
        plan.decode = decode
        return True

    def _grow(self, state: RequestState, plan: StepPlan) -> bool:
        """KV room for the token ``state`` feeds this step; False if ``state`` got preempted."""
        need = self.pool.pages_for_tokens(state.num_tokens) - len(state.pages)
        if need > 0:  # its pages are full, every token but the one it feeds now computed
            self.register_computed_pages(state)
        while need > 0 and not self.pool.allocate_kv(state.pages, need):
            if self.pool.evict_lru_idle():
                continue
            victim = self.running[-1]
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is state:
                return False
        return True

    def _admit(self, state: RequestState) -> bool:
        pool = self.pool
        protect = {state.adapter.key} if state.adapter is not None else set()
        missed = state.adapter is not None and pool.resident(state.adapter) is None
        if state.adapter is not None and pool.page_in(state.adapter, protect=protect) is None:
            return False
        reused: list[int] = []
        salt = self._rope_salt(state)
        if self.prefix_caching:
            ids = state.all_ids
            state.page_keys = prefix_page_keys(None if state.adapter is None else state.adapter.key, ids,
                                               pool.page_size, len(ids) // pool.page_size, salt=salt)
            if not state.wants_prompt_logprobs:
                reused = pool.match_prefix(state.page_keys[:(len(ids) - 1) // pool.page_size])
                pool.share(state.pages, reused)  # before allocating, so they cannot be dropped for it
        pages = pool.pages_for_tokens(state.num_tokens) - len(reused)
        reserve = self.watermark_pages if self.running else 0
        while pool.num_free - pages < reserve or not pool.allocate_kv(state.pages, pages):
            if not pool.evict_lru_idle(protect):
                pool.free_kv(state.pages)  # the shared pages go back to the cache
                return False
        if state.adapter is not None:
            state.resident = pool.acquire(state.adapter)
            self.prefetch_misses += missed
        state.status = Status.RUNNING
        state.num_cached = len(reused) * pool.page_size
        if reused:
            self.prefix_cache_hits += 1
            self.prefix_tokens_reused += state.num_cached
        self.running.append(state)
        return True

    def _rope_salt(self, state: RequestState) -> bytes:
        """The prefix-key salt of ``state`` from its admission on: b"" without LongRoPE, else
        which factors its prompt is computed with (by its length now, as the runner picks)."""
        if self.rope_switch is None:
            state.rope_salt = b""
        else:
            state.rope_salt = b"long" if state.num_tokens > self.rope_switch else b"short"
        return state.rope_salt

    def register_computed_pages(self, state: RequestState) -> None:
        """Make ``state``'s full pages whose keys and values are all written (tokens
        ``all_ids[:num_cached]``) reusable prefixes. Called after each prefill piece, and for
        pages filled while decoding when the request next needs a page, finishes or is
        preempted: its newest token's KV is written by the step that feeds it, so the page
        holding it is never registered before that step ran."""
        if not self.prefix_caching or not state.cacheable:
            return
        pool = self.pool
        full = state.num_cached // pool.page_size
        if self.rope_switch is not None and state.rope_salt == b"short":
            # admitted on the short factors: its tokens from position ``rope_switch`` on were
            # written with the long ones (it grew past the switch), so only the pages before
            # that hold short-factor keys throughout
            full = min(full, self.rope_switch // pool.page_size)
        if len(state.page_keys) < full:  # pages filled since admission: extend the key chain
            state.page_keys = prefix_page_keys(None if state.adapter is None else state.adapter.key,
                                               state.all_ids, pool.page_size, full, known=state.page_keys,
                                               salt=state.rope_salt)
        for page, key in zip(state.pages[:full], state.page_keys):
            pool.register(page, key)

    def _release(self, state: RequestState) -> None:
        self.register_computed_pages(state)  # kept cached: a later turn or a re-admission reuses them
        self.pool.free_kv(state.pages)
        if state.resident is not None:
            self.pool.release(state.adapter)
            state.resident = None

    def _preempt(self, state: RequestState, *, count: bool = True) -> None:
        """Free ``state``'s pages and queue it first, to be prefilled again (``count``: a
        preemption for pages, in ``num_preemptions``)."""
        self._release(state)
        self.running.remove(state)
        state.status = Status.WAITING
        state.num_cached = 0
        state.num_preemptions += 1
        self.num_preemptions += count
        self.waiting.appendleft(state)
        if self.fair is not None:
            self.fair.queued(state, self.running, front=True)

    def _prefetch(self) -> None:
        """Page in the adapters of the queued requests next in line, into free pages only (never
        evicting: no adapter a running or queued request uses is dropped for it): the first
        ``prefetch_depth`` and, with ``prefetch_ahead``, every one the next step could admit
        (at most ``max_num_seqs``, within its token budget over their prompts, at least one).
        With ``prefetch_ahead`` each also leaves room for the KV pages of the requests up to
        it, so it never takes the pages the next admissions need. Called once a step is
        launched (``prefetch``), so the copies run beside that step; without ``prefetch_ahead``
        after a step's admissions instead (and after a step planned ahead is launched)."""
        pool = self.pool
        upcoming = self.waiting if self.fair is None else self.fair.heads()  # fair: in the order it admits
        ahead = self.prefetch_ahead
        reserve = self.watermark_pages + len(self.running)
        tokens = 0
        for i, state in enumerate(upcoming):
            if i >= self.prefetch_depth and not (ahead and tokens < self.max_num_batched_tokens
                                                 and i < self.max_num_seqs):
                break
            tokens += state.num_tokens - state.num_cached
            if ahead:
                reserve += pool.pages_for_tokens(state.num_tokens)
            a = state.adapter
            if a is None or pool.resident(a) is not None:
                continue
            if pool.num_free - pool.pages_for_adapter(a) < reserve:
                break
            # ahead: issued behind a launched step, so no KV page is moved for it (the step
            # could not be followed by one planned ahead, and its tables would be rebuilt)
            if pool.page_in(a, may_evict=False, prefetch=True, may_move=not ahead) is None:
                break
