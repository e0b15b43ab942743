"""The engine in a process of its own: ``EngineClient`` offers the server ``Engine``'s interface while
a child process steps the engine, so HTTP work and the engine's host-side step never share a GIL."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import multiprocessing
import os
import threading
import time
from typing import Any, AsyncIterator, Callable, Iterable, Mapping

import torch

from ..specs import ConfigError, LoraLayout
from .adapters import AdapterInfo
from .engine_child import child_main
from .request import GenerationRequest, GenerationResult, TokenEvent

log = logging.getLogger(__name__)

RESTARTING = "the engine process failed and is being restarted; retry the request"


class EngineDeadError(RuntimeError):
    """The engine process is gone (it crashed, was killed or was closed): nothing more can run."""


def _put_each(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class EngineClient:
    """``Engine``'s serving interface (``stream``, ``generate``, ``abort``, ``stats``, the adapter
    registry, ``tokenizer``, ``model_config``, ``max_model_len``) with the engine stepping in a
    child process (spawned; ``build()``, a picklable callable such as ``functools.partial(
    Engine.from_pretrained, ...)``, makes it there).

    Why: in one process the HTTP layer (JSON, server-sent events, one asyncio generator per
    token) and the engine's step take turns on one GIL; see docs/serving.md. The child sends
    each step's events as one message; a reader thread here hands them to each asyncio loop
    with one ``call_soon_threadsafe``.

    Same semantics as ``Engine``: a refused request (``UnknownAdapterError``, ``ConfigError``)
    raises from the stream's first ``anext`` (and from ``generate``); closing a stream early
    aborts its request. The adapter registry is mirrored here (every change goes through this
    client), so ``adapters()`` answers without a round trip; its ``resident`` flags are as of
    the last ``stats()``. If the engine process dies (a failed step, a kill), every stream in
    flight ends with an "abort" event, waiting calls and new requests raise
    ``EngineDeadError``, and ``alive`` turns False. With ``restart_on_crash`` (what ``serve``
    uses) the streams and calls in flight raise ``EngineDeadError`` instead, ``restarting`` is
    True while a new engine process is built (new requests raise ``EngineDeadError`` meanwhile)
    and the adapters added through this client are added to it again; after ``max_restarts``
    failed starts it stays dead. The child leaves when this process dies.
    """

    def __init__(self, build: Callable[[], Any], *, start_timeout_s: float | None = None,
                 restart_on_crash: bool = False, max_restarts: int = 5):
        self._build, self._start_timeout_s = build, start_timeout_s
        self._restart_on_crash, self._max_restarts = restart_on_crash, max_restarts
        self._restarts_left = max_restarts  # failed or crashed starts in a row still allowed
        self._reap_lock = threading.Lock()
        self._spawn()
        info = self._wait_ready(start_timeout_s)
        self.tokenizer = info["tokenizer"]
        self.model_config = info["model_config"]
        self.max_model_len = info["max_model_len"]
        self.eos_token_ids = info["eos_token_ids"]
        self.config = info["config"]
        self.device = torch.device(info["device"])
        self.dtype = info["dtype"]
        self._adapters: dict[str, AdapterInfo] = {a.name: a for a in info["adapters"]}
        self._resident: set[str] = {a.name for a in info["adapters"] if a.resident}
        self._lock = threading.Lock()  # streams, calls, adapters, dead/closed
        self._send_lock = threading.Lock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._dead: str | None = None  # why the engine process is gone
        self._closed = False
        self._restarting = False
        self.restarts = 0  # engine processes started again after a crash
        # how each adapter added through this client was added, replayed into a restarted process
        self._registrations: dict[str, tuple[str, tuple]] = {}
        self._reader = threading.Thread(target=self._read, args=(self._conn,), name="lorafusion-engine-reader",
                                        daemon=True)
        self._reader.start()

    def _spawn(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that holds CUDA or threads
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self._process = ctx.Process(target=child_main, args=(self._build, child_conn, os.getpid()),
                                    name="lorafusion-engine", daemon=True)
        self._process.start()
        child_conn.close()  # only the child holds its end: its exit is our EOF

    @classmethod
    def from_pretrained(cls, base_model: str, adapters: Mapping[str, str] | None = None, config: Any = None, *,
                        device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                        start_timeout_s: float | None = None) -> "EngineClient":
        """``Engine.from_pretrained`` with the same arguments, run in the engine process."""
        from .engine import Engine

        return cls(functools.partial(Engine.from_pretrained, base_model, adapters, config, device=device,
                                     dtype=dtype), start_timeout_s=start_timeout_s)

    def _wait_ready(self, timeout_s: float | None) -> dict[str, Any]:
        try:
            if not self._conn.poll(timeout_s):
                self._process.kill()
                raise EngineDeadError(f"the engine process was not ready after {timeout_s} s")
            message = self._conn.recv()
        except EOFError:
            self._process.join(5)
            raise EngineDeadError(f"the engine process died while building the engine (exit code "
                                  f"{self._process.exitcode})") from None
        if message[0] == "failed":
            self._process.join(5)
            error = message[1]
            error.add_note(f"(raised in the engine process)\n{message[2]}")
            raise error
        return message[1]

    # ------------------------------------------------------------------ state

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def exitcode(self) -> int | None:
        """The engine process's exit code (None while it runs)."""
        with self._reap_lock:
            return self._process.exitcode

    def _wait_exit(self, timeout_s: float) -> int | None:
        """Wait up to ``timeout_s`` for the engine process to end; its exit code (None: it runs).
        One thread at a time: of two threads reaping one child, one gets ECHILD and reads it as alive."""
        with self._reap_lock:
            self._process.join(timeout_s)
            return self._process.exitcode

    @property
    def alive(self) -> bool:
        """False once the engine process is gone (crashed, killed or closed), and while a
        crashed one is being restarted."""
        return self._dead is None and not self._restarting

    @property
    def restarting(self) -> bool:
        """True from a crash until the new engine process serves (``restart_on_crash``)."""
        return self._restarting

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            try:
                self._conn.send(message)
            except (OSError, ValueError) as e:  # closed pipe / connection
                raise EngineDeadError(f"the engine process is gone ({e})") from None

    def _call(self, name: str, *args: Any, internal: bool = False) -> Any:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            if self._restarting and not internal:
                raise EngineDeadError(RESTARTING)
            call_id = next(self._call_ids)
            self._calls[call_id] = future
        try:
            self._send(("call", call_id, name, args))
        except EngineDeadError:
            self._calls.pop(call_id, None)
            raise
        return future.result()

    # ------------------------------------------------------------------ the reader thread

    def _read(self, conn: Any) -> None:
        reason = "the engine process exited"
        try:
            while True:
                message = conn.recv()
                kind = message[0]
                if kind == "events":
                    self._dispatch(message[1])
                elif kind == "reply":
                    _, call_id, ok, value = message
                    future = self._calls.pop(call_id, None)
                    if future is not None:
                        future.set_result(value) if ok else future.set_exception(value)
                elif kind == "refused":
                    entry = self._streams.pop(message[1], None)
                    if entry is not None:
                        self._deliver({entry[0]: [(entry[1], message[2])]})
                elif kind == "crashed":
                    reason = f"the engine process crashed:\n{message[1]}"
        except (EOFError, OSError):
            pass
        self._gone(reason)

    def _dispatch(self, batch: list[tuple]) -> None:
        """One step's events: to their streams' queues, one wake-up per asyncio loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        streams = self._streams
        for fields in batch:
            entry = streams.get(fields[0])
            if entry is None:  # closed early (aborted) or not streamed
                continue
            if fields[5] is not None:
                streams.pop(fields[0], None)
            loop, queue = entry
            items = by_loop.get(loop)
            if items is None:
                items = by_loop[loop] = []
            items.append((queue, TokenEvent(*fields)))
        self._deliver(by_loop)

    @staticmethod
    def _deliver(by_loop: dict[asyncio.AbstractEventLoop, list]) -> None:
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_each, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _gone(self, reason: str) -> None:
        code = self._wait_exit(5)
        if code not in (None, 0):
            reason += f" (exit code {code})"
        with self._lock:
            if self._closed:
                reason = "the engine was closed"
            restart = self._restart_on_crash and not self._closed and self._restarts_left > 0
            self._dead = reason
            self._restarting = restart
            streams, self._streams = self._streams, {}
            calls, self._calls = self._calls, {}
        if not self._closed:
            log.error("%s; %s %d streams and %d calls", reason, "failing" if restart else "aborting", len(streams),
                      len(calls))
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for rid, (loop, queue) in streams.items():
            # restarting: the stream raises (the server answers 503, retry); else it ends with "abort"
            item = EngineDeadError(f"{RESTARTING} ({reason.splitlines()[0]})") if restart else \
                TokenEvent(rid, None, "", None, None, "abort")
            by_loop.setdefault(loop, []).append((queue, item))
        self._deliver(by_loop)
        for future in calls.values():
            future.set_exception(EngineDeadError(f"{RESTARTING} ({reason.splitlines()[0]})" if restart else reason))
        if restart:
            threading.Thread(target=self._restart, name="lorafusion-engine-restart", daemon=True).start()

    def _restart(self) -> None:
        """Start a new engine process after a crash, add the adapters this client had added,
        then serve again (``restarting`` turns False). Gives up after ``max_restarts`` starts in
        a row that failed or died before serving."""
        while True:
            with self._lock:
                if self._closed:
                    return
                self._restarts_left -= 1
            try:
                self._conn.close()
                self._spawn()
                self._wait_ready(self._start_timeout_s)
            except Exception as e:  # noqa: BLE001 - logged; tried again while restarts are left
                log.error("the engine process could not be restarted: %s", str(e).splitlines()[0] if str(e) else e)
                with self._lock:
                    if self._restarts_left <= 0 or self._closed:
                        self._restarting = False
                        self._dead = f"the engine process crashed and could not be restarted: {e}"
                        return
                time.sleep(1.0)
                continue
            break
        with self._lock:
            if self._closed:  # closed while it started: close() waited for the old process only
                self._process.kill()
                self._restarting = False
                return
            self._dead = None
            self._resident = set()
            registrations = list(self._registrations.items())
        self._reader = threading.Thread(target=self._read, args=(self._conn,), name="lorafusion-engine-reader",
                                        daemon=True)
        self._reader.start()
        for name, (call, args) in registrations:
            try:
                self._call(call, *args, internal=True)
            except EngineDeadError:  # the new process died too: the restart that follows adds them
                return
            except Exception as e:  # noqa: BLE001 - e.g. its files were removed meanwhile
                log.error("adapter %r could not be added to the restarted engine: %s", name, e)
                with self._lock:
                    self._adapters.pop(name, None)
                    self._registrations.pop(name, None)
        with self._lock:
            self.restarts += 1
            self._restarts_left = self._max_restarts  # it serves: the count of starts in a row begins again
            self._restarting = False
        log.warning("the engine process was restarted (restart %d); %d adapters added again", self.restarts,
                    len(registrations))

    # ------------------------------------------------------------------ requests

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Yield the request's events (one per token, the last with ``finish_reason``). Closing
        the iterator early aborts the request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        rid = request.request_id
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            if self._restarting:
                raise EngineDeadError(RESTARTING)
            if rid in self._streams:
                raise ConfigError(f"request id {rid!r} is already in use by an unfinished request")
            self._streams[rid] = (loop, queue)
        finished = False
        try:
            self._send(("submit", request))
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):  # refused by the engine: nothing to abort
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Run ``requests`` to completion (blocking); results in the order given."""
        if len({r.request_id for r in requests}) != len(requests):
            raise ConfigError("generate: request ids must be unique")
        return self._call("generate", list(requests))

    def abort(self, request_id: str) -> None:
        """Stop a request (no-op if it is done, or if the engine is gone)."""
        try:
            self._send(("abort", request_id))
        except EngineDeadError:
            pass

    def start(self) -> None:
        """Nothing to start: the engine process steps whenever it has work (``Engine.start``'s place)."""

    def stats(self) -> dict[str, Any]:
        stats, resident = self._call("stats")
        self._resident = set(resident)
        return stats

    def reset_prefix_cache(self) -> int:
        return self._call("reset_prefix_cache")

    def warm_up(self, **kwargs: Any) -> dict[str, Any]:
        """``Engine.warm_up`` in the child."""
        return self._call("warm_up", kwargs)

    # ------------------------------------------------------------------ adapters

    def adapters(self) -> list[AdapterInfo]:
        """Every adapter the engine serves (no round trip: see the class docstring)."""
        with self._lock:
            listed = list(self._adapters.values())
        return [dataclasses.replace(a, resident=a.name in self._resident) for a in listed]

    def _listed(self, infos: Iterable[AdapterInfo], how: dict[str, tuple[str, tuple]]) -> None:
        with self._lock:
            for info in infos:
                self._adapters[info.name] = info
            self._registrations.update(how)

    def add_adapter(self, name: str, path: str | os.PathLike) -> AdapterInfo:
        info = self._call("add_adapter", name, os.fspath(path))
        self._listed([info], {name: ("add_adapter", (name, os.fspath(path)))})
        return info

    def add_adapter_weights(self, name: str, factors: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
                            *, rank: int, alpha: float, layout: LoraLayout | None = None,
                            magnitudes: Mapping[tuple[int, str], torch.Tensor] | None = None) -> AdapterInfo:
        on_host = {k: (a.detach().cpu(), b.detach().cpu()) for k, (a, b) in factors.items()}
        mags = None if magnitudes is None else {k: m.detach().cpu() for k, m in magnitudes.items()}
        info = self._call("add_adapter_weights", name, on_host, rank, alpha, layout, mags)
        self._listed([info], {name: ("add_adapter_weights", (name, on_host, rank, alpha, layout, mags))})
        return info

    def add_adapters_from_checkpoint(self, ckpt_path: str, names: Iterable[str] | None = None, *,
                                     weights: str = "best") -> list[AdapterInfo]:
        infos = self._call("add_adapters_from_checkpoint", os.fspath(ckpt_path),
                           None if names is None else list(names), weights)
        self._listed(infos, {i.name: ("add_adapters_from_checkpoint", (os.fspath(ckpt_path), [i.name], weights))
                             for i in infos})
        return infos

    def update_adapter(self, name: str, weights: Any, *, alpha: float | None = None, add: bool = False) -> AdapterInfo:
        """``Engine.update_adapter`` in the engine process (a restarted process gets the newest weights)."""
        if isinstance(weights, (str, os.PathLike)):
            weights = os.fspath(weights)
        elif isinstance(weights, Mapping):
            weights = {k: (a.detach().cpu(), b.detach().cpu()) for k, (a, b) in weights.items()}
        info = self._call("update_adapter", name, weights, alpha, add)
        self._listed([info], {name: ("update_adapter", (name, weights, info.alpha, True))})
        return info

    def remove_adapter(self, name: str) -> None:
        try:
            self._call("remove_adapter", name)
        finally:  # gone there (or never there): gone here
            with self._lock:
                self._adapters.pop(name, None)
                self._registrations.pop(name, None)

    # ------------------------------------------------------------------ shutdown

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the engine process: what still runs is aborted (its streams end with "abort"),
        then the process exits; killed if it has not after ``timeout_s``. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._send(("close",))
        except EngineDeadError:
            pass
        if self._restarting:  # a new engine process is being built: nothing of it is worth waiting for
            self._process.kill()
        if self._wait_exit(timeout_s) is None:
            log.warning("the engine process did not exit within %.0f s; killing it", timeout_s)
            self._process.kill()
            self._wait_exit(5)
        self._reader.join(10)
        self._conn.close()

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
