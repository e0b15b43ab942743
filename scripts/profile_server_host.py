"""The HTTP layer's own cost per streamed token, on any machine: the real server over a stub engine.

``serve``'s app (``serving.server.create_app``) runs under uvicorn in a child process over a
stub engine that costs nothing: every ``--step-ms`` it hands each running stream one token (a
word of a word-level tokenizer), like an engine step that decodes one token per request. Closed-
loop clients in this process (``--concurrency`` streams, each sending its next request when the
previous stream ends, prompts of ``--prompt-tokens`` token ids, ``--new-tokens`` per request)
read the OpenAI server-sent events over a real socket. Reported: streamed tokens/s at the
client, the tokens/s the stub would have produced with no HTTP at all (concurrency x 1000 /
step_ms), the server process's CPU seconds per 1,000 tokens (from /proc), and time to first
token at the client. What the server costs per token here is what it adds to a GPU engine's
step loop (with ``--engine-process`` the engine has its own process and GIL, so this CPU time is
the server's alone).

    PYTHONPATH=. python3 scripts/profile_server_host.py --concurrency 64 --step-ms 10 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class StubEngine:
    """What ``create_app`` uses of an engine, with streams that cost nothing to produce. Tokens
    reach the event loop the way ``EngineClient`` delivers them: a thread wakes at every step
    boundary and hands the step's events to the loop with one ``call_soon_threadsafe``, which
    puts one event into each running stream's queue."""

    def __init__(self, model_dir: str, step_ms: float) -> None:
        from transformers import AutoConfig, AutoTokenizer

        if step_ms <= 0:
            raise SystemExit("--step-ms must be > 0")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model_config = AutoConfig.from_pretrained(model_dir)
        self.max_model_len = 4096
        self.step_s = step_ms / 1e3
        self.tokens = 0
        self.live: dict[str, list] = {}  # request id -> [queue, tokens sent, tokens wanted]
        self.loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        pass

    def adapters(self):
        return []

    def stats(self) -> dict:
        return {"generated_tokens_total": self.tokens}

    def abort(self, request_id: str) -> None:
        pass

    def _ticker(self) -> None:
        step = self.step_s
        while True:
            time.sleep(max(0.0, step - time.monotonic() % step))
            self.loop.call_soon_threadsafe(self._tick)

    def _tick(self) -> None:
        from lightning_lorafusion.serving.request import TokenEvent

        for rid, entry in list(self.live.items()):
            queue, i, n = entry
            entry[1] = i + 1
            self.tokens += 1
            last = i == n - 1
            if last:
                del self.live[rid]
            queue.put_nowait(TokenEvent(rid, 5 + i % 200, f" w{5 + i % 200}", None, None,
                                        "length" if last else None))

    async def stream(self, greq):
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
            threading.Thread(target=self._ticker, daemon=True).start()
        queue: asyncio.Queue = asyncio.Queue()
        self.live[greq.request_id] = [queue, 0, greq.sampling.max_new_tokens]
        try:
            while True:
                event = await queue.get()
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            self.live.pop(greq.request_id, None)


