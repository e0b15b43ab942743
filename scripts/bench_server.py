"""HTTP load test: the OpenAI-compatible server against the engine called directly, same requests.

One device, one engine per mode: a random-weight Llama of a real shape (``--shape 1b`` or ``8b``,
as scripts/bench_generation.py builds it) with ``--adapters`` random LoRA adapters of mixed ranks
(``build_engine``: seeded, so every engine built from the same arguments has the same weights).
``--requests`` greedy requests (prompts of ``--prompt-min``..``--prompt-max`` random tokens,
``--new-tokens`` generated, or with ``--new-tokens-max`` a length drawn uniformly between the two per
request, EOS ignored), each naming an adapter drawn uniformly or, with
``--zipf s``, with probability proportional to 1 / rank^s. They run side by side:

- direct: ``Engine.stream`` per request, as asyncio tasks in this process (the reference);
- http: ``create_app(engine)`` under uvicorn in a thread of this process on a free port; clients
  are asyncio + ``httpx.AsyncClient`` streaming ``POST /v1/completions`` (server-sent events,
  ``model`` = the adapter's name, ``prompt`` = the token ids). ``--client process`` (default)
  runs the clients in a child process (as real clients would: they do not share the server's
  GIL); ``--client thread`` runs them in this process's main thread. With ``--engine-process``
  the server's engine is an ``EngineClient``: the same engine built in a child process (as
  ``serve`` runs it on CUDA); ``--compare-in-process`` then also runs the HTTP trace against
  the in-process engine (mode http_in_process), for the side-by-side, and
  ``--compare-direct-process`` also streams the requests straight from that child engine
  (``EngineClient.stream``, no HTTP; mode direct_process): HTTP against it isolates the HTTP
  layer with the engine laid out as ``serve`` lays it out (direct's engine shares this process
  and its GIL with the consumers of 64 streams).

Load: ``--concurrency C`` clients in a closed loop (each sends its next request when its last one
finished), or ``--rate R`` Poisson arrivals at R requests/s (open loop, no limit on concurrency).
Every mode is measured at the client: throughput (generated tokens / wall time from the first
send to the last answer), TTFT (send to the first text), inter-token latency (gaps between text
pieces, all requests pooled) and time per output token (per request: (last - first) / (tokens -
1)): mean, p50, p99. Every request must end complete (``finish_reason`` "length" with all its
tokens) or as a counted error; nothing is lost. Each HTTP mode's greedy texts are compared with
direct's request by request (in bf16 a near-tie can flip when batches are composed differently;
fp32 must agree).
HTTP overhead = 1 - http tokens/s / direct tokens/s.

    PYTHONPATH=. python3 scripts/bench_server.py --shape 1b --out $OUT
    PYTHONPATH=. python3 scripts/bench_server.py --shape 1b --requests 2048 --repeats 2 --engine-process \
        --compare-in-process --out $OUT
    PYTHONPATH=. python3 scripts/bench_server.py --shape tiny --device cpu --dtype float32 --requests 8 \\
        --concurrency 4 --new-tokens 4 --prompt-min 4 --prompt-max 12 --adapters 3 --client thread
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing
import random
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace

from harness import add_device_args, device_info, dtype_of, logger, percentile, sync, timer, write_json

import torch  # noqa: E402
from bench_generation import SHAPES, add_trace_args, build_model, make_requests, random_adapters  # noqa: E402

from lightning_lorafusion.model.hf_loading import params_from_hf_model  # noqa: E402
from lightning_lorafusion.serving import Engine, EngineConfig  # noqa: E402
from lightning_lorafusion.serving.config import EngineTuning  # noqa: E402
from lightning_lorafusion.serving.engine_process import EngineClient  # noqa: E402

BASE_MODEL = "base"
HTTP_MODES = ("http", "http_in_process")  # http: the server's engine (an EngineClient with --engine-process)


log = logger("bench_server")


# ---------------------------------------------------------------------------------------------
# what a client sees of one request


@dataclass
class Outcome:
    """One request at the client: times are ``time.perf_counter()`` of the process that sent it."""

    request_id: str
    sent: float
    first: float | None = None  # first non-empty text
    last: float | None = None  # last non-empty text
    done: float | None = None  # answer over (finish, error or end of stream)
    gaps: list[float] = field(default_factory=list)  # between consecutive text pieces
    tokens: int = 0
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None

    def piece(self, text: str) -> None:
        if not text:
            return
        now = time.perf_counter()
        if self.last is not None:
            self.gaps.append(now - self.last)
        self.first = self.first if self.first is not None else now
        self.last = now
        self.text += text


@dataclass(frozen=True, kw_only=True)
class Spec:
    """A request as the HTTP client sends it (plain data: it crosses to the client process)."""

    request_id: str
    model: str
    prompt: list[int]
    max_tokens: int


def to_spec(req) -> Spec:
    return Spec(request_id=req.request_id, model=req.adapter or BASE_MODEL, prompt=list(req.prompt_token_ids),
                max_tokens=req.sampling.max_new_tokens)


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets (seconds) of ``n`` requests at ``rate`` per second (exponential gaps)."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def drive(send, items: list, *, concurrency: int, arrivals: list[float] | None) -> tuple[list[Outcome], float]:
    """Send every item with ``send(item) -> Outcome``: ``concurrency`` workers in a closed loop,
    or each at its arrival offset (open loop). Outcomes in the items' order, and the wall time
    from the first send to the last answer."""
    outcomes: list[Outcome | None] = [None] * len(items)
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        outcomes[i] = await send(items[i])

    if arrivals is None:
        queue = iter(range(len(items)))

        async def worker() -> None:
            for i in queue:  # a shared iterator: each index is taken once
                await one(i)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    else:
        async def at(i: int) -> None:
            await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
            await one(i)

        await asyncio.gather(*(at(i) for i in range(len(items))))
    return outcomes, max(o.done for o in outcomes) - t0


# ---------------------------------------------------------------------------------------------
# the engine


def build_engine(shape: str, device: str, dtype: torch.dtype, adapters: int, ranks: list[int],
                 config: EngineConfig) -> Engine:
    """The benchmark's engine: the random ``shape`` model (seed 0) and ``adapters`` random adapters
    named adapter0.. (seed 1). Module-level and seeded: the engine process builds the same weights."""
    device = torch.device(device)
    model, tokenizer = build_model(SHAPES[shape], device, dtype, seed=0)
    model_config, params = params_from_hf_model(model)
    engine = Engine(model_config, params, tokenizer, config, device=device, dtype=dtype)
    for name, r, alpha, factors in random_adapters(model_config, adapters, ranks, device, dtype, seed=1, b_std=0.02):
        engine.add_adapter_weights(name, factors, rank=r, alpha=alpha)
    return engine


# ---------------------------------------------------------------------------------------------
# the modes


async def send_direct(engine: Engine, req) -> Outcome:
    out = Outcome(req.request_id, time.perf_counter())
    try:
        async for event in engine.stream(req):
            out.tokens += event.token_id is not None
            out.piece(event.text)
            out.finish_reason = event.finish_reason or out.finish_reason
    except Exception as e:  # counted, not raised: one refused request must not end the run
        out.error = f"{type(e).__name__}: {e}"
    out.done = time.perf_counter()
    return out


async def _read_sse(out: Outcome, lines) -> bool:
    """Consume one completion's server-sent events (``lines`` without line ends) into ``out``;
    -> whether the stream ended with ``[DONE]``."""
    async for line in lines:
        if not line:
            continue
        data = line[6:] if line.startswith("data: ") else None
        if data == "[DONE]":
            return True
        chunk = json.loads(data) if data is not None else {"error": {"message": f"not SSE: {line!r}"}}
        if "error" in chunk:
            out.error = f"stream error: {chunk['error'].get('message')}"
            return False
        for choice in chunk["choices"]:
            out.piece(choice["text"])
            out.finish_reason = choice["finish_reason"] or out.finish_reason
        if chunk.get("usage"):
            out.tokens = chunk["usage"]["completion_tokens"]
    return False


async def _aiohttp_lines(content):
    async for raw in content:  # aiohttp's StreamReader yields one line at a time
        yield raw.decode().rstrip("\r\n")


async def send_http(pool, spec: Spec) -> Outcome:
    """One streamed completion through ``pool`` (an aiohttp ClientSession or an httpx
    AsyncClient, both with the server's base URL)."""
    out = Outcome(spec.request_id, time.perf_counter())
    body = {"model": spec.model, "prompt": spec.prompt, "max_tokens": spec.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    aiohttp = sys.modules.get("aiohttp")
    errors: tuple = (ValueError, KeyError, OSError, asyncio.TimeoutError)
    try:
        if aiohttp is not None and isinstance(pool, aiohttp.ClientSession):
            errors += (aiohttp.ClientError,)
            async with pool.post("/v1/completions", json=body) as r:
                if r.status != 200:
                    out.error = f"HTTP {r.status}: {(await r.text(errors='replace'))[:200]}"
                    ended = True
                else:
                    ended = await _read_sse(out, _aiohttp_lines(r.content))
        else:
            import httpx

            errors += (httpx.HTTPError,)
            async with pool.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    out.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                    ended = True
                else:
                    ended = await _read_sse(out, r.aiter_lines())
        if not ended and out.error is None:
            out.error = "the stream ended without [DONE]"
    except errors as e:
        out.error = f"{type(e).__name__}: {e}"
    out.done = time.perf_counter()
    return out


def _connection_pool(url: str, lib: str, concurrency: int, open_loop: bool):
    """The clients' connection pool: at most ``concurrency`` connections in a closed loop."""
    if lib == "aiohttp":
        import aiohttp

        return aiohttp.ClientSession(url, timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(limit=0 if open_loop else max(concurrency, 1)))
    import httpx

    limits = httpx.Limits(max_connections=None if open_loop else max(concurrency, 1), max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits)


def server_ttft(url: str) -> tuple[float, float]:
    """(sum, count) of the server's time-to-first-token histogram for /v1/completions."""
    import urllib.request

    got = {}
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("lorafusion_http_time_to_first_token_seconds_") and "/v1/completions" in line:
                name, value = line.rsplit(" ", 1)
                got[name.split("{")[0].rsplit("_", 1)[1]] = float(value)
    return got.get("sum", 0.0), got.get("count", 0.0)


async def http_clients(url: str, warm: list[Spec], specs: list[Spec], concurrency: int,
                       arrivals: list[float] | None, lib: str = "aiohttp"
                       ) -> tuple[list[Outcome], float, dict]:
    """Warm the connections with ``warm`` (not measured), then drive ``specs``; -> (outcomes,
    wall seconds, {"server_ttft_s": the server's mean time to first token over ``specs``,
    "client_cpu_s": this process's CPU seconds while driving them})."""
    async with _connection_pool(url, lib, concurrency, arrivals is not None) as pool:
        await drive(lambda s: send_http(pool, s), warm, concurrency=concurrency, arrivals=None)
        before = server_ttft(url)  # nothing runs now: a blocking read is fine
        cpu = time.process_time()
        outcomes, wall = await drive(lambda s: send_http(pool, s), specs, concurrency=concurrency,
                                     arrivals=arrivals)
        cpu = time.process_time() - cpu
        total, count = (a - b for a, b in zip(server_ttft(url), before))
        return outcomes, wall, {"server_ttft_s": total / count if count else None, "client_cpu_s": cpu}


def _http_clients_in_child(url, warm, specs, concurrency, arrivals, lib, conn) -> None:
    """Entry point of the client process: outcomes go back through ``conn`` as dicts."""
    try:
        outcomes, wall, extra = asyncio.run(http_clients(url, warm, specs, concurrency, arrivals, lib))
        conn.send(([asdict(o) for o in outcomes], wall, extra))
    except BaseException as e:  # the parent reports it
        conn.send(f"{type(e).__name__}: {e}")
    finally:
        conn.close()


def run_http_clients(url: str, warm: list[Spec], specs: list[Spec], concurrency: int,
                     arrivals: list[float] | None, where: str, lib: str = "aiohttp"
                     ) -> tuple[list[Outcome], float, dict]:
    """``http_clients`` in a child process (``where`` "process") or in this thread ("thread":
    the clients' CPU is then not theirs alone, and is not reported)."""
    if where == "thread":
        outcomes, wall, extra = asyncio.run(http_clients(url, warm, specs, concurrency, arrivals, lib))
        return outcomes, wall, {**extra, "client_cpu_s": None}
    ctx = multiprocessing.get_context("spawn")  # no fork of a process holding CUDA and threads
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_http_clients_in_child, args=(url, warm, specs, concurrency, arrivals, lib, child),
                       daemon=True)
    proc.start()
    child.close()
    try:
        got = parent.recv()
    except EOFError:
        got = f"the client process died (exit code {proc.join(5) or proc.exitcode})"
    proc.join(30)
    if isinstance(got, str):
        raise RuntimeError(f"HTTP clients failed: {got}")
    outcomes, wall, extra = got
    return [Outcome(**o) for o in outcomes], wall, extra


class UvicornThread:
    """uvicorn serving ``app`` on a free local port in a daemon thread of this process."""

    def __init__(self, app, *, loop: str, http: str):
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        # log_config=None: uvicorn's own dictConfig would close every logging handler this process
        # holds (a library's handler on a stream it then closes, ours)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    log_config=None, loop=loop, http=http,
                                                    timeout_graceful_shutdown=10))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


