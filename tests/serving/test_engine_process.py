"""EngineClient (the engine in a child process) against the same engine in this process: equal
outputs, the same exceptions, a mirrored adapter registry, aborts that free pages; a crash in the
child fails pending requests instead of hanging, close() ends streams, and the child exits with
its parent. (The HTTP tests over an EngineClient are in test_server.py.)"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from lightning_lorafusion.serving import Engine, EngineConfig, GenerationRequest, SamplingParams, UnknownAdapterError
from lightning_lorafusion.serving.engine_process import EngineClient, EngineDeadError
from lightning_lorafusion.specs import ConfigError

REPO = Path(__file__).resolve().parents[2]
CONFIG = EngineConfig(num_pages=160, page_size=8, max_num_seqs=16, max_num_batched_tokens=512, backend="torch")


def _build(model_dir, adapters=None):
    return functools.partial(Engine.from_pretrained, str(model_dir), adapters, CONFIG, device="cpu",
                             dtype=torch.float32)


def _engine_failing_after_first_tokens(model_dir) -> Engine:
    """An engine whose steps raise once one step has emitted events (built in the child:
    module-level, so it pickles)."""
    engine = _build(model_dir)()
    real_step, emitted = engine.step, []

    def step():
        if emitted:
            raise RuntimeError("injected step failure")
        events = real_step()
        emitted.extend(events)
        return events

    engine.step = step
    return engine


def _request(prompt, adapter=None, rid=None, **sampling) -> GenerationRequest:
    kw = {} if rid is None else {"request_id": rid}
    return GenerationRequest(prompt_token_ids=tuple(prompt), adapter=adapter,
                             sampling=SamplingParams(**{"max_new_tokens": 6, "temperature": 0.0, **sampling}), **kw)


async def _collect(client, request) -> list:
    return [event async for event in client.stream(request)]


def _wait_for(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def engines(model_dir, adapter_dirs):
    """The same engine in this process and in a child process (adapters all4 and attn2)."""
    start = {name: adapter_dirs[name] for name in ("all4", "attn2")}
    local = _build(model_dir, start)()
    remote = EngineClient(_build(model_dir, start))
    yield local, remote
    remote.close()
    local.close()


def test_outputs_equal_the_in_process_engine(engines):
    local, remote = engines
    assert remote.max_model_len == local.max_model_len and remote.model_config == local.model_config
    assert remote.eos_token_ids == local.eos_token_ids
    assert remote.tokenizer.decode([5, 6, 7]) == local.tokenizer.decode([5, 6, 7])
    requests = [_request([5, 9, 17, 30], None, "a", logprobs=2), _request([7, 8], "all4", "b", prompt_logprobs=1),
                _request([11, 12, 13], "attn2", "c", temperature=1.0, seed=5, max_new_tokens=8),
                _request([40, 41, 42, 43, 44], "all4", "d", stop_token_ids=(9,), max_new_tokens=10)]
    ours, theirs = local.generate(requests), remote.generate(requests)
    for a, b in zip(ours, theirs):
        assert (b.request_id, b.token_ids, b.text, b.finish_reason) == (a.request_id, a.token_ids, a.text,
                                                                        a.finish_reason)
        assert (a.logprobs is None) == (b.logprobs is None) and (a.prompt_logprobs is None) == (b.prompt_logprobs
                                                                                                is None)
        if a.logprobs is not None:
            assert b.logprobs == pytest.approx(a.logprobs, abs=1e-6)
            assert [t.keys() for t in b.top_logprobs] == [t.keys() for t in a.top_logprobs]
        if a.prompt_logprobs is not None:
            assert b.prompt_logprobs[0] is None and b.prompt_logprobs[1:] == pytest.approx(a.prompt_logprobs[1:],
                                                                                          abs=1e-6)
    assert ours[1].prompt_logprobs is not None and ours[0].logprobs is not None  # both were compared

    async def streamed():  # concurrently, as the server streams them
        return await asyncio.gather(*(_collect(remote, GenerationRequest(
            prompt_token_ids=r.prompt_token_ids, adapter=r.adapter, sampling=r.sampling,
            request_id=f"s{r.request_id}")) for r in requests))

    for result, events in zip(ours, asyncio.run(streamed())):
        assert tuple(e.token_id for e in events if e.token_id is not None) == result.token_ids
        assert "".join(e.text for e in events) == result.text
        assert [e.finish_reason for e in events] == [None] * (len(events) - 1) + [result.finish_reason]


def test_warm_up_runs_in_the_child(engines):
    local, remote = engines
    done = remote.warm_up(prompt_len=5)
    # the base and one adapter (whatever the ranks loaded, here 2 and 4): alone, together, two
    # of each with longer prompts
    assert (done["requests"], done["ranks"]) == (1 + 1 + 2 + 4, [2, 4])
    stats = remote.stats()
    assert stats["running"] == stats["waiting"] == stats["kv_pages_used"] == 0


def test_refusals_are_the_engines_exceptions(engines):
    local, remote = engines
    with pytest.raises(UnknownAdapterError) as ours:
        local.submit(_request([5], "nope"))
    with pytest.raises(UnknownAdapterError) as theirs:
        asyncio.run(_collect(remote, _request([5], "nope")))
    assert isinstance(theirs.value, KeyError) and str(theirs.value) == str(ours.value)
    with pytest.raises(ConfigError, match="context"):
        asyncio.run(_collect(remote, _request(list(range(1, 51)) * 3)))  # 150 tokens > 128
    with pytest.raises(UnknownAdapterError):
        remote.generate([_request([5], None), _request([5], "nope")])
    with pytest.raises(ConfigError, match="unique"):
        remote.generate([_request([5], None, "same"), _request([6], None, "same")])

    async def same_id_twice():
        first = remote.stream(_request([5, 6], None, "dup", max_new_tokens=50, ignore_eos=True))
        await anext(first)
        try:
            await anext(remote.stream(_request([5, 6], None, "dup")))
        finally:
            await first.aclose()

    with pytest.raises(ConfigError, match="already in use"):
        asyncio.run(same_id_twice())
    assert remote.generate([_request([5, 6], None, "after")])[0].finish_reason in ("length", "stop")  # still serving


def test_adapter_registry_is_mirrored(engines, adapter_dirs):
    local, remote = engines
    info = remote.add_adapter("mlp8", adapter_dirs["mlp8"])
    try:
        assert info == local.add_adapter("mlp8", adapter_dirs["mlp8"])
        assert sorted(a.name for a in remote.adapters()) == ["all4", "attn2", "mlp8"]
        with pytest.raises(ConfigError, match="already loaded"):
            remote.add_adapter("mlp8", adapter_dirs["mlp8"])
        request = _request([9, 10, 11], "mlp8", "m")
        assert remote.generate([request])[0].token_ids == local.generate([request])[0].token_ids
        stats = remote.stats()
        assert stats["adapters_loaded"] == 3 and stats["adapters_resident"] >= 1
        assert "mlp8" in {a.name for a in remote.adapters() if a.resident}  # as of that stats() call
        pages = stats["adapter_pages_used"]
    finally:
        remote.remove_adapter("mlp8")
        local.remove_adapter("mlp8")
    assert sorted(a.name for a in remote.adapters()) == ["all4", "attn2"]
    with pytest.raises(UnknownAdapterError):
        remote.remove_adapter("mlp8")
    with pytest.raises(UnknownAdapterError):
        remote.generate([_request([5], "mlp8")])
    _wait_for(lambda: remote.stats()["adapter_pages_used"] < pages)  # its pages freed, nothing asked for it


def test_closing_a_stream_aborts_the_request_and_frees_its_pages(engines):
    _, remote = engines
    generated = remote.stats()["generated_tokens_total"]

    async def leave_early():
        stream = remote.stream(_request([5, 6], "all4", max_new_tokens=100, ignore_eos=True))
        await anext(stream)
        assert remote.stats()["kv_pages_used"] > 0
        await stream.aclose()

    asyncio.run(leave_early())
    _wait_for(lambda: remote.stats()["running"] == 0 and remote.stats()["kv_pages_used"] == 0)
    assert remote.stats()["generated_tokens_total"] - generated < 100


def test_close_ends_running_streams_and_the_process(model_dir):
    client = EngineClient(_build(model_dir))

    async def close_while_streaming():
        stream = client.stream(_request([5, 6], max_new_tokens=100, ignore_eos=True))
        first = await anext(stream)
        client.close()
        return [first] + [event async for event in stream]

    events = asyncio.run(asyncio.wait_for(close_while_streaming(), 60))
    assert events[-1].finish_reason == "abort" and len(events) < 100
    assert not client.alive and client.exitcode == 0
    with pytest.raises(EngineDeadError):
        client.generate([_request([5])])
    with pytest.raises(EngineDeadError):
        asyncio.run(_collect(client, _request([5])))
    client.abort("anything")  # a no-op, as for a finished request
    client.close()  # idempotent


def test_an_engine_crash_fails_pending_requests(model_dir):
    from fastapi.testclient import TestClient

    from lightning_lorafusion.serving.server import create_app

    client = EngineClient(functools.partial(_engine_failing_after_first_tokens, model_dir))
    try:
        with TestClient(create_app(client)) as http:
            assert http.get("/health").status_code == 200

            async def two_streams():  # the first tokens come; the next step fails
                return await asyncio.gather(*(_collect(client, _request([5, 6, i], max_new_tokens=20,
                                                                        ignore_eos=True)) for i in range(2)))

            for events in asyncio.run(asyncio.wait_for(two_streams(), 60)):
                assert events[-1].finish_reason == "abort" and len(events) <= 2  # not 20 tokens, and no hang
            _wait_for(lambda: not client.alive)
            assert client.exitcode == 1
            with pytest.raises(EngineDeadError, match="crashed"):
                client.generate([_request([5])])
            with pytest.raises(EngineDeadError):
                client.stats()
            assert http.get("/health").status_code == 503
            assert http.get("/metrics").status_code == 200  # the HTTP layer's own metrics still answer
            r = http.post("/v1/completions", json={"model": "base", "prompt": [5, 6], "max_tokens": 2})
            assert r.status_code == 503 and "not running" in r.json()["error"]["message"]
    finally:
        client.close()


def test_build_errors_reach_the_parent_as_the_same_exception(tmp_path):
    with pytest.raises(ConfigError) as ours:
        Engine.from_pretrained(str(tmp_path / "missing"))
    with pytest.raises(ConfigError) as theirs:
        EngineClient.from_pretrained(str(tmp_path / "missing"))
    assert str(theirs.value) == str(ours.value)


def test_the_engine_process_exits_with_its_parent(model_dir, process_exited):
    parent = textwrap.dedent(f"""
        import functools, time
        import torch
        from lightning_lorafusion.serving import Engine, EngineConfig
        from lightning_lorafusion.serving.engine_process import EngineClient

        if __name__ == "__main__":
            config = EngineConfig(num_pages=64, page_size=8, max_num_seqs=4, max_num_batched_tokens=64, backend="torch")
            client = EngineClient(functools.partial(Engine.from_pretrained, {str(model_dir)!r}, None, config,
                                                    device="cpu", dtype=torch.float32))
            print(client.pid, flush=True)
            time.sleep(600)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", parent], env=env, stdout=subprocess.PIPE, text=True)
    try:
        child = int(proc.stdout.readline())
        assert not process_exited(child)
        os.kill(proc.pid, signal.SIGKILL)  # no cleanup of any kind in the parent
        proc.wait(30)
        _wait_for(lambda: process_exited(child), timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()


# -- the child's loop, in this process over a real pipe ----------------------------------------


class _SteppingEngine:
    """What ``EngineLoop`` uses of an engine: records submits and calls in order; ``step``
    blocks until the test releases it, so the test can act while a step runs."""

    def __init__(self):
        import threading

        self.log: list[tuple] = []
        self.in_step, self.release = threading.Event(), threading.Event()
        self.callbacks: dict[str, object] = {}

    def submit(self, request, on_event):
        self.log.append(("submit", request.request_id, self.in_step.is_set()))
        self.callbacks[request.request_id] = on_event

    def step(self):
        self.in_step.set()
        assert self.release.wait(60), "the test never released the step"
        self.in_step.clear()
        from lightning_lorafusion.serving.request import TokenEvent

        for rid, on_event in list(self.callbacks.items()):  # every request ends in this step
            on_event(TokenEvent(rid, 1, "x", None, None, "length"))
        self.callbacks.clear()
        return True

    def remove_adapter(self, name):
        self.log.append(("remove_adapter", name, self.in_step.is_set()))

    def abort(self, request_id):
        self.log.append(("abort", request_id, self.in_step.is_set()))


def test_the_child_drains_the_pipe_while_a_step_runs_and_keeps_command_order():
    """A request sent while the child steps is received (and submitted) at once, however large
    (the parent's send never waits for the step); a submit queued behind another command waits
    for it: commands take effect in the order sent."""
    import multiprocessing
    import threading

    from lightning_lorafusion.serving.engine_child import EngineLoop

    parent, child = multiprocessing.Pipe(duplex=True)
    engine = _SteppingEngine()
    loop = EngineLoop(engine, child, os.getppid())  # the loop leaves when its parent changes
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    try:
        def request(rid, n=4):
            return GenerationRequest(prompt_token_ids=list(range(n)), sampling=SamplingParams(max_new_tokens=1),
                                     request_id=rid)

        parent.send(("submit", request("a")))
        assert engine.in_step.wait(30)  # the loop is stepping "a" and holds the step open
        # ~1.5 MB pickled: more than the socket buffers hold, so a send that waits for the
        # step to end would still be blocked
        sender = threading.Thread(target=parent.send, args=(("submit", request("big", 300_000)),))
        sender.start()
        sender.join(30)
        assert not sender.is_alive() and engine.in_step.is_set()
        deadline = time.monotonic() + 30
        while ("submit", "big", True) not in engine.log:
            assert time.monotonic() < deadline, engine.log
            time.sleep(0.01)
        # a call queued for the main loop, then a submit: the submit waits its turn
        parent.send(("call", 7, "remove_adapter", ("gone",)))
        parent.send(("submit", request("c")))
        time.sleep(0.2)
        assert [e[1] for e in engine.log] == ["a", "big"]  # "c" waits behind the call
        engine.release.set()
        assert parent.poll(30)
        got = {}
        while parent.poll(2):
            message = parent.recv()
            got.setdefault(message[0], []).append(message)
        assert got["reply"] == [("reply", 7, True, None)]
        finished = [e[0] for m in got["events"] for e in m[1] if e[5] == "length"]
        assert set(finished) >= {"a", "big"}
        assert [e[:2] for e in engine.log] == [("submit", "a"), ("submit", "big"), ("remove_adapter", "gone"),
                                                ("submit", "c")]
    finally:
        engine.release.set()
        parent.send(("close",))
        runner.join(30)
        parent.close()
    assert not runner.is_alive()
