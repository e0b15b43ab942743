"""Host time of the engine's decode steps: Engine.step wall time minus the model's forward.

A tiny random Llama (``write_random_llama``: word-level tokenizer, ``--vocab`` tokens) served by
the torch backend on the CPU with ``--adapters`` random LoRA adapters of mixed ranks. For each
batch size in ``--rows``: ``rows`` requests of ``--prompt`` random tokens, each a random adapter
(every 8th the base), generating ``--new-tokens`` tokens (EOS ignored): half greedy, half seeded
sampling (temperature 0.8, top-k 50, top-p 0.9), every 16th with a stop string and a stop token
id that never occur, every 32nd with ``logprobs=2``. All are admitted and prefilled, then
``--steps`` decode-only steps are timed one by one:

- step: wall time of ``Engine.step``;
- model: the runner's ``forward`` and ``logits`` calls inside it (the decoder and LM head) and
  ``_decode_batch`` (the eager decode step's views and ops on its input buffers): what a GPU's
  graph replay runs, timed by wrapping the three methods on the runner instance;
- sampler: the engine's sampler calls (``sample_rows``, ``token_logprobs``: argmax, filtering,
  per-row draws), timed the same way;
- host = step - model - sampler: scheduling, table and input updates, stop checks,
  detokenization, events (what runs in Python per step and per row).

``--model real,stub`` (the default) measures twice: with the tiny model, then with its forward
and LM head replaced by fixed tensors (``stub_model``: the sampler still runs, on random logits
that change every step). The stub leaves the host path alone on the CPU: with the real model
the host's code also runs after the forward has evicted it from the caches, and two shared
cores add noise, so its host column is higher and varies more than the stub's.

Each batch size runs ``--repeats`` times (fresh requests); the table gives min / median over
the repeats of the per-step mean. ``--cprofile`` profiles one more run of the largest batch and
prints the top functions by cumulative and by own time. ``--dump FILE`` writes every event
(token, text, logprob, finish reason) of the runs as JSON, then those of a mix of requests that
end every way (``finishing_mix``: lengths, stop ids, stop strings, EOS, logprobs, prompt
scoring; joining mid-run) and their ``generate`` results, to compare two versions' outputs.

    PYTHONPATH=. python3 scripts/profile_engine_host.py --rows 64,256 --repeats 3 --cprofile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench_generation import random_adapters  # noqa: E402

from lightning_lorafusion.model.random_model import write_random_llama  # noqa: E402
from lightning_lorafusion.serving import Engine, EngineConfig, GenerationRequest, SamplingParams  # noqa: E402
from lightning_lorafusion.serving import engine as engine_module  # noqa: E402


class Timers:
    """Wall time spent inside wrapped callables, by label."""

    def __init__(self) -> None:
        self.total: dict[str, float] = {}

    def wrap(self, label: str, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[label] = self.total.get(label, 0.0) + time.perf_counter() - t
        return timed

    def take(self) -> dict[str, float]:
        out, self.total = self.total, {}
        return out


def make_requests(n: int, args, adapters: list[str], seed: int) -> list[GenerationRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kw = dict(max_new_tokens=args.new_tokens, ignore_eos=True)
        if i % 2:
            kw.update(temperature=0.8, top_k=50, top_p=0.9, seed=rng.randrange(2**31))
        else:
            kw.update(temperature=0.0)
        if i % 16 == 3:
            kw.update(stop=("never here", "w1 w1 w1"), stop_token_ids=(1,))  # <unk>, w1: never sampled here
        if i % 32 == 5:
            kw.update(logprobs=2)
        prompt = [rng.randrange(4, args.vocab) for _ in range(args.prompt)]
        adapter = None if i % 8 == 7 else rng.choice(adapters)
        out.append(GenerationRequest(prompt_token_ids=prompt, adapter=adapter, sampling=SamplingParams(**kw),
                                     request_id=f"s{seed}-r{i}"))
    return out


def finishing_mix(args, adapters: list[str], n: int = 96) -> list[GenerationRequest]:
    """Requests that end every way, for ``--dump``: by length (1..40 tokens), on stop token ids
    (a sixteenth of the vocabulary), on stop strings (some spanning two tokens: "1 w2"), on EOS;
    greedy and seeded; with logprobs; and prompt-scoring ones (max_new_tokens 0)."""
    rng = random.Random(12345)
    out = []
    for i in range(n):
        kw = dict(max_new_tokens=rng.randint(1, 40), ignore_eos=i % 5 != 0)
        if i % 2:
            kw.update(temperature=rng.choice([0.7, 1.0, 1.3]), top_k=rng.choice([0, 20]),
                      top_p=rng.choice([1.0, 0.8]), seed=rng.randrange(2**31))
        else:
            kw.update(temperature=0.0)
        if i % 3 == 0:
            kw.update(stop_token_ids=tuple(range(4, 4 + args.vocab // 16)))
        if i % 4 == 1:
            kw.update(stop=rng.choice([("w1",), ("1 w2", "w33"), ("7 w",)]))
        if i % 6 == 2:
            kw.update(logprobs=rng.choice([0, 3]))
        if i % 17 == 4:
            kw = dict(max_new_tokens=0, prompt_logprobs=1)
        prompt = [rng.randrange(4, args.vocab) for _ in range(rng.randint(3, 2 * args.prompt))]
        adapter = None if i % 8 == 7 else rng.choice(adapters)
        out.append(GenerationRequest(prompt_token_ids=prompt, adapter=adapter, sampling=SamplingParams(**kw),
                                     request_id=f"mix-{i}"))
    return out


def run_mix(engine: Engine, requests: list[GenerationRequest]) -> list:
    """Half the requests at once, the rest joining one per step; -> every event and result."""
    record = []
    first, rest = requests[:len(requests) // 2], list(requests[len(requests) // 2:])
    for r in first:
        engine.submit(r, lambda ev: None)
    while engine.scheduler.has_work() or rest or engine.stats()["waiting"]:
        if rest:
            engine.submit(rest.pop(0))
        record += [[e.request_id, e.token_id, e.text, e.logprob, e.top_logprobs and sorted(e.top_logprobs.items()),
                    e.finish_reason] for e in engine.step()]
    results = engine.generate(finishing_mix_copy(requests))
    record += [[r.request_id, list(r.token_ids), r.text, r.finish_reason, r.logprobs] for r in results]
    return record


def finishing_mix_copy(requests: list[GenerationRequest]) -> list[GenerationRequest]:
    return [GenerationRequest(prompt_token_ids=r.prompt_token_ids, adapter=r.adapter, sampling=r.sampling,
                              request_id="again-" + r.request_id) for r in requests]


def build_engine(args) -> tuple[Engine, list[str]]:
    model_dir = tempfile.mkdtemp(prefix="profile_engine_host_")
    write_random_llama(model_dir, vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                       num_layers=args.layers, num_heads=4, num_kv_heads=2, max_positions=1024, seed=0)
    rows = max(int(r) for r in args.rows.split(","))
    engine = Engine.from_pretrained(model_dir, config=EngineConfig(max_num_seqs=rows, max_num_batched_tokens=16384,
                                                                   backend="torch"),
                                    device="cpu", dtype=torch.float32)
    names = []
    ranks = [4, 8, 16]
    for name, r, alpha, factors in random_adapters(engine.model_config, args.adapters, ranks, "cpu",
                                                   torch.float32, seed=1, b_std=0.05):
        engine.add_adapter_weights(name, factors, rank=r, alpha=alpha)
        names.append(name)
    return engine, names


def run_once(engine: Engine, timers: Timers, requests, steps: int, record: list | None) -> list[dict]:
    """Admit and prefill ``requests``, time ``steps`` decode-only steps, abort the rest."""
    for r in requests:
        engine.submit(r)
    while engine.stats()["waiting"] or any(s.num_cached < s.num_tokens - 1 for s in engine.scheduler.running):
        engine.step()
    timers.take()
    per_step = []
    for _ in range(steps):
        t0 = time.perf_counter()
        events = engine.step()
        wall = time.perf_counter() - t0
        inside = timers.take()
        per_step.append({"step": wall, "model": inside.get("model", 0.0), "sampler": inside.get("sampler", 0.0)})
        if record is not None:
            record += [[e.request_id, e.token_id, e.text, e.logprob, e.finish_reason] for e in events]
    for r in requests:
        engine.abort(r.request_id)
    engine.step()
    return per_step


def instrument(engine: Engine, timers: Timers) -> None:
    runner = engine.runner
    runner.forward = timers.wrap("model", runner.forward)
    runner.logits = timers.wrap("model", runner.logits)
    # the eager decode step's device ops on the persistent buffers (inside the graph on a GPU)
    runner._decode_batch = timers.wrap("model", runner._decode_batch)
    # the sampler entry points the engine calls
    for name in ("sample_tokens", "sample_rows", "sample_rows_checked", "token_logprobs"):
        if hasattr(engine_module, name):
            setattr(engine_module, name, timers.wrap("sampler", getattr(engine_module, name)))


def stub_model(engine: Engine, timers: Timers, rows: int, tokens: int, bank: int = 16) -> None:
    """Replace the decoder and LM head by fixed tensors: ``forward`` returns zeros (``tokens``
    rows at most), ``logits`` the next of ``bank`` random ``[rows, V]`` matrices (tokens vary
    from step to step)."""
    cfg = engine.model_config
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(rows, cfg.vocab_size, generator=g) for _ in range(bank)]
    hidden = torch.zeros(tokens, cfg.hidden_size)
    calls = [0]

    def forward(batch):
        return hidden

    def lm_head(h):
        calls[0] += 1
        return logits[calls[0] % bank][:h.shape[0]]

    engine.runner.forward = timers.wrap("model", forward)
    engine.runner.logits = timers.wrap("model", lm_head)


def measure(engine: Engine, timers: Timers, args, adapters: list[str], rows: int, model: str,
            record: list | None) -> dict:
    """``args.repeats`` runs at ``rows`` rows -> min / median over runs of the per-step means."""
    means = []
    for rep in range(args.repeats):
        steps = run_once(engine, timers, make_requests(rows, args, adapters, seed=rows * 100 + rep),
                         args.steps, record)
        n = len(steps)
        mean = {k: sum(s[k] for s in steps) / n for k in ("step", "model", "sampler")}
        mean["host"] = mean["step"] - mean["model"] - mean["sampler"]
        means.append(mean)
    row = {"model": model, "rows": rows, "runs": args.repeats, "steps_per_run": args.steps}
    for k in ("step", "model", "sampler", "host"):
        values = [1e6 * m[k] for m in means]
        row[f"{k}_us_min"], row[f"{k}_us_median"] = min(values), statistics.median(values)
    row["host_us_per_row_median"] = row["host_us_median"] / rows
    return row


def profile(engine: Engine, args, adapters: list[str], rows: int) -> None:
    """cProfile of ``args.steps`` decode steps at ``rows`` rows: top functions by cumulative and own time."""
    prof = cProfile.Profile()
    reqs = make_requests(rows, args, adapters, seed=7)
    for r in reqs:
        engine.submit(r)
    while engine.stats()["waiting"] or any(s.num_cached < s.num_tokens - 1 for s in engine.scheduler.running):
        engine.step()
    prof.enable()
    for _ in range(args.steps):
        engine.step()
    prof.disable()
    for r in reqs:
        engine.abort(r.request_id)
    engine.step()
    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(args.top)
        print(f"--- cProfile of {args.steps} decode steps at {rows} rows, by {key}")
        print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[:8000])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,256", help="batch sizes (running requests), comma-separated")
    ap.add_argument("--model", default="real,stub",
                    help="real (the tiny random model), stub (fixed tensors instead of the forward), or both")
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per run (< new tokens)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--cprofile", action="store_true", help="profile the largest batch (stubbed model if run)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--dump", default=None, help="write every event of the runs to this JSON file")
    ap.add_argument("--out", default=None, help="write the table as JSON to this file")
    args = ap.parse_args(argv)
    if args.steps >= args.new_tokens:
        ap.error("--steps must be below --new-tokens (every timed step decodes every row)")
    models = args.model.split(",")
    if not set(models) <= {"real", "stub"}:
        ap.error("--model: real, stub or real,stub")
    torch.set_num_threads(args.threads)
    engine, adapters = build_engine(args)
    timers = Timers()
    instrument(engine, timers)
    record: list | None = [] if args.dump else None
    rows_list = [int(r) for r in args.rows.split(",")]
    engine.generate(make_requests(8, args, adapters, seed=999))  # warm-up: adapters paged in, code paths run
    if record is not None and "real" in models:
        record += run_mix(engine, finishing_mix(args, adapters))
    table = []
    for model in ("real", "stub"):
        if model not in models:
            continue
        if model == "stub":
            stub_model(engine, timers, max(rows_list), max(rows_list) * (args.prompt + args.new_tokens))
        for rows in rows_list:
            table.append(measure(engine, timers, args, adapters, rows, model, record))
    if args.cprofile:
        profile(engine, args, adapters, rows_list[-1])
    engine.close()
    if args.dump:
        with open(args.dump, "w") as f:
            json.dump(record, f)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "date": time.strftime("%Y-%m-%d"), "table": table}, f, indent=1)
    print(f"CPU, torch {torch.__version__}, {args.threads} torch thread(s); {args.repeats} runs x {args.steps} "
          f"decode steps; us per step, min / median over runs")
    print("| model | rows | step | model forward | sampler | host | host per row |")
    print("|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['model']} | {r['rows']} | {r['step_us_min']:.0f} / {r['step_us_median']:.0f} | "
              f"{r['model_us_min']:.0f} / {r['model_us_median']:.0f} | "
              f"{r['sampler_us_min']:.0f} / {r['sampler_us_median']:.0f} | "
              f"{r['host_us_min']:.0f} / {r['host_us_median']:.0f} | {r['host_us_per_row_median']:.1f} |")
    return {"table": table}


if __name__ == "__main__":
    main()
