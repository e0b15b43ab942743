"""Tensors that are cheap functions of tensors kept anyway, rebuilt in backward instead of kept.

- The pre-norms (``DecoderOptions.norm_recompute``): the attention and MLP input norms
  ``x = norm(h)`` hand ``x [T, H]`` to the projections after them, whose LoRA terms keep it for
  their ``dA``; the norm itself already keeps its input ``h`` (and the fp32 ``1/rms``) for its
  own gradient, so ``x`` is a second ``[T, H]`` copy of what ``h`` determines.
- GQA on a FlashAttention without native grouped heads (``attention._flash_varlen``): ``k`` and
  ``v`` repeated to the query heads are kept by the attention's backward; rebuilt from the
  ``[T, Hkv, D]`` originals they cost ``Hkv / Hq`` of that.

Inside ``rebuilt_in_backward(x, rebuild, source)`` every tensor saved for backward that is ``x``
(or a view of it) is saved as a token, and backward calls ``rebuild(source)`` when it unpacks
one: the forward's values bit for bit for the same function on the same input (a compiled
residual add + norm may normalise the unrounded sum, so there the rebuilt norm output can differ
from the forward's in the last bit). Nothing is cached: each unpack reruns the elementwise
function, so no rebuilt tensor outlives its use.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from .mlp_recompute import enclosing_saved_tensor_hooks


class _Source:
    """The rebuild and its input, saved once however many tokens refer to it: packed by the
    enclosing hooks, so that what they count, offload or check covers it like any saved tensor."""

    def __init__(self, rebuild: Callable[[torch.Tensor], torch.Tensor], source: torch.Tensor, outer) -> None:
        self.rebuild, self.outer = rebuild, outer
        self.saved = source if outer is None else outer[0](source)

    def tensor(self) -> torch.Tensor:
        source = self.saved if self.outer is None else self.outer[1](self.saved)
        with torch.no_grad():
            return self.rebuild(source)


class _RebuiltToken:
    """What a projection saves instead of ``x`` (or a view of it): the source and the view."""

    __slots__ = ("source", "shape", "stride", "offset")

    def __init__(self, source: _Source, t: torch.Tensor) -> None:
        self.source, self.shape, self.stride, self.offset = source, t.shape, t.stride(), t.storage_offset()

    def tensor(self) -> torch.Tensor:
        return self.source.tensor().as_strided(self.shape, self.stride, self.offset)


@contextlib.contextmanager
def rebuilt_in_backward(x: torch.Tensor, rebuild: Callable[[torch.Tensor], torch.Tensor],
                        source: torch.Tensor) -> Iterator[None]:
    """Within: ``x`` (and views of it) saved for backward is rebuilt by ``rebuild(source)``
    instead of kept. ``rebuild`` must return ``x``'s values with ``x``'s shape and strides and
    hold no activation itself (a frozen weight is fine); ``source`` (the norm's input) is saved
    once, through the enclosing saved-tensor hooks if any, like every other saved tensor here.
    Under ``torch.no_grad`` nothing changes."""
    if not torch.is_grad_enabled():
        yield
        return
    storage, device = x.untyped_storage().data_ptr(), x.device
    outer = enclosing_saved_tensor_hooks()
    shared: list[_Source] = []

    def pack(t: torch.Tensor):
        if t.device == device and t.untyped_storage().data_ptr() == storage:
            if not shared:
                shared.append(_Source(rebuild, source, outer))
            return _RebuiltToken(shared[0], t)
        return t if outer is None else outer[0](t)

    def unpack(saved):
        if isinstance(saved, _RebuiltToken):
            return saved.tensor()
        return saved if outer is None else outer[1](saved)

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        # torch keeps ``pack`` with every tensor saved within, so its closure's ``source`` would
        # stay alive whatever the enclosing hooks did with it (e.g. moved it to the host)
        source = None
