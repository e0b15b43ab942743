"""What every benchmark shares: device info, synchronised timing, JSON reports, argument groups.

A benchmark imports this module first (it also puts the repository on ``sys.path``, so the
scripts run from a checkout without installing the package):

    from harness import Report, add_device_args, add_output_args, timed_ms, ...

Timing on CUDA synchronises the device before reading the clock; on the CPU it is plain wall
time. Reports are one JSON file per run under ``--out`` with the device, the date, the torch
version and the arguments beside the numbers (docs/BENCHMARKS.md cites such files).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
for _path in (str(ROOT), str(Path(__file__).resolve().parent)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402


def logger(name: str) -> Callable[[str], None]:
    """A ``log(msg)`` printing ``[name HH:MM:SS] msg`` at once (benchmarks run for minutes)."""
    def log(msg: str) -> None:
        print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", flush=True)
    return log


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def sync(device: torch.device | str | None = None) -> None:
    """Wait for the device's queued work (no-op on the CPU)."""
    device = torch.device(device) if device is not None else None
    if (device is None and torch.cuda.is_available()) or (device is not None and device.type == "cuda"):
        torch.cuda.synchronize(device)


class Stopwatch:
    """Seconds between entering and leaving a ``timer`` block, device work included."""

    seconds: float = 0.0


@contextmanager
def timer(device: torch.device | str | None = None) -> Iterator[Stopwatch]:
    """``with timer(device) as t: ...`` then ``t.seconds``: wall time with the device synchronised
    on entry and on exit."""
    watch = Stopwatch()
    sync(device)
    start = time.perf_counter()
    try:
        yield watch
    finally:
        sync(device)
        watch.seconds = time.perf_counter() - start


def timed_ms(fn: Callable[[], Any], device: torch.device | str | None = None, *, warmup: int = 1,
             reps: int = 5) -> dict[str, float]:
    """``fn()`` run ``warmup`` times, then ``reps`` times each timed alone -> min and median ms."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        with timer(device) as t:
            fn()
        times.append(1e3 * t.seconds)
    times.sort()
    return {"min_ms": times[0], "median_ms": times[len(times) // 2], "reps": reps}


def kernel_ms(fn: Callable[[], Any], *, graph: bool = False) -> float:
    """Median ms of ``fn`` on the GPU by Triton's ``do_bench`` (L2 flushed between runs), or of a
    CUDA graph of it with ``graph`` (no launch overhead)."""
    import triton

    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second a 2 GiB device-to-device copy moves (read + write), best of 5 (CUDA)."""
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    return 2 * src.numel() / best


def graph_us(fn: Callable[[int], Any], copies: int, reps: int) -> float:
    """µs per call of a CUDA graph running ``fn(i)`` for i in range(copies) (e.g. one per layer,
    so each reads cold weights), best of 3 timings of ``reps`` replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(copies):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / (reps * copies))
    del g
    return best


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank ``q``-th percentile (``q`` in 0..100) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * len(ordered))) - 1))]


# dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, of the data sheets; the first match of
# the device name wins (the PCIe H100 before the SXM one)
DENSE_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("GH200", 989.0),
                     ("A100", 312.0), ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0))


def dense_bf16_tflops(device_name: str) -> float | None:
    """The data sheet's dense bf16 peak of a GPU by its name (None: not in the table)."""
    return next((t for key, t in DENSE_BF16_TFLOPS if key in device_name), None)


def device_info(device: torch.device | str) -> dict[str, Any]:
    """Where and when the numbers were taken: date (UTC), device name and memory, versions."""
    device = torch.device(device)
    info: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
                            "device": str(device), "device_name": "cpu"}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device_name=props.name, device_memory_gib=props.total_memory / 2**30,
                    cuda=torch.version.cuda, dense_bf16_tflops=dense_bf16_tflops(props.name))
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            pass
    return info


def add_device_args(ap: argparse.ArgumentParser, *, dtype: str = "bfloat16") -> None:
    """``--device`` (default: cuda when present) and ``--dtype`` (a torch dtype name)."""
    ap.add_argument("--device", default=default_device(), help="torch device (default: cuda if available)")
    ap.add_argument("--dtype", default=dtype, help="torch dtype name of the model (default: %(default)s)")


def add_output_args(ap: argparse.ArgumentParser) -> None:
    """``--out DIR``: where the JSON report (and any figures) go; none when omitted."""
    ap.add_argument("--out", default=None, help="directory for the JSON report (default: print only)")


def add_layer_shape_args(ap: argparse.ArgumentParser) -> None:
    """``--hidden --intermediate --heads --kv-heads --head-dim``: one decoder layer's shape, the
    Llama-3.1-8B layer by default."""
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)


def dtype_of(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``, with a clear error for a wrong name."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise SystemExit(f"--dtype {name!r} is not a torch dtype; use e.g. bfloat16, float16 or float32")
    return dtype


def comma_list(allowed: tuple[str, ...] | None = None, *, cast: Callable[[str], Any] = str):
    """argparse ``type``: a non-empty comma list, each value one of ``allowed`` (when given)."""
    def parse(text: str) -> list:
        values = [v for v in text.split(",") if v]
        bad = [v for v in values if allowed is not None and v not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{text!r}: a comma list of {', '.join(allowed or ('values',))}")
        return [cast(v) for v in values]
    return parse


def write_json(out_dir: str | os.PathLike | None, name: str, data: Any) -> Path | None:
    """``data`` as ``out_dir/name`` (indented JSON; values JSON cannot hold as strings)."""
    if not out_dir:
        return None
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path


class Report(dict):
    """A benchmark's results: ``device_info`` and the arguments first, then one entry per
    measurement. ``measure(name, fn)`` records ``fn()`` under ``name`` or, when it raises, the
    error under ``errors`` (the other measurements still run), and rewrites the JSON file
    after each, so a run cut short keeps what it measured. ``slim`` picks what is written (the
    report in memory may hold more), ``describe`` the line logged per measurement."""

    def __init__(self, device: torch.device | str, args: argparse.Namespace | None, *, out: str | None = None,
                 file_name: str = "report.json", log: Callable[[str], None] = print,
                 slim: Callable[[dict], dict] | None = None, describe: Callable[[Any], str] = str):
        super().__init__(device_info(device))
        self["args"] = vars(args) if args is not None else {}
        self["errors"] = {}
        self.out, self.file_name, self.log, self.slim, self.describe = out, file_name, log, slim, describe

    def measure(self, name: str, fn: Callable[[], Any]) -> Any:
        try:
            self[name] = fn()
            self.log(f"{name}: {self.describe(self[name])}")
        except Exception as exc:  # one broken measurement must not lose the others
            traceback.print_exc()
            self["errors"][name] = f"{type(exc).__name__}: {exc}"
        self.save()
        return self.get(name)

    def save(self) -> Path | None:
        return write_json(self.out, self.file_name, self.slim(dict(self)) if self.slim else dict(self))