# ---------------------------------------------------------------------------------------------
# numbers


def spread(values: list[float]) -> dict:
    return {"mean": sum(values) / len(values) if values else None, "p50": percentile(values, 50),
            "p99": percentile(values, 99)}


def summarize(outcomes: list[Outcome], wall: float, *, new_tokens: int | dict[str, int]) -> dict:
    """``new_tokens``: every request's length, or each one's by request id."""
    def wanted(o: Outcome) -> int:
        return new_tokens if isinstance(new_tokens, int) else new_tokens[o.request_id]

    errors = [o for o in outcomes if o.error is not None]
    complete = [o for o in outcomes if o.error is None and o.finish_reason == "length" and o.tokens == wanted(o)]
    tokens = sum(o.tokens for o in outcomes if o.error is None)
    ttft = [o.first - o.sent for o in complete if o.first is not None]
    tpot = [(o.last - o.first) / (o.tokens - 1) for o in complete if o.first is not None and o.tokens > 1]
    return {"requests": len(outcomes), "complete": len(complete), "errors": len(errors),
            "incomplete": len(outcomes) - len(complete) - len(errors),
            "error_kinds": dict(Counter(o.error[:120] for o in errors)),
            "generated_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "ttft_s": spread(ttft), "itl_s": spread([g for o in complete for g in o.gaps]), "tpot_s": spread(tpot)}


def compare_texts(direct: dict[str, str], http: dict[str, str]) -> dict:
    ids = [k for k in direct if k in http]
    equal = [k for k in ids if direct[k] == http[k]]
    prefix = [next((i for i, (a, b) in enumerate(zip(direct[k], http[k])) if a != b),
                   min(len(direct[k]), len(http[k]))) for k in ids]
    return {"compared": len(ids), "equal": len(equal), "differ": [k for k in ids if k not in set(equal)][:20],
            "mean_common_prefix_chars": sum(prefix) / len(prefix) if prefix else None,
            "mean_chars": sum(len(direct[k]) for k in ids) / len(ids) if ids else None}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


# a client process busier than this share of a core is suspected of bounding the HTTP numbers
# (httpx clients were, at 5-6k tok/s on an H100 host: docs/BENCHMARKS.md, HTTP server)
CLIENT_BUSY = 0.8

# engine counters each mode records (differences over its run; HTTP runs include the clients' warm-up)
ENGINE_COUNTERS = ("steps_total", "prefill_steps_total", "prefill_held_steps_total", "step_rows_total",
                   "step_seconds_total", "prefill_step_seconds_total", "ttft_seconds_total", "first_tokens_total",
                   "adapter_page_ins_total", "preemptions_total")


def engine_view(r: dict) -> dict:
    """Where a mode's wall time went, seen by the engine: its steps (how many, how full, how
    long: decode-only steps replay graphs, prefill steps run eagerly), the time it had nothing
    to run, and the mean time to first token seen by the engine (from its arrival there), by
    the server (from the request reaching it; HTTP modes) and by the client (from sending)."""
    steps, prefill = r["steps_total"], r["prefill_steps_total"]
    busy, busy_prefill = r["step_seconds_total"], r["prefill_step_seconds_total"]
    decode = steps - prefill
    return {"steps": steps, "prefill_steps": prefill, "rows_per_step": r["step_rows_total"] / steps if steps else None,
            "decode_step_s": (busy - busy_prefill) / decode if decode else None,
            "prefill_step_s": busy_prefill / prefill if prefill else None,
            "busy_s": busy, "idle_s": r["wall_s"] - busy,
            "engine_ttft_s": r["ttft_seconds_total"] / r["first_tokens_total"] if r["first_tokens_total"] else None,
            "server_ttft_s": r.get("server_ttft_s"), "client_ttft_s": r["ttft_s"]["mean"]}


def table(report: dict) -> str:
    load = report["load"]
    engine_process = report["args"].get("engine_process")
    label = {"direct": "direct", "http": "http (engine process)" if engine_process else "http",
             "http_in_process": "http (in-process)", "direct_process": "direct (engine process)"}
    head = (f"{'mode':<22} {'requests':>8} {'load':>10} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'tok p50':>8} {'tok p99':>8} {'errors':>6} {'lost':>5}")
    lines = [head, "  (latencies in ms; tok = inter-token latency at the client)"]
    for mode in ("direct", "direct_process") + HTTP_MODES:
        r = report.get(mode)
        if r is None:
            continue
        lines.append(f"{label[mode]:<22} {r['requests']:>8} {load:>10} {r['tokens_per_s']:>9.0f} "
                     f"{_ms(r['ttft_s']['p50']):>9} {_ms(r['ttft_s']['p99']):>9} {_ms(r['itl_s']['p50']):>8} "
                     f"{_ms(r['itl_s']['p99']):>8} {r['errors']:>6} {r['incomplete']:>5}")
    lines.append(f"{'engine view':<22} {'steps':>6} {'prefill':>7} {'rows/step':>9} {'decode ms':>9} "
                 f"{'prefill ms':>10} {'busy s':>7} {'idle s':>7} {'TTFT engine':>11} {'TTFT server':>11} "
                 f"{'TTFT client':>11}")
    for mode in ("direct", "direct_process") + HTTP_MODES:
        r = report.get(mode)
        if r is None or "step_seconds_total" not in r:
            continue
        v = engine_view(r)
        lines.append(f"{label[mode]:<22} {v['steps']:>6} {v['prefill_steps']:>7} {v['rows_per_step'] or 0:>9.1f} "
                     f"{_ms(v['decode_step_s']):>9} {_ms(v['prefill_step_s']):>10} {v['busy_s']:>7.2f} "
                     f"{v['idle_s']:>7.2f} {_ms(v['engine_ttft_s']):>11} {_ms(v['server_ttft_s']):>11} "
                     f"{_ms(v['client_ttft_s']):>11}")
    for mode in HTTP_MODES:
        r = report.get(mode)
        if r is not None and r.get("client_cpu_s") is not None and r["wall_s"] > 0:
            share = r["client_cpu_s"] / r["wall_s"]
            lines.append(f"{label[mode]}: the client process used {100 * share:.0f}% of a core"
                         + (" (busy: the clients may bound these numbers)" if share > CLIENT_BUSY else ""))
    for mode in HTTP_MODES:
        if f"{mode}_overhead" in report:
            lines.append(f"{label[mode]} overhead = 1 - http/direct tokens/s = "
                         f"{100 * report[f'{mode}_overhead']:.1f}% (last repeat)")
    if len(report.get("repeats", [])) > 1:
        for mode in HTTP_MODES:
            if f"{mode}_overhead" in report:
                lines.append(f"per repeat, {label[mode]}: " + ", ".join(
                    f"{r['direct']['tokens_per_s']:.0f} direct / {r[mode]['tokens_per_s']:.0f} http "
                    f"({100 * r[f'{mode}_overhead']:.1f}%)" for r in report["repeats"]))
                lines.append(f"{label[mode]} overhead over all repeats (tokens / time pooled) = "
                             f"{100 * report[f'{mode}_overhead_pooled']:.1f}%")
                lines.append(f"{label[mode]} overhead over the repeats after the first (tokens / time pooled) = "
                             f"{100 * report[f'{mode}_overhead_pooled_warm']:.1f}%")
    if "http_vs_direct_process_overhead" in report:
        lines.append("http (engine process) overhead against direct (engine process) = "
                     f"{100 * report['http_vs_direct_process_overhead']:.1f}% (last repeat), "
                     f"{100 * report['http_vs_direct_process_overhead_pooled_warm']:.1f}% pooled over the repeats "
                     "after the first")
    for mode in ("direct_process",) + HTTP_MODES:
        if _texts_key(mode) in report:
            t = report[_texts_key(mode)]
            lines.append(f"greedy texts equal to direct, {label[mode]}: {t['equal']}/{t['compared']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trace_args(ap, new_tokens=64)
    add_device_args(ap)
    ap.add_argument("--new-tokens-max", type=int, default=None,
                    help="outputs of uniform length in [--new-tokens, this] per request (scripts/bench_serving.py's "
                         "--output-len); default: every request --new-tokens")
    ap.add_argument("--concurrency", type=int, default=64, help="closed-loop clients (ignored with --rate)")
    ap.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second (0: closed loop)")
    ap.add_argument("--zipf", type=float, default=0.0, help="adapter popularity ~ 1/rank^s (0: uniform)")
    ap.add_argument("--client", choices=("process", "thread"), default="process",
                    help="HTTP clients in a child process or in this process's main thread")
    ap.add_argument("--client-lib", choices=("aiohttp", "httpx"), default="aiohttp",
                    help="the HTTP clients' library (httpx costs the clients ~3x the CPU per streamed token)")
    ap.add_argument("--uvicorn-loop", default="auto", help="uvicorn's event loop: auto, asyncio, uvloop")
    ap.add_argument("--uvicorn-http", default="auto", help="uvicorn's HTTP parser: auto, h11, httptools")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-batched-tokens", type=int, default=16384)
    ap.add_argument("--memory-fraction", type=float, default=0.6)
    ap.add_argument("--num-pages", type=int, default=None, help="pool pages (default: from free memory)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--prefill-wait-steps", type=int, default=0,
                    help="EngineConfig.prefill_wait_steps (prefill coalescing) of every engine")
    ap.add_argument("--graphs", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--mixed-graphs", choices=("auto", "on", "off"), default="auto",
                    help="EngineTuning.mixed_graphs: steps with prefill rows as CUDA graphs in pieces")
    ap.add_argument("--seed", type=int, default=4)
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for this process (the engine and server threads share the GIL)")
    ap.add_argument("--repeats", type=int, default=1, help="direct then HTTP, this many times (headline: the last)")
    ap.add_argument("--engine-process", action="store_true",
                    help="the server's engine runs in a child process (EngineClient, as serve does on CUDA)")
    ap.add_argument("--compare-direct-process", action="store_true",
                    help="with --engine-process: also stream the requests from the child engine without HTTP")
    ap.add_argument("--compare-in-process", action="store_true",
                    help="with --engine-process: also serve HTTP from the in-process engine (mode http_in_process)")
    ap.add_argument("--out", default=None, help="directory for bench_server_<shape>.json")
    args = ap.parse_args(argv)
    if args.compare_in_process and not args.engine_process:
        ap.error("--compare-in-process needs --engine-process")
    if args.compare_direct_process and not args.engine_process:
        ap.error("--compare-direct-process needs --engine-process")
    if args.new_tokens_max is not None and args.new_tokens_max < args.new_tokens:
        ap.error("--new-tokens-max must be at least --new-tokens")
    return args


@dataclass
class Setup:
    """The engines (direct's and each HTTP mode's), the trace and its warm-up."""

    engine: Engine
    served: dict
    reqs: list
    expected: dict[str, int]
    arrivals: list[float] | None
    warm: list
    names: list[str]

    def engines(self) -> list:
        return list({id(e): e for e in [self.engine, *self.served.values()]}.values())


def build_setup(args) -> Setup:
    vocab = SHAPES[args.shape]["vocab_size"]
    build = functools.partial(
        build_engine, args.shape, args.device, dtype_of(args.dtype), args.adapters,
        [int(r) for r in args.ranks.split(",")],
        EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens,
                     gpu_memory_fraction=args.memory_fraction, num_pages=args.num_pages, backend=args.backend,
                     cpu_pool_mib=1024, cuda_graphs=args.graphs, prefill_wait_steps=args.prefill_wait_steps,
                     tuning=EngineTuning(mixed_graphs=args.mixed_graphs)))
    engine = build()  # the direct mode's (and without --engine-process the server's)
    # built second, so its pool is sized from what the first left free (both fit a 1B model on 80 GB)
    served = {"http": EngineClient(build) if args.engine_process else engine}
    if args.compare_in_process:
        served["http_in_process"] = engine
    names = [a.name for a in engine.adapters()]
    weights = [1.0 / (i + 1) ** args.zipf for i in range(len(names))] if args.zipf > 0 else None
    reqs = make_requests(args.requests, vocab, args.prompt_min, args.prompt_max, names,
                         args.new_tokens, seed=args.seed, adapter_weights=weights)
    if args.new_tokens_max is not None:
        lengths = random.Random(args.seed + 7)
        reqs = [replace(r, sampling=replace(r.sampling, max_new_tokens=lengths.randint(args.new_tokens,
                                                                                        args.new_tokens_max)))
                for r in reqs]
    arrivals = None if args.rate <= 0 else poisson_arrivals(len(reqs), args.rate, seed=args.seed)
    # one short request per adapter: compiles, graph buckets and every adapter paged in before any mode
    warm = make_requests(len(names), vocab, args.prompt_min, args.prompt_min + 16, names, 4, seed=args.seed + 1)
    warm = [replace(w, adapter=n, request_id=f"w{i}") for i, (w, n) in enumerate(zip(warm, names))]
    setup = Setup(engine, served, reqs, {r.request_id: r.sampling.max_new_tokens for r in reqs}, arrivals, warm,
                  names)
    for e in setup.engines():
        e.generate(warm)
        # and a batch of the trace's own prompts (shorter answers): prefill shapes like the measured runs'
        e.generate([replace(r, request_id=f"t{r.request_id}", sampling=replace(r.sampling, max_new_tokens=8))
                    for r in reqs[:args.concurrency]])
    return setup


def stats_delta(e, before: dict) -> dict:
    after = e.stats()
    return {k: after[k] - before[k] for k in ENGINE_COUNTERS}


def run_direct(e, setup: Setup, concurrency: int) -> tuple[dict, dict[str, str]]:
    """``e.stream`` per request from asyncio tasks of this thread -> the mode's row and its texts."""
    e.reset_prefix_cache()  # each run prefills its prompts itself (no hits from the last run)
    before = e.stats()
    sync()
    outcomes, wall = asyncio.run(drive(lambda r: send_direct(e, r), setup.reqs, concurrency=concurrency,
                                       arrivals=setup.arrivals))
    row = {**summarize(outcomes, wall, new_tokens=setup.expected), **stats_delta(e, before)}
    return row, {o.request_id: o.text for o in outcomes if o.error is None}


def run_repeat(k: int, args, setup: Setup, servers: dict, warm_specs: list[Spec]) -> dict:
    """Direct, then (optionally) the child engine without HTTP, then each HTTP mode: one row."""
    row: dict = {}
    row["direct"], direct_texts = run_direct(setup.engine, setup, args.concurrency)
    log(f"repeat {k}: direct {row['direct']['tokens_per_s']:.0f} tok/s over {row['direct']['wall_s']:.2f}s")
    if args.compare_direct_process:  # the server's child engine, streamed without HTTP
        row["direct_process"], texts = run_direct(setup.served["http"], setup, args.concurrency)
        row["direct_process_texts"] = compare_texts(direct_texts, texts)
        log(f"repeat {k}: direct_process {row['direct_process']['tokens_per_s']:.0f} tok/s")
    for mode, e in setup.served.items():  # the same requests through each server
        e.reset_prefix_cache()
        before = e.stats()
        outcomes, wall, extra = run_http_clients(servers[mode].url, warm_specs, [to_spec(r) for r in setup.reqs],
                                                 args.concurrency, setup.arrivals, args.client, args.client_lib)
        # the engine's step counts include the HTTP warm-up (its connections are opened by it)
        row[mode] = {**summarize(outcomes, wall, new_tokens=setup.expected), **stats_delta(e, before), **extra}
        cpu = extra["client_cpu_s"]
        if cpu is not None and wall > 0 and cpu / wall > CLIENT_BUSY:
            log(f"repeat {k}: {mode}: the client process used {100 * cpu / wall:.0f}% of a core: the "
                "clients, not the server, may bound this mode's numbers")
        log(f"repeat {k}: {mode} {row[mode]['tokens_per_s']:.0f} tok/s over {wall:.2f}s")
        row[_texts_key(mode)] = compare_texts(direct_texts, {o.request_id: o.text for o in outcomes
                                                             if o.error is None})
        if row["direct"]["tokens_per_s"] > 0:
            row[f"{mode}_overhead"] = 1.0 - row[mode]["tokens_per_s"] / row["direct"]["tokens_per_s"]
    if "direct_process" in row and row["direct_process"]["tokens_per_s"] > 0:
        row["http_vs_direct_process_overhead"] = 1.0 - row["http"]["tokens_per_s"] / row["direct_process"]["tokens_per_s"]
    return row


def pooled(mode: str, rows: list[dict], base: str = "direct") -> float:
    """1 - the mode's tokens/s over ``base``'s, tokens and time summed over ``rows``: the figure
    least moved by one repeat's drift (per-repeat ratios compare runs minutes apart)."""
    rate = {m: sum(r[m]["generated_tokens"] for r in rows) / sum(r[m]["wall_s"] for r in rows) for m in (base, mode)}
    return 1.0 - rate[mode] / rate[base]


def add_pooled(report: dict, repeats: list[dict]) -> None:
    """The headline is the last repeat (everything warm); every repeat stays in ``repeats``.
    "warm" pools every repeat but the first (first-time costs the warm-up did not reach can
    slow the first direct run); with one repeat it is that repeat's."""
    report["repeats"] = repeats
    report.update(repeats[-1])
    overheads = [r["http_overhead"] for r in repeats if "http_overhead" in r]
    if overheads:
        report["http_overhead_per_repeat"] = overheads
    warm = repeats[1:] or repeats
    for mode in [m for m in HTTP_MODES if m in repeats[-1]]:
        report[f"{mode}_overhead_pooled"] = pooled(mode, repeats)
        report[f"{mode}_overhead_pooled_warm"] = pooled(mode, warm)
    if "direct_process" in repeats[-1]:
        report["http_vs_direct_process_overhead_pooled"] = pooled("http", repeats, "direct_process")
        report["http_vs_direct_process_overhead_pooled_warm"] = pooled("http", warm, "direct_process")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    report: dict = {**device_info(args.device), "args": vars(args),
                    "load": f"C={args.concurrency}" if args.rate <= 0 else f"{args.rate:g}/s"}
    with timer() as t:
        setup = build_setup(args)
    report["output_lengths"] = {"min": min(setup.expected.values()), "max": max(setup.expected.values()),
                                "total": sum(setup.expected.values())}
    report["setup_s"] = t.seconds
    log(f"engines ready in {t.seconds:.1f}s: " + ", ".join(
        f"{mode} {e.stats()['kv_pages_total']} pages" for mode, e in [("direct", setup.engine), *setup.served.items()])
        + f"; cuda graphs {setup.engine.runner.graphs is not None}, {len(setup.names)} adapters")
    from lightning_lorafusion.serving.server import ServerConfig, create_app

    servers = {mode: UvicornThread(create_app(e, config=ServerConfig(
        served_model_name=BASE_MODEL, rescan_interval_s=0, max_pending_requests=max(256, args.concurrency))),
        loop=args.uvicorn_loop, http=args.uvicorn_http) for mode, e in setup.served.items()}
    warm_specs = [Spec(request_id=f"hw{i}", model=n, prompt=list(w.prompt_token_ids), max_tokens=4)
                  for i, (w, n) in enumerate(zip(setup.warm, setup.names))]
    try:  # the modes alternate, so first-time costs and drift over the run hit all alike
        repeats = [run_repeat(k, args, setup, servers, warm_specs) for k in range(args.repeats)]
    finally:
        for server in servers.values():
            server.stop()
        for e in setup.engines():
            e.close()
    add_pooled(report, repeats)
    write_json(args.out, f"bench_server_{args.shape}.json", report)
    report["table"] = table(report)
    print("\n" + report["table"])
    return report


def _texts_key(mode: str) -> str:
    return "texts" if mode == "http" else f"{mode}_texts"


if __name__ == "__main__":
    main()
