"""The prefill LoRA kernels of two copies of ``kernels/`` side by side: same compiled code, same
outputs, same time (a refactor of the Triton helpers must change none of them).

``--before DIR``: a directory holding an earlier ``kernels/`` package (``git archive REV
lightning_lorafusion/kernels | tar -x -C DIR --strip-components=1``), loaded as the package
``kernels_before`` beside this checkout's ``lightning_lorafusion.kernels`` (the package imports
nothing outside itself). Each case (one 8B layer's four groups, ``bench_segment_forms``' tables)
runs every form of ``FORMS`` with both copies on the same inputs: the PTX of each launched
kernel (its instructions; names, line records and debug sections left out) compared, the outputs
compared bit for bit, and the four groups timed as CUDA graph replays, before / after / before /
after (medians). On the CPU (``TRITON_INTERPRET=1``) only the outputs are compared.

    PYTHONPATH=. python3 scripts/compare_kernel_builds.py --before kernels_before --out $OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import os
import re
import sys
import time

from harness import Report, add_device_args, add_output_args, comma_list, dtype_of, logger

import torch  # noqa: E402

import bench_segment_forms as bsf  # noqa: E402

log = logger("compare_kernel_builds")
# form -> (module, launches function) of ``kernels/``; each returns [(kernel, grid, args, meta)]
FORMS = ("segments", "splitk", "items", "segments-add", "splitk-add")


def load_before(path: str):
    """``path/kernels`` (or ``path`` itself, when it holds ``__init__.py``) as package ``kernels_before``."""
    pkg = path if os.path.exists(os.path.join(path, "__init__.py")) else os.path.join(path, "kernels")
    spec = importlib.util.spec_from_file_location("kernels_before", os.path.join(pkg, "__init__.py"),
                                                  submodule_search_locations=[pkg])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kernels_before"] = mod
    spec.loader.exec_module(mod)
    return mod


def launches_of(pkg: str, form: str, x, lora, parts) -> list[tuple]:
    segments = importlib.import_module(f"{pkg}.lora_segments")
    splitk = importlib.import_module(f"{pkg}.lora_splitk")
    accumulate = form.endswith("-add")
    base = form.split("-")[0]
    if base == "items":
        return splitk.splitk_launches(x, lora, parts, accumulate=accumulate)
    return segments._segment_launches(x, lora, parts, n_blocks=None, split_k=None, warps=(None, None),
                                      accumulate=accumulate, splitk=base == "splitk")


def ptx_digest(compiled) -> str:
    """The instructions of a compiled kernel's PTX (names, ``.loc`` / ``.file`` records, labels of
    line ranges and the debug sections left out), hashed."""
    text = compiled.asm["ptx"].split(".section\t.debug")[0]
    lines = []
    for line in text.splitlines():
        line = re.sub(r"//.*", "", line).strip()
        if line and not line.startswith((".loc", ".file", "$L__tmp")):
            lines.append(re.sub(r"^\.(visible\s+)?\.entry\s+\S+\(", ".entry (", line))
    return hashlib.sha1("\n".join(lines).encode()).hexdigest()[:16]


def run_case(args, rows: int, mix: str, form: str, dev, dtype) -> dict:
    groups, loras, inputs, outs, info = bsf.build_case(args, rows, mix, dev, dtype)
    base = {name: torch.randn(outs[name].shape, device=dev).to(dtype) for name, _, _ in groups}
    counters = {name: torch.zeros(loras[name].tiles.shape[1] * len(ns), dtype=torch.int32, device=dev)
                for name, ns, _ in groups}
    res = {"rows": rows, "mix": mix, "form": form}
    digests, results, runs = {}, {}, {}
    for pkg in ("kernels_before", "lightning_lorafusion.kernels"):
        plans = []
        for name, ns, _ in groups:
            lora = dataclasses.replace(loras[name], counters=counters[name])
            if rows > args.live_max_rows:
                lora = dataclasses.replace(lora, live=None)
            plans.append(launches_of(pkg, form, inputs[name], lora, list(outs[name].split(list(ns), dim=1))))

        def run(plans=plans):
            for plan in plans:
                for kernel, grid, a, meta in plan:
                    kernel[grid](*a, **meta)

        for name, _, _ in groups:
            outs[name].copy_(base[name])
        compiled = []
        for plan in plans:
            for kernel, grid, a, meta in plan:
                compiled.append(kernel[grid](*a, **meta))
        results[pkg] = {name: outs[name].clone() for name, _, _ in groups}
        if dev.type == "cuda":
            digests[pkg] = [ptx_digest(c) for c in compiled]
        runs[pkg] = run
    res["outputs_equal"] = all(torch.equal(results["kernels_before"][n], results["lightning_lorafusion.kernels"][n])
                               for n, _, _ in groups)
    if dev.type == "cuda":
        res["ptx_equal"] = digests["kernels_before"] == digests["lightning_lorafusion.kernels"]
        res["kernels"] = len(digests["kernels_before"])
        import triton

        times = {pkg: [] for pkg in runs}
        for _ in range(2):
            for pkg, run in runs.items():
                times[pkg].append(triton.testing.do_bench_cudagraph(run, rep=args.rep, return_mode="median"))
        res["before_ms"], res["after_ms"] = (sorted(times[p])[0] for p in runs)
        res["ratio"] = res["after_ms"] / res["before_ms"]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_args(ap)
    add_output_args(ap)
    ap.add_argument("--before", required=True, help="a directory holding the earlier kernels/ package")
    ap.add_argument("--shape", choices=list(bsf.SHAPES), default="8b")
    ap.add_argument("--rows", type=comma_list(cast=int), default=[256, 2048])
    ap.add_argument("--mixes", type=comma_list(), default=["8x16", "64xmix"])
    ap.add_argument("--forms", type=comma_list(FORMS), default=list(FORMS))
    ap.add_argument("--request-len", type=int, default=256)
    ap.add_argument("--graph-tables", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--live-max-rows", type=int, default=4096, help="tables past this many rows drop the live count")
    ap.add_argument("--rep", type=int, default=20, help="do_bench_cudagraph's rep (ms)")
    ap.add_argument("--deadline", type=float, default=120.0)
    args = ap.parse_args(argv)
    dev, dtype = torch.device(args.device), dtype_of(args.dtype)
    load_before(args.before)
    report = Report(dev, args, out=args.out, log=log)
    report["cases"] = []
    t0 = time.monotonic()
    for mix in args.mixes:
        for rows in args.rows:
            for form in args.forms:
                if time.monotonic() - t0 > args.deadline:
                    break
                res = run_case(args, rows, mix, form, dev, dtype)
                log(str(res))
                report["cases"].append(res)
                report.save()
    print("| rows | mix | form | kernels | PTX equal | outputs equal | before ms | after ms | after / before |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in report["cases"]:
        print(f"| {c['rows']} | {c['mix']} | {c['form']} | {c.get('kernels', '-')} | {c.get('ptx_equal', '-')} "
              f"| {c['outputs_equal']} | {c.get('before_ms', float('nan')):.4f} | {c.get('after_ms', float('nan')):.4f} "
              f"| {c.get('ratio', float('nan')):.3f} |")
    ok = all(c["outputs_equal"] and c.get("ptx_equal", True) for c in report["cases"])
    print("all equal" if ok else "DIFFERENCES")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
