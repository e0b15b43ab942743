"""Per-adapter fair admission (``EngineConfig.scheduling="fair"``): a virtual token counter per
tenant, after S-LoRA's VTC, decides which waiting request the scheduler admits next."""

from __future__ import annotations

import itertools
from collections import deque
from typing import Iterable

from .request import RequestState

# Service charged per token scheduled: a prompt token 1, a generated token 2 (VTC's weights: a
# decode row reads the whole model for one token, a prefill token shares that read).
PROMPT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0


def tenant_of(state: RequestState) -> str | None:
    """A request's tenant: the adapter name it asked for (None: the base model). A name, not
    the loaded weights: an in-place update keeps the tenant's counter."""
    return state.request.adapter


class FairShare:
    """Each tenant's service so far (weighted tokens scheduled) and its waiting requests in
    arrival order. ``next()`` is the first waiting request of the tenant with the least service
    (ties: the earliest arrival), so a tenant flooding the queue is served no more than any
    other tenant with requests waiting.

    A tenant that becomes active (its first request queued while it has none waiting or
    running) starts from no less than the least service of the tenants active then: idle time
    earns no credit, so a returning tenant cannot take over the engine either. Hence service of
    tenants with waiting requests stays within about one request's weighted tokens (prompt +
    2 x max_new_tokens) of each other, and a light tenant's request waits behind at most that
    much service to each other tenant, never behind a flood's whole backlog."""

    def __init__(self) -> None:
        self.service: dict[str | None, float] = {}
        self._queues: dict[str | None, deque[tuple[int, RequestState]]] = {}
        self._order = itertools.count()

    def queued(self, state: RequestState, running: Iterable[RequestState], *, front: bool = False) -> None:
        """``state`` joined the queue (``front``: a preempted request going back first)."""
        t = tenant_of(state)
        queue = self._queues.setdefault(t, deque())
        if not front and not queue:  # (a flood's later requests skip this scan of the running set)
            running_tenants = {tenant_of(s) for s in running}
            if t not in running_tenants:
                active = {u for u, q in self._queues.items() if q} | running_tenants
                active.discard(t)
                if active:
                    floor = min(self.service.get(u, 0.0) for u in active)
                    self.service[t] = max(self.service.get(t, 0.0), floor)
        if front:
            queue.appendleft((-next(self._order), state))
        else:
            queue.append((next(self._order), state))

    def next(self) -> RequestState | None:
        """The waiting request to admit next (None when nothing waits)."""
        best = None
        for t, queue in self._queues.items():
            if queue:
                key = (self.service.get(t, 0.0), queue[0][0])
                if best is None or key < best[0]:
                    best = (key, queue[0][1])
        return None if best is None else best[1]

    def heads(self) -> list[RequestState]:
        """Each waiting tenant's first request, in the order ``next()`` would take them if no
        counter moved (the adapters worth paging in ahead)."""
        keyed = sorted((self.service.get(t, 0.0), q[0][0], i) for i, (t, q) in enumerate(self._queues.items()) if q)
        queues = list(self._queues.values())
        return [queues[i][0][1] for _, _, i in keyed]

    def remove(self, state: RequestState) -> None:
        """``state`` left the queue (admitted, finished or aborted while waiting)."""
        t = tenant_of(state)
        queue = self._queues.get(t)
        if not queue:
            return
        if queue[0][1] is state:
            queue.popleft()
        else:
            for i, (_, s) in enumerate(queue):
                if s is state:
                    del queue[i]
                    break
        if not queue:  # only tenants with waiting requests are scanned by next()
            del self._queues[t]

    def charge_prefill(self, state: RequestState, tokens: int) -> None:
        """A prefill piece of ``tokens`` scheduled for ``state``."""
        t = tenant_of(state)
        self.service[t] = self.service.get(t, 0.0) + PROMPT_WEIGHT * tokens

    def charge_decode(self, decode: Iterable[RequestState]) -> None:
        """One generated token scheduled for each of ``decode``."""
        service = self.service
        for state in decode:
            t = tenant_of(state)
            service[t] = service.get(t, 0.0) + OUTPUT_WEIGHT
