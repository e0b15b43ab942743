"""The decode LoRA's expand kernels compiled for a GPU without one: registers, spills, shared memory.

Each launch of ``VARIANTS`` (``lora_gather``'s expand into a half-precision output and into the
fp32 delta beside, SwiGLU's LoRA rows, the RoPE + KV epilogue; per-row, and with the hybrid
expands' group programs, ``lora_gather.HYBRID_MIN_ROWS``) is compiled by Triton for ``--arch``
(front end, then ptxas; nothing runs) at the 8B decode shape's constexprs, with ``--stages``
pipelining stages, and its ptxas report read: registers per thread, spill bytes, shared memory.
A type error only the compiler sees (the interpreter runs any shape) fails here, and the
registers say what a path costs the programs that share its launch:

    PYTHONPATH=. python3 scripts/compile_decode_lora.py --stages 1,3 --out $OUT

Run it without ``TRITON_INTERPRET`` (the interpreter builds no compilable kernels).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import os
import re
import tempfile

from harness import add_output_args, comma_list, logger, write_json

log = logger("compile_decode_lora")

# launch -> (kernel name, pointer dtypes over the defaults, constexprs); "hyb": the hybrid's group programs
COMMON = {"MAX_R": 128, "BLOCK_R": 16, "PRELOAD": False, "GDC": False, "BLOCK_M": 16, "DOT_PRECISION": "tf32",
          "HALF_S": False}  # (and ``--group-n``: GROUP_N where the kernel takes it)
VARIANTS = {
    "expand": ("_lora_expand_kernel", {}, {"ACCUMULATE": True, "BLOCK_KB": 32, "BLOCK_N": 256}),
    "expand_beside": ("_lora_expand_kernel", {"out_ptr": "*fp32"}, {"ACCUMULATE": False, "BLOCK_KB": 32,
                                                                  "BLOCK_N": 256}),
    "swiglu": ("_swiglu_kernel", {}, {"HAS_LORA": True, "BLOCK_KB": 8, "BLOCK_N": 256, "AHEAD": False,
                                      "NX_BLOCK_R": 16, "PAIR": True}),
    "rope_kv": ("_rope_kv_kernel", {}, {"HQ": 32, "HKV": 8, "HALF": 64, "BLOCK_HALF": 64, "ROT_HALF": 64,
                                        "BLOCK_ROT": 64, "PASS": 0, "BLOCK_PASS": 1, "HAS_LORA": True,
                                        "BLOCK_KB": 8, "PAIR": True}),
}
POINTERS = {"b_off_ptr": "*i64", "a_off_ptr": "*i64", "nx_a_ptr": "*i64", "rank_ptr": "*i32", "nx_rank_ptr": "*i32",
            "groups_ptr": "*i32", "scale_ptr": "*fp32", "part_ptr": "*fp32", "nx_part_ptr": "*fp32",
            "page_ptr": "*i64", "slot_ptr": "*i64"}


def kernels() -> dict:
    from lightning_lorafusion.kernels.lora_epilogues import _rope_kv_kernel, _swiglu_kernel
    from lightning_lorafusion.kernels.lora_row_kernels import _lora_expand_kernel
    return {k.fn.__name__: k for k in (_lora_expand_kernel, _swiglu_kernel, _rope_kv_kernel)}


def compile_one(kernel, pointers: dict, consts: dict, arch: int, warps: int, stages: int) -> dict:
    """Compile ``kernel`` (bf16 tensors unless ``pointers`` says otherwise, 32-bit scalars) ->
    {registers, spill bytes, shared bytes}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    consts = {n: v for n, v in consts.items() if n in names}
    signature = {n: "constexpr" if n in consts else (pointers.get(n, "*bf16") if n.endswith("_ptr") else "i32")
                 for n in names}
    src = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": warps, "num_stages": stages})
    text = out.getvalue()
    regs = re.findall(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores", text)
    return {"registers": int(regs[-1]) if regs else None, "spill_store_bytes": int(spills[-1]) if spills else None,
            "shared_bytes": compiled.metadata.shared}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=comma_list(cast=int), default=[1, 3])
    ap.add_argument("--group-n", type=comma_list(cast=int), default=[64, 256],
                    help="the hybrid's group programs' columns per dot (lora_gather.HYBRID_GROUP_N)")
    ap.add_argument("--variants", type=comma_list(tuple(VARIANTS)), default=list(VARIANTS))
    add_output_args(ap)
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("unset TRITON_INTERPRET: the interpreter builds no compilable kernels")
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # (ptxas's report, printed while compiling)
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="compile_decode_lora_")  # (a cache hit runs no ptxas)
    found = kernels()
    rows = []
    for name in args.variants:
        kernel, pointers, consts = VARIANTS[name]
        takes_n = "GROUP_N" in inspect.signature(found[kernel].fn).parameters
        builds = [(False, None)] + [(True, n) for n in (args.group_n if takes_n else [None])]
        for hybrid, group_n in builds:
            for stages in args.stages if hybrid else args.stages[:1]:  # (no loop to stage without the group path)
                meta = {**COMMON, **consts, "HYBRID": hybrid, **({"GROUP_N": group_n} if group_n else {})}
                res = compile_one(found[kernel], {**POINTERS, **pointers}, meta, args.arch, args.warps, stages)
                rows.append({"launch": name, "hybrid": hybrid, "group_n": group_n, "stages": stages, **res})
                log(f"{name} hybrid={hybrid} group_n={group_n} stages={stages}: {res}")
    lines = [f"sm_{args.arch}, {args.warps} warps",
             "| launch | hybrid | group columns | stages | registers | spill stores B | shared B |", "|" + "---|" * 7]
    lines += [f"| {r['launch']} | {r['hybrid']} | {r['group_n'] or '-'} | {r['stages']} | {r['registers']} "
              f"| {r['spill_store_bytes']} | {r['shared_bytes']} |" for r in rows]
    print("\n".join(lines))
    write_json(args.out, "compile_decode_lora.json", {"args": vars(args), "rows": rows})
    return {"rows": rows}


if __name__ == "__main__":
    main()
