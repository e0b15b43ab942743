"""A step's host tables in one buffer, copied to the device in one copy.

A step with prefill rows builds a dozen small host tables (token ids, positions, KV slots, the
prefill rows' LoRA tiles and adapter offsets, the decode rows' page table...). Copied one by one
from pageable memory, each copy is synchronous with the host: the driver stages it and may wait
for the stream, so the device idles between them while the host builds the next table.
``StagedTables`` packs them into one host buffer (pinned on CUDA, reused: one per slot of
``slots``, taken in turn, each reused only once its last copy is done) and issues one
asynchronous copy into a device buffer of the same slot; the tables are views into it. On the
CPU the same packing runs over a fresh buffer per upload (nothing to overlap; the logic is the
one tested).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

ALIGN = 16  # bytes: every table starts at a multiple (any dtype's view is aligned)

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.bool: np.bool_}


class StagedTables:
    """``add`` host tables (lists, numpy arrays or CPU tensors), then ``upload`` -> device tensors
    of the dtypes and shapes given, in the order added. ``uploads`` counts the copies issued."""

    def __init__(self, device: torch.device | str, slots: int = 3) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._host: list[torch.Tensor | None] = [None] * slots
        self._dev: list[torch.Tensor | None] = [None] * slots
        self._done: list[torch.cuda.Event | None] = [None] * slots
        self._slot = 0
        self._parts: list[tuple[np.ndarray, torch.dtype, tuple[int, ...]]] = []
        self.uploads = 0

    def add(self, values, dtype: torch.dtype, shape: Sequence[int] | None = None) -> int:
        """Queue one table; -> its index in ``upload``'s result. ``shape``: the device tensor's
        (default: the values' own, 1-D for a list)."""
        if isinstance(values, torch.Tensor):
            values = values.numpy()
        arr = np.ascontiguousarray(values, dtype=_NUMPY[dtype])
        self._parts.append((arr, dtype, tuple(arr.shape) if shape is None else tuple(shape)))
        return len(self._parts) - 1

    def upload(self) -> list[torch.Tensor]:
        """One copy of every queued table to the device (asynchronous on CUDA) -> their device
        tensors; the queue is emptied."""
        parts, self._parts = self._parts, []
        offsets, total = [], 0
        for arr, _, _ in parts:
            offsets.append(total)
            total += -(-arr.nbytes // ALIGN) * ALIGN
        host, dev = self._buffers(max(total, ALIGN))
        view = host.numpy()
        for (arr, _, _), off in zip(parts, offsets):
            view[off:off + arr.nbytes] = arr.reshape(-1).view(np.uint8)
        if dev is not host:
            dev[:total].copy_(host[:total], non_blocking=self.cuda)
            if self.cuda:
                done = self._done[self._slot] = torch.cuda.Event()
                done.record()
        self.uploads += 1
        return [dev[off:off + arr.nbytes].view(dtype).view(shape)
                for (arr, dtype, shape), off in zip(parts, offsets)]

    def _buffers(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This upload's host and device buffers of at least ``nbytes``: the next slot's (after
        its previous copy is done), grown as needed; on the CPU one fresh buffer for both."""
        if self.device.type == "cpu":
            buf = torch.empty(nbytes, dtype=torch.uint8)
            return buf, buf
        self._slot = (self._slot + 1) % len(self._host)
        i = self._slot
        if self._done[i] is not None:  # its host buffer may still be read by a queued copy
            self._done[i].synchronize()
            self._done[i] = None
        if self._host[i] is None or self._host[i].numel() < nbytes:
            size = max(nbytes, 2 * (self._host[i].numel() if self._host[i] is not None else 4096))
            self._host[i] = torch.empty(size, dtype=torch.uint8, pin_memory=self.cuda)
            # (the old device buffer is freed on this stream: kernels queued on it still read it first)
            self._dev[i] = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self._host[i], self._dev[i]


class SeparateTables:
    """``StagedTables``' interface, the way before it: each table copied to the device as it is
    added, from its own (pageable) host tensor (``EngineTuning.host_tables="separate"``)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._out: list[torch.Tensor] = []
        self.uploads = 0

    def add(self, values, dtype: torch.dtype, shape: Sequence[int] | None = None) -> int:
        if isinstance(values, torch.Tensor):
            t = values.to(dtype)
        elif isinstance(values, np.ndarray):
            t = torch.from_numpy(np.ascontiguousarray(values, dtype=_NUMPY[dtype]))
        else:
            t = torch.tensor(values, dtype=dtype)
        if shape is not None:
            t = t.view(tuple(shape))
        self._out.append(t.to(self.device, non_blocking=True))
        self.uploads += 1
        return len(self._out) - 1

    def upload(self) -> list[torch.Tensor]:
        out, self._out = self._out, []
        return out


def make_tables(mode: str, device: torch.device | str) -> "StagedTables | SeparateTables":
    """The host tables' path of ``EngineTuning.host_tables``: "packed" or "separate"."""
    if mode == "packed":
        return StagedTables(device)
    if mode == "separate":
        return SeparateTables(device)
    raise ValueError(f"host_tables={mode!r}; allowed: 'packed', 'separate'")
