"""The frozen input embedding table kept in pinned host memory and read in place by the GPU.

A frozen base's embedding lookup reads only the rows of a microbatch's tokens: at Llama 3 8B's
shape the table is ``[128256, 4096]`` bf16, 1 GiB of device memory, of which a 4,096-token
microbatch reads 32 MiB. With unified virtual addressing (every 64-bit CUDA process), pinned host
memory allocated through the CUDA runtime (what ``Tensor.pin_memory`` does) is readable by
kernels at its host address, so a CUDA tensor viewing it serves ``F.embedding`` as it is: the
gather's kernel reads the rows over the host link, inside CUDA graphs too (the address never
changes). Nothing else may read the table that way: a tied LM head reads all of it per
microbatch, so a tied table stays on the device.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

# __cuda_array_interface__ has no bfloat16 type string: the view is made over 16-bit integers of
# the same bytes, then reinterpreted
_SAME_BYTES = {torch.bfloat16: (torch.int16, "<i2"), torch.float16: (torch.int16, "<i2"),
               torch.float32: (torch.int32, "<i4")}


class _HostArray:
    """A pinned host tensor presented through ``__cuda_array_interface__`` (it keeps the tensor
    alive as long as any CUDA view of it lives: torch holds this object in the view's deleter)."""

    def __init__(self, host: torch.Tensor, typestr: str) -> None:
        self.host = host
        self.__cuda_array_interface__ = {"shape": tuple(host.shape), "typestr": typestr,
                                         "data": (host.data_ptr(), False), "version": 2, "strides": None}


def host_mapped(table: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A copy of ``table`` in pinned host memory, returned as a CUDA tensor on ``device`` that
    views it (read-only use: a gather). ``device`` must be a CUDA device."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"host_mapped needs a CUDA device; got {device}")
    if table.dtype not in _SAME_BYTES:
        raise ValueError(f"host_mapped supports {sorted(map(str, _SAME_BYTES))}; got {table.dtype}")
    as_int, typestr = _SAME_BYTES[table.dtype]
    host = torch.empty(table.shape, dtype=table.dtype, pin_memory=True)
    host.copy_(table.detach())
    with torch.cuda.device(device):
        view = torch.as_tensor(_HostArray(host.view(as_int), typestr), device=device)
    if view.data_ptr() != host.data_ptr():  # zero-copy or nothing: a copy would put the table back on the GPU
        raise RuntimeError("the CUDA view of the pinned embedding table is a copy; this torch cannot map it")
    view = view.view(table.dtype)
    if table.is_cuda and table.shape[0]:  # a kernel reads the host rows as the gather will
        rows = torch.tensor([0, table.shape[0] - 1], device=device)
        if not torch.equal(view.index_select(0, rows), table.detach().index_select(0, rows)):
            raise RuntimeError("the GPU reads other values from the pinned embedding table than it holds")
    return view


def embedding_on_host(params: Mapping[str, Any]) -> dict[str, Any]:
    """The pytree with its input embedding table moved to pinned host memory and read in place
    (module docstring); a shallow copy, every other tensor shared. The table must be a plain
    CUDA tensor, not tied to the LM head; the caller drops its own references to the old table
    to free its device memory."""
    table = params["embed"]
    if not isinstance(table, torch.Tensor):
        raise ValueError("embedding_on_host needs a plain 16- or 32-bit embedding table (not an FP8 one)")
    if table is params.get("lm_head"):
        raise ValueError("embedding_on_host: the table is tied to the LM head, which reads all of it per "
                         "microbatch; keep a tied table on the device")
    if not table.is_cuda:
        raise ValueError(f"embedding_on_host needs the table on a CUDA device; it is on {table.device}")
    return {**params, "embed": host_mapped(table, table.device)}
