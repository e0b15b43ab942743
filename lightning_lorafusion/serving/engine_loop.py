"""The engine's background loop thread, and the per-asyncio-loop sinks that hand ``stream`` its events."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import AsyncIterator

from .request import GenerationRequest, TokenEvent

log = logging.getLogger("lightning_lorafusion.serving")


class _LoopSink:
    """Events bound for one asyncio loop, handed over once per engine step (one
    ``call_soon_threadsafe`` wake-up for all of a step's rows instead of one per token: under
    load the loop thread otherwise spends its time, and the GIL, on wake-ups)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.pending: list[tuple[asyncio.Queue, TokenEvent]] = []

    def push(self, queue: asyncio.Queue, event: TokenEvent) -> None:
        self.pending.append((queue, event))

    def flush(self) -> None:
        batch, self.pending = self.pending, []
        if batch:
            try:
                self.loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass


def _deliver(batch: list[tuple[asyncio.Queue, TokenEvent]]) -> None:
    for queue, event in batch:
        queue.put_nowait(event)


class EngineLoop:
    """``Engine``'s background thread: ``start`` / ``close`` it, ``stream`` through it. The
    state it reads (locks, queues, sinks) is set up by ``Engine.__init__``."""

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Yield the request's events as the background loop produces them (one per token, the
        last with ``finish_reason``). Closing the iterator early aborts the request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        with self._lock:
            sink = self._sinks.get(loop)
            if sink is None:
                sink = self._sinks[loop] = _LoopSink(loop)
        rid = self.submit(request, lambda ev: sink.push(queue, ev))
        self.start()
        finished = False
        try:
            while not finished:
                event = await queue.get()
                finished = event.finish_reason is not None
                yield event
        finally:
            if not finished:
                self.abort(rid)

    def start(self) -> None:
        """Start the background loop thread (idempotent); ``stream`` calls it."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="lorafusion-engine", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the background loop (unfinished requests stay queued)."""
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        self._thread = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def has_work(self) -> bool:
        """Whether ``step()`` has anything left to do: requests waiting, running or being aborted,
        adapters being retired, or a launched step whose tokens were not read yet."""
        return self._has_work()

    def _has_work(self) -> bool:
        return bool(self._incoming or self._aborts or self._retired or self._inflight is not None
                    or self.scheduler.has_work())

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._has_work():
                    self._wake.wait()
                if self._stopping:
                    return
            try:
                if not self.step() and not self.scheduler.running:
                    time.sleep(0.001)  # nothing could run (e.g. waiting for a removal): do not spin
            except Exception:  # a bug must not leave callers waiting forever
                log.exception("engine step failed; aborting every unfinished request")
                with self._step_lock:
                    self._inflight = None
                    for state in list(self._states.values()):
                        self._finish(state, "abort", [])
                    self._flush_sinks()

    def _flush_sinks(self) -> None:
        """Hand this step's events to the asyncio loops streaming them (caller holds ``_step_lock``)."""
        with self._lock:
            sinks = list(self._sinks.values())
        for sink in sinks:
            sink.flush()