def _serve(model_dir: str, step_ms: float, port: int, loop: str = "auto", http: str = "auto") -> None:
    import uvicorn

    from lightning_lorafusion.serving.server import ServerConfig, create_app

    app = create_app(StubEngine(model_dir, step_ms), config=ServerConfig(max_pending_requests=100000))
    profile_to = os.environ.get("PROFILE_SERVER_TO")
    if not profile_to:
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", loop=loop, http=http)
        return
    import contextlib
    import cProfile
    import signal

    class _Server(uvicorn.Server):  # SIGTERM ends the run without re-raising: the profile is written
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    server = _Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", loop=loop, http=http))
    signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
    with cProfile.Profile() as prof:
        server.run()
    prof.dump_stats(profile_to)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _load(port: int, concurrency: int, seconds: float, prompt_tokens: int, new_tokens: int,
                lib: str = "httpx") -> dict:
    body = {"model": "base", "prompt": list(range(5, 5 + prompt_tokens)), "max_tokens": new_tokens,
            "stream": True, "temperature": 0}
    tokens, ttft, done = 0, [], 0
    stop_at = time.perf_counter() + seconds

    def on_line(line: str, first: bool, t0: float) -> bool:
        """Count one SSE line; -> whether the first token is still to come."""
        nonlocal tokens
        if not line.startswith("data: ") or line == "data: [DONE]":
            return first
        if json.loads(line[6:])["choices"][0].get("text"):
            tokens += 1
            if first:
                ttft.append(time.perf_counter() - t0)
                return False
        return first

    if lib == "aiohttp":
        import aiohttp

        connector = aiohttp.TCPConnector(limit=concurrency)
        session = aiohttp.ClientSession(f"http://127.0.0.1:{port}", connector=connector,
                                        timeout=aiohttp.ClientTimeout(total=60))

        async def one_request() -> None:
            t0, first = time.perf_counter(), True
            async with session.post("/v1/completions", json=body) as r:
                async for raw in r.content:  # one SSE line at a time
                    first = on_line(raw.decode().rstrip("\n"), first, t0)
    else:
        import httpx

        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        session = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=60)

        async def one_request() -> None:
            t0, first = time.perf_counter(), True
            async with session.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    first = on_line(line, first, t0)

    async def one_client() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            await one_request()
            done += 1

    async with session:
        t0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"tokens": tokens, "requests": done, "wall_s": wall, "ttft": ttft, "client_cpu_s": cpu}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=10.0, help="the stub engine's step time (> 0)")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--uvicorn-loop", default="auto", help="uvicorn's event loop: auto (uvloop if installed), asyncio, uvloop")
    ap.add_argument("--uvicorn-http", default="auto", help="uvicorn's HTTP parser: auto (httptools if installed), h11, httptools")
    ap.add_argument("--client-lib", choices=("httpx", "aiohttp"), default="httpx",
                    help="the clients' HTTP library (their CPU time per token is reported too)")
    ap.add_argument("--serve", nargs=5, metavar=("MODEL_DIR", "STEP_MS", "PORT", "LOOP", "HTTP"), help=argparse.SUPPRESS)
    ap.add_argument("--profile", default=None, help="write the server process's cProfile stats to this file")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.serve:
        _serve(args.serve[0], float(args.serve[1]), int(args.serve[2]), args.serve[3], args.serve[4])
        return {}
    from lightning_lorafusion.model.random_model import write_random_llama

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_random_llama(Path(tmp) / "m", vocab_size=512, max_positions=4096))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = subprocess.Popen([sys.executable, __file__, "--serve", model_dir, str(args.step_ms), str(port),
                                   args.uvicorn_loop, args.uvicorn_http],
                                  # the repo first, then whatever the caller's path held (carried wheels)
                                  env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                      [str(Path(__file__).resolve().parents[1])]
                                      + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
                                       **({"PROFILE_SERVER_TO": args.profile} if args.profile else {})})
        try:
            import httpx

            for _ in range(600):
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
            else:
                raise SystemExit("the server did not come up")
            asyncio.run(_load(port, min(4, args.concurrency), 1.0, args.prompt_tokens, args.new_tokens,
                              args.client_lib))  # warm up
            cpu0 = _cpu_seconds(server.pid)
            r = asyncio.run(_load(port, args.concurrency, args.seconds, args.prompt_tokens, args.new_tokens,
                                  args.client_lib))
            cpu = _cpu_seconds(server.pid) - cpu0
        finally:
            server.terminate()
            server.wait(timeout=30)
    offered = args.concurrency * 1e3 / args.step_ms if args.step_ms > 0 else float("nan")
    report = {"args": vars(args), "tokens_per_s": r["tokens"] / r["wall_s"], "stub_tokens_per_s": offered,
              "tokens": r["tokens"], "wall_s": r["wall_s"], "requests": r["requests"], "server_cpu_s": cpu, "server_cpu_s_per_1k_tokens": 1e3 * cpu / max(r["tokens"], 1),
              "server_cpu_share": cpu / r["wall_s"], "client_cpu_share": r["client_cpu_s"] / r["wall_s"],
              "client_cpu_s_per_1k_tokens": 1e3 * r["client_cpu_s"] / max(r["tokens"], 1),
              "ttft_p50_ms": 1e3 * statistics.median(r["ttft"]) if r["ttft"] else None,
              "ttft_p99_ms": 1e3 * sorted(r["ttft"])[int(0.99 * (len(r["ttft"]) - 1))] if r["ttft"] else None}
    print(json.dumps(report))
    print(f"\nstreams {args.concurrency}, stub step {args.step_ms} ms: {report['tokens_per_s']:.0f} tok/s at the "
          f"clients (stub alone: {offered:.0f}), server CPU {report['server_cpu_s_per_1k_tokens'] * 1e3:.0f} us "
          f"per token ({100 * report['server_cpu_share']:.0f}% of a core), {args.client_lib} clients "
          f"{report['client_cpu_s_per_1k_tokens'] * 1e3:.0f} us per token "
          f"({100 * report['client_cpu_share']:.0f}% of a core), TTFT p50 {report['ttft_p50_ms']:.1f} ms "
          f"p99 {report['ttft_p99_ms']:.1f} ms, {r['requests']} requests")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "profile_server_host.json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
