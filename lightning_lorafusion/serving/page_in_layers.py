"""An adapter's page-in copy in slices of layers, and a step's waits for them layer by layer.

An adapter's flat layout (``adapters.HostAdapter``) holds its shared zero slots first, then
every layer's slots in layer order, so a run of layers is a run of elements. ``layer_chunks``
cuts the copy into ``groups`` slices of consecutive layers; the pool leaves the page-ins of a
step's admissions pending (``UnifiedPool.page_in``) and issues them together before the step
(``UnifiedPool.flush_copies``) layer-major (``copy_waves``): wave g copies slice g of every
pending adapter, then records one event, so the first layers of all of them land first.
Prefetches (issued behind a running step) stay one copy each. A step that admits a
request on an adapter whose copy is still pending does not hold its first kernel back for the
whole copy: ``LayerWaits`` orders the compute stream after slice g's event just before the
first layer of slice g runs (the eager forward before each layer, the mixed-step pieces before
each piece's replay), so layer 0's kernels overlap the copy of the later layers
(``EngineTuning.page_in_wait``; docs/serving.md "Page-ins by layer").
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from ..specs import ALL_TARGET_MODULES

# slices of an admission's page-in copy (fewer when the model has fewer layers): each slice of
# each adapter is one host-to-device copy, and thousands of them queued at once fill the copy
# stream's launch queue, which blocks the host (measured: per-layer slices of ~80 adapters held
# the host ~180 ms per 8,192-token step on an H100)
LAYER_SLICES = 8


def page_in_groups(num_layers: int, mode: str) -> int:
    """``UnifiedPool.page_in_groups`` for ``EngineTuning.page_in_wait`` ``mode``: "layer" ->
    ``LAYER_SLICES`` (at most the layer count), "step" -> 1 (one copy)."""
    if mode not in ("layer", "step"):
        raise ValueError(f"page_in_wait={mode!r}; allowed: layer, step")
    return max(1, min(LAYER_SLICES, num_layers)) if mode == "layer" else 1


def copy_waves(plans: Sequence[Sequence[tuple[int, int, int]]]) -> list[list[tuple[int, tuple[int, int, int]]]]:
    """Adapters' slices (``layer_chunks`` each) -> waves, layer-major: wave g holds
    ``(adapter index, its slice g)`` for every adapter with a slice g, in adapter order."""
    waves = max((len(p) for p in plans), default=0)
    return [[(i, p[g]) for i, p in enumerate(plans) if g < len(p)] for g in range(waves)]


def layer_chunks(adapter: Any, num_layers: int, groups: int) -> list[tuple[int, int, int]]:
    """``[(first layer, element start, element end)]``: the adapter's flat buffer cut into at
    most ``groups`` slices of consecutive layers, covering ``[0, numel)`` in order. Layer l's
    weights lie in the slice of the last first layer <= l or in an earlier one (the first
    slice also holds the shared zero slots). One slice when ``groups`` <= 1 or the layout is
    not layer-major."""
    numel = adapter.numel
    whole = [(0, 0, numel)]
    groups = min(groups, num_layers)
    if groups <= 1:
        return whole
    ranks = dict(zip(ALL_TARGET_MODULES, adapter.module_ranks.tolist()))
    owners: dict[tuple[int, int], list[int]] = {}  # a slot (A, B^T offsets) -> the layers reading it
    ends: dict[tuple[int, int], int] = {}
    for (layer, module), s in adapter.slots.items():
        if ranks.get(module, 0) <= 0:  # (a slot of a module with no rank: not a layout read here)
            return whole
        key = (s.a, s.b)
        owners.setdefault(key, []).append(layer)
        ends[key] = s.b + ranks.get(module, 0) * s.out_features
    per = -(-num_layers // groups)
    firsts = list(range(0, num_layers, per))
    # a slice starts where the first slot read only by its layers or later ones begins
    starts = [0]
    for f in firsts[1:]:
        own = [key[0] for key, layers in owners.items() if min(layers) >= f]
        starts.append(min(own) if own else numel)
    bounds = starts + [numel]
    if any(b < a for a, b in zip(bounds, bounds[1:])):
        return whole
    for key, layers in owners.items():  # every slot inside the slice of its first reader or earlier
        g = max(i for i, f in enumerate(firsts) if f <= min(layers))
        if ends[key] > bounds[g + 1]:
            return whole
    return [(f, a, b) for f, a, b in zip(firsts, bounds, bounds[1:]) if b > a]


class LayerWaits:
    """A step's pending page-in slices: ``before(layer)`` orders the compute stream (``wait``:
    an event -> None, the current stream's ``wait_event`` on CUDA) after every slice whose
    first layer is <= ``layer`` not waited for yet; ``rest()`` after all of them."""

    def __init__(self, slices: Iterable[tuple[int, Any]], wait: Callable[[Any], None]) -> None:
        self._pending = sorted(slices, key=lambda s: s[0])  # (first layer, event), stable per adapter
        self._wait = wait

    def __bool__(self) -> bool:
        return bool(self._pending)

    def before(self, layer: int) -> None:
        while self._pending and self._pending[0][0] <= layer:
            self._wait(self._pending.pop(0)[1])

    def rest(self) -> None:
        self.before(1 << 62)


def step_layer_waits(residents: Sequence[Any], wait: Callable[[Any], None]) -> LayerWaits | None:
    """The pending slices of ``residents`` (``ResidentAdapter.layer_ready``), taken over by the
    step (cleared on them with their whole-copy ``ready``: later steps run after this one's
    waits on the compute stream) -> their ``LayerWaits``, or None when none is pending."""
    slices = []
    for r in residents:
        if r.layer_ready:
            slices += r.layer_ready
        elif r.ready is not None:  # copied whole: wait before layer 0
            slices.append((0, r.ready))
        r.layer_ready, r.ready = None, None
    return LayerWaits(slices, wait) if slices else None
