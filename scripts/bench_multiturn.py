"""A chat's next turn through the prefix cache: turn 2 reuses turn 1's prompt pages and the pages
its answer filled while decoding, against prefilling turn 2 whole.

A random-weight Llama of a real shape (``--shape``, as scripts/bench_generation.py builds it)
and ``--adapters`` random LoRA adapters of mixed ranks. ``--requests`` conversations, each
under a random adapter: turn 1 is a random prompt of ``--prompt-min``..``--prompt-max`` tokens
and generates ``--new-tokens`` greedily (EOS ignored); turn 2's prompt is turn 1's prompt +
its answer + ``--user-tokens`` new random tokens, and generates ``--new-tokens`` too. Each
turn's requests are submitted together (``Engine.generate``). Two fresh engines over the same
weights run the same conversations: prefix caching on, then off. Reported per engine and
turn: wall time, generated tok/s, TTFT mean / p50 / p99, steps, prefix tokens reused, of
those how many lie past turn 1's prompt pages (filled while decoding); and whether turn 2's
tokens are the same in both runs (in bf16 two correct computations may drift after a near
tie; in fp32 they must be equal).

    PYTHONPATH=. python3 scripts/bench_multiturn.py --shape 1b --out $OUT
    PYTHONPATH=. python3 scripts/bench_multiturn.py --shape tiny --device cpu --dtype float32 --requests 6 \
        --adapters 2 --prompt-min 8 --prompt-max 24 --new-tokens 8 --user-tokens 5 --out /tmp/bm
"""

from __future__ import annotations

import argparse
import gc
import random

from harness import add_device_args, add_output_args, device_info, dtype_of, logger, percentile, write_json

import torch  # noqa: E402
from bench_generation import add_trace_args, build_workload, make_requests, timed_generate  # noqa: E402

from lightning_lorafusion.serving import Engine, EngineConfig, GenerationRequest  # noqa: E402


log = logger("bench_multiturn")


def run_turn(engine: Engine, requests: list[GenerationRequest], device: torch.device) -> tuple[dict, list]:
    """Generate ``requests`` together; -> (numbers, results)."""
    results, wall, before, after = timed_generate(engine, requests, device)
    ttft = [r.timings["ttft_s"] for r in results]
    generated = sum(len(r.token_ids) for r in results)
    return {"requests": len(results), "prompt_tokens": sum(len(r.prompt_token_ids) for r in results),
            "generated_tokens": generated, "wall_s": wall, "tokens_per_s": generated / wall,
            "ttft_mean_s": sum(ttft) / len(ttft), "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99), "steps": after["steps_total"] - before["steps_total"],
            "prefix_hits": after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"],
            "prefix_tokens_reused": after["prefix_tokens_reused_total"] - before["prefix_tokens_reused_total"],
            "preemptions": after["preemptions_total"] - before["preemptions_total"]}, results


def conversation(engine: Engine, turn1: list[GenerationRequest], user_tokens: list[list[int]],
                 device: torch.device) -> dict:
    """Both turns of every conversation on ``engine``."""
    first, answers = run_turn(engine, turn1, device)
    turn2 = [GenerationRequest(prompt_token_ids=list(r.prompt_token_ids) + list(a.token_ids) + user,
                               adapter=r.adapter, sampling=r.sampling, request_id=r.request_id + "-t2")
             for r, a, user in zip(turn1, answers, user_tokens)]
    second, replies = run_turn(engine, turn2, device)
    page = engine.pool.page_size
    prompt_pages = sum(len(r.prompt_token_ids) // page * page for r in turn1)
    second["reused_past_turn1_prompt_pages"] = max(0, second["prefix_tokens_reused"] - prompt_pages)
    second["turn1_prompt_page_tokens"] = prompt_pages
    return {"turn1": first, "turn2": second, "turn2_tokens": [list(r.token_ids) for r in replies]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trace_args(ap, new_tokens=256)
    ap.add_argument("--user-tokens", type=int, default=64, help="new tokens of turn 2's prompt after turn 1's answer")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-batched-tokens", type=int, default=16384)
    ap.add_argument("--memory-fraction", type=float, default=0.6)
    ap.add_argument("--backend", default="auto")
    add_device_args(ap)
    add_output_args(ap)
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), dtype_of(args.dtype)
    report: dict = {**device_info(device), "args": vars(args)}

    shape, model, tokenizer, config, params, adapters = build_workload(args, device, dtype)
    names = [a[0] for a in adapters]
    turn1 = make_requests(args.requests, shape["vocab_size"], args.prompt_min, args.prompt_max, names,
                          args.new_tokens, seed=4)
    rng = random.Random(5)
    user = [[rng.randrange(4, shape["vocab_size"]) for _ in range(args.user_tokens)] for _ in turn1]

    for caching in (True, False):
        name = "prefix_caching_on" if caching else "prefix_caching_off"
        engine = Engine(config, params, tokenizer,
                        EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens,
                                     gpu_memory_fraction=args.memory_fraction, backend=args.backend,
                                     page_size=args.page_size, cpu_pool_mib=1024, prefix_caching=caching),
                        device=device, dtype=dtype)
        for adapter, r, alpha, factors in adapters:
            engine.add_adapter_weights(adapter, factors, rank=r, alpha=alpha)
        warm = make_requests(min(8, len(names)), shape["vocab_size"], args.prompt_min, args.prompt_min + 16, names,
                             4, seed=6)
        engine.generate(warm)  # compiles and pages adapters in; its pages share nothing with the conversations
        report[name] = conversation(engine, turn1, user, device)
        report[name]["pool_pages"] = engine.pool.num_pages
        log(f"{name}: turn 1 {report[name]['turn1']['wall_s']:.2f} s, turn 2 {report[name]['turn2']['wall_s']:.2f} s")
        engine.close()
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    on, off = report["prefix_caching_on"]["turn2_tokens"], report["prefix_caching_off"]["turn2_tokens"]
    report["turn2_identical"] = sum(a == b for a, b in zip(on, off))
    write_json(args.out, f"bench_multiturn_{args.shape}.json",
               {k: ({kk: vv for kk, vv in v.items() if kk != "turn2_tokens"} if isinstance(v, dict) else v)
                for k, v in report.items()})

    print(f"\n{'run':<20} {'turn':>4} {'prompt tok':>10} {'wall s':>8} {'tok/s':>8} {'TTFT mean':>9} "
          f"{'p50':>7} {'p99':>7} {'reused':>8} {'decoded':>8}")
    for name in ("prefix_caching_on", "prefix_caching_off"):
        for turn in ("turn1", "turn2"):
            r = report[name][turn]
            print(f"{name:<20} {turn[-1]:>4} {r['prompt_tokens']:>10} {r['wall_s']:>8.2f} {r['tokens_per_s']:>8.0f} "
                  f"{r['ttft_mean_s']:>9.3f} {r['ttft_p50_s']:>7.3f} {r['ttft_p99_s']:>7.3f} "
                  f"{r['prefix_tokens_reused']:>8} {r.get('reused_past_turn1_prompt_pages', ''):>8}")
    print(f"turn 2 tokens identical with and without prefix caching: {report['turn2_identical']} of {len(on)}")
    return report


if __name__ == "__main__":
    main()
