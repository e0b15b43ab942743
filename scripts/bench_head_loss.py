"""LM-head loss: fused linear cross-entropy against the checkpointed chunks (time, peak memory).

For the Llama-3.2-1B (hidden 2048) and Llama-3.1-8B (hidden 4096) shapes, vocab 128256, bf16,
T label rows spread over 4 adapters, it times forward+backward of ``decoder.head_loss_sums``
(final RMSNorm + LM head + cross-entropy summed per adapter, gradient to h only) with
``lm_head_loss="checkpointed"`` and ``"fused"``, and records the peak memory allocated above
the inputs. Sums and input gradients of the two are compared in the same run.

    python scripts/bench_head_loss.py [--tokens 8192] [--chunks 1024,2048] [--out DIR]
    python scripts/bench_head_loss.py --smoke   # tiny shapes, CPU: checks the script runs
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_lorafusion.model import decoder as D  # noqa: E402

SHAPES = {"llama1b": 2048, "llama8b": 4096}
VOCAB = 128256


def problem(hidden, vocab, tokens, device, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    config = D.DecoderConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden, num_layers=1,
                             num_heads=1, num_kv_heads=1, head_dim=2, rms_norm_eps=1e-5)
    params = {"norm": (1.0 + 0.1 * torch.randn(hidden, generator=g)).to(device, dtype),
              "lm_head": (torch.randn(vocab, hidden, generator=g) * hidden**-0.5).to(device, dtype)}
    h = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    labels = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    q = tokens // 4
    segments = ((0, q, 0), (q, 2 * q, 1), (2 * q, 3 * q, 2), (3 * q, tokens, 3))
    weights = torch.tensor([1.0, 0.5, 0.25, 2.0], device=device) / tokens  # 1 / label tokens
    return config, params, h, labels, segments, weights


def step(config, params, h, labels, segments, weights, impl, chunk):
    x = h.detach().requires_grad_(True)
    rows = torch.arange(h.shape[0], device=h.device)
    sums = D.head_loss_sums(params, x, labels, segments, 4, config=config, chunk_size=chunk, label_rows=rows,
                            lm_head_loss=impl)
    (grad,) = torch.autograd.grad((sums * weights).sum(), x)
    return sums.detach(), grad


def measure(fn, device, reps):
    for _ in range(2):
        fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3, 0
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return statistics.median(times), torch.cuda.max_memory_allocated() - base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunks", default="1024,2048")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        device, dtype, shapes, vocab, tokens = torch.device("cpu"), torch.float32, {"tiny": 32}, 200, 50
    else:
        device, dtype, shapes, vocab, tokens = torch.device("cuda"), torch.bfloat16, SHAPES, VOCAB, args.tokens
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"device {name}; torch {torch.__version__}; {now:%Y-%m-%d %H:%M} UTC; command: {' '.join(sys.argv)}")
    rows = []
    for shape, hidden in shapes.items():
        prob = problem(hidden, vocab, tokens, device, dtype)
        ref_sums, ref_grad = step(*prob, "checkpointed", 1024)
        for chunk in [int(c) for c in args.chunks.split(",")]:
            for impl in ("checkpointed", "fused"):
                sums, grad = step(*prob, impl, chunk)
                err_sums = float(((sums - ref_sums).norm() / ref_sums.norm()).item())
                err_grad = float(((grad.float() - ref_grad.float()).norm() / ref_grad.float().norm()).item())
                del sums, grad
                ms, peak = measure(lambda: step(*prob, impl, chunk), device, args.reps)
                row = {"shape": shape, "hidden": hidden, "vocab": vocab, "tokens": tokens, "chunk": chunk,
                       "impl": impl, "ms": ms, "peak_mib": peak / 2**20, "rel_err_sums": err_sums,
                       "rel_err_grad": err_grad}
                rows.append(row)
                print(f"{shape:8s} chunk {chunk:5d} {impl:12s} {ms:8.2f} ms  peak {peak / 2**20:8.0f} MiB  "
                      f"vs checkpointed/1024: sums {err_sums:.1e} grad {err_grad:.1e}", flush=True)
        del prob
    (args.out / "bench_head_loss.json").write_text(json.dumps(
        {"device": name, "torch": torch.__version__, "date": f"{now:%Y-%m-%d %H:%M} UTC",
         "command": " ".join(sys.argv), "rows": rows}, indent=2))
    print("\nshape    chunk  checkpointed ms (MiB)  fused ms (MiB)  speedup")
    for shape in shapes:
        for chunk in [int(c) for c in args.chunks.split(",")]:
            c, f = ({r["impl"]: r for r in rows if r["shape"] == shape and r["chunk"] == chunk}[i]
                    for i in ("checkpointed", "fused"))
            print(f"{shape:8s} {chunk:5d}  {c['ms']:8.2f} ({c['peak_mib']:6.0f})     {f['ms']:8.2f} ({f['peak_mib']:6.0f})"
                  f"  x{c['ms'] / f['ms']:.3f}")


if __name__ == "__main__":
    main()
