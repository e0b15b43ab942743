"""The engine process's side of ``EngineClient``: build the engine, step it, and answer the
parent's commands between steps (the pipe's messages are described on ``EngineLoop``)."""

from __future__ import annotations

import collections
import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable

from .request import GenerationRequest, GenerationResult, TokenEvent

log = logging.getLogger(__name__)

# An idle child waits this long for a command before it checks that its parent still lives (it
# also leaves on the pipe's EOF, which a dead parent's closed end gives at once).
IDLE_POLL_S = 0.5
BUSY_PARENT_CHECK_S = 1.0
# Running requests that made no progress in a step (e.g. waiting for pages): wait a little, do not spin.
STALL_POLL_S = 0.001
# Calls the child answers between two steps (cheap) and those a worker thread of the child runs
# (disk reads, or blocking until requests finish) while the step loop goes on.
INLINE_CALLS = frozenset({"stats", "adapters", "remove_adapter", "reset_prefix_cache"})
WORKER_CALLS = frozenset({"add_adapter", "add_adapter_weights", "add_adapters_from_checkpoint", "generate",
                          "update_adapter", "warm_up"})


def portable_exception(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling unchanged in type, else a RuntimeError with its type and message."""
    try:
        if type(pickle.loads(pickle.dumps(exc))) is type(exc):
            return exc
    except Exception:  # an exception whose constructor does not take its args back
        pass
    return RuntimeError(f"{type(exc).__name__}: {exc}")


class EngineLoop:
    """The engine process's main loop. Streamed requests' events leave as one message per step:
    ``("events", [(request_id, token_id, text, logprob, top_logprobs, finish_reason, adapter_version), ...])``
    (TokenEvent's fields in order; the text is detokenized here).

    A receiver thread drains the pipe at all times, so the parent's sends never wait for a step
    to end (a long prompt's request is larger than the socket's buffer; the parent sends from
    its event loop). It submits requests itself (``Engine.submit`` is thread-safe; the request
    arrives, and is stamped, while a step runs, as with an in-process engine) unless other
    commands are queued before it: commands take effect in the order they were sent. Everything
    else waits for the main loop, between steps."""

    def __init__(self, engine: Any, conn: Any, parent_pid: int):
        self.engine, self.conn, self.parent_pid = engine, conn, parent_pid
        self.live: set[str] = set()  # streamed requests not finished yet
        self.generating: set[str] = set()  # requests of generate calls in flight
        self.pending: list[tuple] = []  # events not sent yet
        self.lock = threading.Lock()  # pending and generating (worker threads step too, in generate)
        self.send_lock = threading.Lock()
        self.kick = False  # step once even with nothing streaming (an abort, a removed adapter)
        self.commands: collections.deque[tuple] = collections.deque()  # received, for the main loop
        self.order = threading.Lock()  # a command being taken effect: the receiver's submits wait
        self.wake = threading.Event()  # set when something arrived

    def send(self, message: tuple) -> None:
        with self.send_lock:
            self.conn.send(message)

    def on_event(self, event: TokenEvent) -> None:
        """The engine's callback for streamed requests (on whichever thread steps)."""
        with self.lock:
            self.pending.append((event.request_id, event.token_id, event.text, event.logprob, event.top_logprobs,
                                 event.finish_reason, event.adapter_version))
        if event.finish_reason is not None:
            self.live.discard(event.request_id)

    def flush(self) -> None:
        with self.lock:
            batch, self.pending = self.pending, []
        if batch:
            self.send(("events", batch))

    def receive(self) -> None:
        """The receiver thread: every message off the pipe at once; ends at EOF (queued as ``eof``)."""
        try:
            while True:
                message = self.conn.recv()
                with self.order:
                    if message[0] == "submit" and not self.commands:
                        self.submit(message[1])
                    else:
                        self.commands.append(message)
                self.wake.set()
        except (EOFError, OSError):
            self.commands.append(("eof",))
            self.wake.set()

    def run(self) -> None:
        """Step while requests stream; between steps take every waiting command. Returns on
        ``close`` or when the parent is gone (pipe EOF, or it is no longer this process's parent)."""
        threading.Thread(target=self.receive, name="lorafusion-engine-receiver", daemon=True).start()
        checked, stalled = time.monotonic(), False
        while True:
            busy = bool(self.live)
            if not busy or stalled:
                self.wake.wait(STALL_POLL_S if busy else IDLE_POLL_S)
            self.wake.clear()
            if self.commands and not self.take_commands():
                return
            now = time.monotonic()
            if not busy or now - checked > BUSY_PARENT_CHECK_S:
                if os.getppid() != self.parent_pid:
                    return
                checked = now
            if self.live or self.kick:
                self.kick = False
                stalled = not self.engine.step()
            self.flush()

    def take_commands(self) -> bool:
        """Every queued command, in order; False on ``close`` or EOF."""
        while self.commands:
            with self.order:
                message = self.commands.popleft()
                if message[0] == "eof" or not self.handle(message):
                    return False
        return True

    def submit(self, request: GenerationRequest) -> None:
        self.live.add(request.request_id)
        try:
            self.engine.submit(request, self.on_event)
        except Exception as e:  # validation: the parent's stream raises it
            self.live.discard(request.request_id)
            self.send(("refused", request.request_id, portable_exception(e)))

    def handle(self, message: tuple) -> bool:
        kind = message[0]
        if kind == "submit":
            self.submit(message[1])
        elif kind == "abort":
            self.engine.abort(message[1])
            self.kick = True
        elif kind == "call":
            _, call_id, name, args = message
            if name in WORKER_CALLS:  # a daemon thread: one stuck call must not hold the process's exit up
                threading.Thread(target=self.answer, args=(call_id, name, args), name=f"lorafusion-{name}",
                                 daemon=True).start()
            elif name in INLINE_CALLS:
                self.answer(call_id, name, args)
            else:
                self.send(("reply", call_id, False, RuntimeError(f"the engine process has no call {name!r}")))
            self.kick = True
        elif kind == "close":
            self.shutdown()
            return False
        return True

    def answer(self, call_id: int, name: str, args: tuple) -> None:
        try:
            if name == "stats":  # with the adapters resident now: EngineClient.adapters() reports them
                value = (self.engine.stats(), [a.name for a in self.engine.adapters() if a.resident])
            elif name == "generate":
                value = self.generate(*args)
            elif name == "warm_up":
                value = self.engine.warm_up(**args[0])
            elif name == "update_adapter":  # (name, weights, alpha, add)
                value = self.engine.update_adapter(args[0], args[1], alpha=args[2], add=args[3])
            elif name == "add_adapter_weights":  # rank, alpha, layout and magnitudes are keyword-only there
                adapter, factors, rank, alpha, layout, magnitudes = args
                value = self.engine.add_adapter_weights(adapter, factors, rank=rank, alpha=alpha, layout=layout,
                                                        magnitudes=magnitudes)
            else:
                value = getattr(self.engine, name)(*args)
            reply = ("reply", call_id, True, value)
        except Exception as e:
            reply = ("reply", call_id, False, portable_exception(e))
        try:
            self.send(reply)
        except (OSError, EOFError):
            pass  # the parent is gone; the main loop notices

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """``Engine.generate`` on a worker thread: with no engine thread it steps itself, beside
        the main loop (steps are serialised by the engine); events of streamed requests reach
        ``on_event`` whoever steps."""
        ids = {r.request_id for r in requests}
        with self.lock:
            self.generating |= ids
        try:
            return self.engine.generate(requests)
        finally:
            with self.lock:
                self.generating -= ids

    def shutdown(self) -> None:
        """``close``: abort whatever still runs and send the abort events."""
        with self.lock:
            running = list(self.live) + list(self.generating)
        for rid in running:
            self.engine.abort(rid)
        for _ in range(1000):  # an abort ends at the next step; generate calls return then
            self.engine.step()
            self.flush()
            with self.lock:
                if not self.live and not self.generating:
                    break
            time.sleep(0.001)


def _engine_info(engine: Any) -> dict[str, Any]:
    return {"tokenizer": engine.tokenizer, "model_config": engine.model_config,
            "max_model_len": engine.max_model_len, "eos_token_ids": engine.eos_token_ids, "config": engine.config,
            "device": str(engine.device), "dtype": engine.dtype, "adapters": engine.adapters()}


def child_main(build: Callable[[], Any], conn: Any, parent_pid: int) -> None:
    """The engine process: build the engine, report ready (or why not), step it until told to
    stop or the parent is gone. The loop runs on a thread of its own, as ``Engine.start`` steps
    the engine in-process: torch keeps some state per thread (on a busy 2-core host, steps on
    the thread that built the engine were ~10x slower, OpenMP's intra-op threads)."""
    # Ctrl-C reaches the whole process group; the parent decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_code = [0]
    try:
        engine = build()
    except BaseException as e:
        exit_code[0] = 1
        try:
            conn.send(("failed", portable_exception(e), traceback.format_exc()))
        except (OSError, EOFError):
            pass
    else:
        thread = threading.Thread(target=_serve, args=(EngineLoop(engine, conn, parent_pid), exit_code),
                                  name="lorafusion-engine")
        thread.start()
        thread.join()
    conn.close()
    sys.exit(exit_code[0])  # multiprocessing's exit: its finalizers run (e.g. tqdm's semaphore is released)


def _serve(loop: EngineLoop, exit_code: list[int]) -> None:
    try:
        loop.send(("ready", _engine_info(loop.engine)))
        loop.run()
    except (OSError, EOFError):
        pass  # the parent is gone
    except BaseException:
        exit_code[0] = 1
        log.exception("the engine process failed; every unfinished request is aborted")
        try:
            loop.send(("crashed", traceback.format_exc()))
        except (OSError, EOFError):
            pass
