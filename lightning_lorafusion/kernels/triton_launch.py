"""Triton launches with grid and compile-time arguments fixed once, cheap to repeat per call.

``kernel[grid](*args, **constexprs)`` re-derives on every call what specializes the compiled
kernel (types, 16-byte alignment of pointers, divisibility of integers), builds a cache key from
it and looks the kernel up. With 6-10 launches per fused LoRA projection group that host work
can exceed the GPU work of a whole layer at small shapes. A ``CachedLaunch`` is built once per
launch plan (the shapes, hence every integer argument, are fixed by the plan): its first call
goes through Triton's dispatch, later calls hand the arguments straight to the compiled kernel.

What may still change between calls of one plan is the tensors' addresses, so the 16-byte
alignment of every tensor argument is part of the lookup; integer arguments that do change per
call (the dropout offset's hash) must be declared ``do_not_specialize`` in the kernel.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

@functools.lru_cache(maxsize=8)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device, off_cuda: int) -> int:
    """The SMs of ``device``, a CUDA device (cached per index); ``off_cuda`` for any other device
    (the interpreter's stand-in count, which launch grids are sized by on the CPU)."""
    if device.type != "cuda":
        return off_cuda
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _compiled_kernel_type():
    try:
        from triton.compiler import CompiledKernel
    except ImportError:  # pragma: no cover - every Triton 3.x has it
        return None
    return CompiledKernel


class CachedLaunch:
    """One kernel launch: ``kernel``, ``grid`` and its constexpr/option keywords fixed.

    Call it with the runtime arguments only, in the kernel's parameter order (all constexpr
    parameters must come after them, as in every kernel of this package)."""

    __slots__ = ("kernel", "grid", "keywords", "tail", "tensor_pos", "runners")

    def __init__(self, kernel: Any, grid: tuple[int, ...], *, num_warps: int, num_stages: int,
                 **constexprs: Any) -> None:
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.keywords = dict(constexprs, num_warps=num_warps, num_stages=num_stages)
        names = getattr(kernel, "arg_names", None)
        # the constexpr values in parameter order, appended to the runtime arguments when the
        # compiled kernel is called directly (its launcher takes every parameter, constexprs
        # included, and drops the constexprs itself)
        self.tail = None
        if names is not None and set(constexprs) <= set(names):
            n_runtime = len(names) - len(constexprs)
            if set(names[n_runtime:]) == set(constexprs):
                self.tail = tuple(constexprs[n] for n in names[n_runtime:])
        self.tensor_pos: tuple[int, ...] | None = None
        self.runners: dict[int, Any] = {}

    def __call__(self, *args: Any) -> None:
        pos = self.tensor_pos
        if pos is None:
            pos = self.tensor_pos = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        key = 0
        for bit, i in enumerate(pos):
            if args[i].data_ptr() & 15:
                key |= 1 << bit
        runner = self.runners.get(key)
        if runner is not None:
            try:
                runner(*args, *self.tail)
                return
            except TypeError:  # a Triton whose launcher takes another argument list: dispatch
                self.tail = None
                self.runners.clear()
        compiled = self.kernel[self.grid](*args, **self.keywords)
        kernel_type = _compiled_kernel_type()
        if self.tail is not None and kernel_type is not None and isinstance(compiled, kernel_type):
            self.runners[key] = compiled[self.grid]
