"""What Lightning iterates: the resumable training stream (packed ahead in a torchdata thread),
the pipeline strategy's planned windows, the validation/test loaders, and the seal that keeps
Lightning's batch walkers off a ``Microbatch``."""

from __future__ import annotations

from typing import Any, Iterator

from ..data.microbatch import Microbatch
from ..planner.plan import Plan


class PipelineWindow:
    """One planned window for the pipeline strategy: the plan plus its microbatches, packed on
    demand (every stage asks for the same positions) and cached on the target device."""

    def __init__(self, epoch: int, plan: Plan, pack: Any, device: Any = None) -> None:
        self.epoch = epoch
        self.plan = plan
        self._pack = pack
        self._device = device
        self._cache: dict[int, Microbatch] = {}

    def microbatch(self, position: int) -> Microbatch:
        if position not in self._cache:
            mb = self._pack(position)
            self._cache[position] = mb if self._device is None else mb.to(self._device)
        return self._cache[position]

    def to(self, device: Any) -> "PipelineWindow":
        return PipelineWindow(self.epoch, self.plan, self._pack, device)

    def _real_positions(self) -> list[int]:
        return [pos for pos, mb in enumerate(self.plan.microbatches) if not mb.is_noop]

    def sample_lengths(self) -> list[int]:
        """Token counts of this replica's samples in the window (packs what is not packed yet)."""
        return [ref.length for pos in self._real_positions() for ref in self.microbatch(pos).samples]

    @property
    def real_tokens(self) -> int:
        """Non-padding tokens this replica trains in the window (as ``Microbatch.real_tokens``)."""
        return sum(self.sample_lengths())

    @property
    def capacity(self) -> int:
        """Token slots of the window's real microbatches (``TokenThroughput``'s fill denominator)."""
        return self.plan.capacity * len(self._real_positions())


def train_loader(dm: Any):
    """The training loader over ``dm``'s stream: windows under the pipeline strategy, else
    microbatches packed ``dm.prefetch`` ahead in a thread."""
    import torchdata.nodes as tn

    if dm.pipeline:
        return MicrobatchLoader(ResumableStream(dm, windows=True))
    node = tn.IterableWrapper(ResumableStream(dm))
    node = tn.Prefetcher(node, prefetch_factor=max(1, dm.prefetch))
    return MicrobatchLoader(tn.Loader(node))


class MicrobatchLoader:
    """The torchdata loader without its state_dict: resume is by our own (epoch, position),
    which Lightning checkpoints through the data module; Lightning would otherwise try to
    fast-forward the node graph itself."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def __iter__(self):
        return (Sealed(item) for item in self._loader)


class ValLoader:
    """Iterable over this replica's validation microbatches, packed ahead in a thread; the plan
    (which adapters validate) is taken when each validation starts."""

    def __init__(self, dm: Any, kind: str = "val") -> None:
        self.dm = dm
        self.kind = kind

    def __iter__(self):
        import torchdata.nodes as tn

        stream = _ValStream(self.dm, self.kind)
        node = tn.Prefetcher(tn.IterableWrapper(stream), prefetch_factor=max(1, self.dm.prefetch))
        return (Sealed(item) for item in tn.Loader(node))


class _ValStream:
    def __init__(self, dm: Any, kind: str = "val") -> None:
        self.dm = dm
        self.kind = kind

    def __iter__(self) -> Iterator[Microbatch]:
        return self.dm.iter_val_microbatches(self.kind)


class Sealed:
    """A batch that Lightning's collection walkers leave alone until our
    ``transfer_batch_to_device`` opens it. Under ``precision: bf16-true`` / ``16-true`` the
    precision plugin casts every floating tensor of a batch (``convert_input``), which would
    fail on the frozen ``Microbatch`` and would round its fp32 loss denominators to 16 bits."""

    __slots__ = ("item",)

    def __init__(self, item: Any) -> None:
        self.item = item


class ResumableStream:
    """Iterable over the current epoch from the data module's resume point."""

    def __init__(self, dm: Any, windows: bool = False) -> None:
        self.dm = dm
        self.windows = windows

    def __iter__(self) -> Iterator[Microbatch]:
        dm = self.dm
        # Our own (epoch, position), restored from the checkpoint, decide what comes next, not
        # trainer.current_epoch: after a resume from an epoch-end checkpoint Lightning re-enters
        # the finished epoch under its old number and counts it as the next one.
        epoch, start = dm.stream_start()
        if self.windows:
            return dm.iter_windows(epoch, start)
        return dm.iter_microbatches(epoch, start)
