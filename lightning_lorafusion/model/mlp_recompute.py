"""Selective recomputation of the gated MLP: which of its ``[T, intermediate]`` tensors the
training step keeps for backward and which backward rebuilds (``DecoderOptions.mlp_recompute``).

The MLP ``d = down(act(gate(x), up(x)))`` keeps three ``[T, I]`` tensors alive from forward to
backward: ``g`` and ``u`` (for the activation's gradient) and ``mid = act(g, u)`` (the down
projection's LoRA ``dA``). At an 8B shape they are most of a layer's activations.

- ``"none"``: keep all three.
- ``"activation"``: keep ``g`` and ``u``; ``mid`` is rebuilt in backward by the elementwise
  activation (no product runs twice; the activation's own backward reuses that rebuild).
- ``"gate_up"``: keep only the MLP input ``x`` (kept anyway by the gate/up projections); backward
  reruns the gate/up projections with their LoRA terms (one extra gate+up product per layer)
  and the activation.

The rest of the graph is unchanged: the down projection saves a token instead of ``mid``
(``saved_tensors_hooks``) and the activation is a small autograd Function holding only what the
mode keeps, once, packed by the enclosing saved-tensor hooks like any saved tensor. Recomputation
runs the same functions on the same inputs (dropout masks are hashes of seed and offset), so it
gives the forward's values bit for bit; with the norm outputs rebuilt too (``rebuilt_copies.py``)
"gate_up" reruns gate/up on the rebuilt one, which a compiled fused residual add + norm may round
differently in the last bit, and then ``g``, ``u`` and the gradients before them differ from the
keeping path's by bf16 rounding.
"""

from __future__ import annotations

from typing import Callable

import torch

MLP_RECOMPUTE_MODES = ("none", "activation", "gate_up")
# the rebuilt tensors are dropped after the first backward (kept, every layer's would live until
# the graph dies), so a retained graph cannot be walked again
_SECOND_BACKWARD = ("DecoderOptions.mlp_recompute does not support a second backward through the same graph "
                    "(retain_graph=True); use mlp_recompute='none' there")

GateUp = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _Rebuilt:
    """One layer's ``g``, ``u`` and ``mid`` for its backward, rebuilt on first use and dropped by
    the activation's backward (the last to need them). Holds the kept tensors only (``g, u`` or
    ``x``) until backward, never ``mid``.

    ``mid`` is rebuilt once, with autograd on over detached ``g, u``: the down projection's
    backward reads its values, and the activation's backward differentiates that same graph, so
    the elementwise activation runs once in backward, not twice."""

    def __init__(self, act: Activation, gate_up: GateUp | None) -> None:
        self.act, self.gate_up_fn = act, gate_up
        self._packed: tuple = ()  # the kept tensors as the enclosing saved-tensor hooks packed them
        self._outer = None
        self._gu: tuple[torch.Tensor, torch.Tensor] | None = None
        self._mid: torch.Tensor | None = None  # the rebuilt act(g, u), attached to self._leaves
        self._leaves: tuple[torch.Tensor, torch.Tensor] | None = None

    def keep(self, kept: tuple[torch.Tensor, ...]) -> None:
        """Hold ``kept`` until backward through the saved-tensor hooks in force (a norm rebuilt in
        backward, an offloading or counting context): held as plain tensors they would stay
        alive whatever those hooks do with them."""
        self._outer = enclosing_saved_tensor_hooks()
        self._packed = kept if self._outer is None else tuple(self._outer[0](t) for t in kept)

    @property
    def kept(self) -> tuple[torch.Tensor, ...]:
        return self._packed if self._outer is None else tuple(self._outer[1](p) for p in self._packed)

    def gate_up(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._gu is None and not self._packed:
            raise RuntimeError(_SECOND_BACKWARD)
        if self._gu is None:
            kept = self.kept
            if self.gate_up_fn is None:  # "activation": g and u were kept
                self._gu = (kept[0], kept[1])
            else:
                with torch.no_grad():
                    self._gu = self.gate_up_fn(kept[0])
        return self._gu

    def _rebuild(self) -> None:
        g, u = self.gate_up()
        with torch.enable_grad():
            self._leaves = (g.detach().requires_grad_(), u.detach().requires_grad_())
            self._mid = self.act(*self._leaves)

    def mid(self) -> torch.Tensor:
        """``act(g, u)``, its values only (what the down projection saved)."""
        if self._mid is None:
            self._rebuild()
        return self._mid.detach()

    def grads(self, dmid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dg, du)`` through the activation; drops everything rebuilt."""
        if self._mid is None:  # the down projection never read ``mid`` (e.g. it has no LoRA)
            self._rebuild()
        mid, leaves = self._mid, self._leaves
        self.release()
        return torch.autograd.grad(mid, leaves, dmid)

    def release(self) -> None:
        self._packed, self._gu, self._mid, self._leaves = (), None, None, None


class _MidToken:
    """What the down projection saves instead of ``mid`` (or a view of it)."""

    __slots__ = ("rebuilt", "shape", "stride", "offset")

    def __init__(self, rebuilt: _Rebuilt, t: torch.Tensor) -> None:
        self.rebuilt, self.shape, self.stride, self.offset = rebuilt, t.shape, t.stride(), t.storage_offset()

    def tensor(self) -> torch.Tensor:
        return self.rebuilt.mid().as_strided(self.shape, self.stride, self.offset)


class _GatedActivation(torch.autograd.Function):
    """``act(g, u)`` keeping only what the mode keeps: ``g, u`` ("activation") or the MLP input
    ``x`` ("gate_up"), once, in ``rebuilt`` (the down projection's backward rebuilds ``mid``
    before this backward runs), packed by the enclosing saved-tensor hooks like any saved tensor."""

    @staticmethod
    def forward(ctx, g, u, x, rebuilt: _Rebuilt):
        ctx.rebuilt = rebuilt
        rebuilt.keep((g, u) if rebuilt.gate_up_fn is None else (x,))
        return rebuilt.act(g, u)

    @staticmethod
    def backward(ctx, dmid):
        rebuilt, ctx.rebuilt = ctx.rebuilt, None
        if rebuilt is None:
            raise RuntimeError(_SECOND_BACKWARD)
        dg, du = rebuilt.grads(dmid)
        return dg, du, None, None


def enclosing_saved_tensor_hooks():
    """The saved-tensor hooks in force around this call (an offloading or a counting context), or
    None: saved-tensor hooks do not nest (the innermost alone applies), so the down projection's
    hooks pass every tensor but ``mid`` on to them. torch exposes the current pair only through
    ``torch._C`` (its AOT autograd reads it the same way); without it, no enclosing hooks are seen."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return None if top is None else top(False)


def recomputed_mlp(x: torch.Tensor, gate_up: GateUp, act: Activation,
                   down: Callable[[torch.Tensor], torch.Tensor], mode: str) -> torch.Tensor:
    """``down(act(*gate_up(x)))`` keeping for backward what ``mode`` says (module docstring).

    ``gate_up``: ``x [T, H] -> (g, u)`` each ``[T, I]`` (with their LoRA terms); ``act``: the
    elementwise gated activation; ``down``: ``[T, I] -> [T, H]``. Under ``torch.no_grad`` or with
    mode "none" this is the plain composition."""
    if mode not in MLP_RECOMPUTE_MODES:
        raise ValueError(f"mlp_recompute={mode!r}; allowed: {MLP_RECOMPUTE_MODES}")
    g, u = gate_up(x)
    if mode == "none" or not torch.is_grad_enabled():
        return down(act(g, u))
    rebuilt = _Rebuilt(act, gate_up if mode == "gate_up" else None)
    mid = _GatedActivation.apply(g, u, x, rebuilt)
    del g, u
    # the hooks hold these numbers, never ``mid`` or ``x`` (torch keeps the hooks with each saved tensor)
    mid_storage, device = mid.untyped_storage().data_ptr(), x.device

    outer = enclosing_saved_tensor_hooks()  # the down projection's other saved tensors still go through them

    def pack(t: torch.Tensor):
        if t.device == device and t.untyped_storage().data_ptr() == mid_storage:
            return _MidToken(rebuilt, t)
        return t if outer is None else outer[0](t)

    def unpack(saved):
        if isinstance(saved, _MidToken):
            return saved.tensor()
        return saved if outer is None else outer[1](saved)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return down(mid)
