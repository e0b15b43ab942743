"""The model runner's settings of padded mixed steps (``ModelRunner`` inherits them): how the
prefill LoRA is written and with which kernels, whether steps run as pieces (captured or eager),
with or without LoRA pieces for base-only steps, and the pieces built per token bucket."""

from __future__ import annotations

import dataclasses
import logging
import time

from ..capture import capture_batch
from ..kernels.lora_segments import FORMS
from .decode_graphs import token_buckets
from .mixed_graphs import MixedPieces

# "auto" prefill LoRA (``EngineTuning.prefill_lora_write``): written first in steps whose adapted
# prefill rows are at least this share of their rows (the write-first expand writes every row,
# zeros included, and cuBLAS's beta = 1 reads them all: on an H100 it cost 3-7 % more in the
# burst trace's mixed steps of 512-2,048 tokens, mostly decode rows, and saved in its 8,192-token ones)
WRITE_FIRST_MIN_SHARE = 0.5
log = logging.getLogger(__name__)


class MixedStepSettings:
    """Mixed-step settings and pieces of a ``ModelRunner`` (which sets ``_prefill_lora_write``,
    ``_pieces_by_mode``, ``model``, ``mixed_pieces``, ``pad_mixed``, ``base_pieces``, ``live_grids``,
    ``max_batched_tokens``, ``token_bucket_mode``, ``device`` and the backends in its ``__init__``)."""

    @property
    def token_bucket_mode(self) -> str:
        """``EngineTuning.token_buckets``: the token counts padded mixed steps are padded to,
        "quarters" (powers of two and, from 512 tokens, 5, 6 and 7 * 2^(k-2) between them), "fine"
        (3 * 2^k between them) or "pow2" (``decode_graphs.token_buckets``). Settable between
        steps: pieces already built are kept, new buckets' built on first use or by
        ``build_mixed_pieces``."""
        return self._token_bucket_mode

    @token_bucket_mode.setter
    def token_bucket_mode(self, mode: str) -> None:
        self._set_buckets(mode, getattr(self, "_graph_max_tokens", None))

    @property
    def mixed_graph_max_tokens(self) -> int | None:
        """The most real tokens of a mixed step none of whose rows has an adapter padded to a
        token bucket and run as pieces (``EngineTuning.mixed_graph_max_tokens`` resolved by
        ``decode_graphs.graph_token_limit``; None: every bucket): ``base_buckets`` holds the
        buckets up to it, and a larger base-only step runs unpadded, eagerly (``prepare`` pads
        it only up to the last of them). Steps with adapted rows take every bucket
        (``token_buckets``) as before. Settable between steps: pieces already built are kept,
        new buckets' built on first use or by ``build_mixed_pieces``."""
        return self._graph_max_tokens

    @mixed_graph_max_tokens.setter
    def mixed_graph_max_tokens(self, tokens: int | None) -> None:
        self._set_buckets(self._token_bucket_mode, tokens)

    def _set_buckets(self, mode: str, max_tokens: int | None) -> None:
        every = token_buckets(self.max_batched_tokens, mode)
        # (at least the smallest bucket: a limit below it pads nothing but one-token steps)
        base = every if max_tokens is None else tuple(b for b in every if b <= max_tokens) or every[:1]
        # (pieces already built stay: a bucket's pieces depend on its rows alone, and run again
        # if their bucket is taken again)
        self.token_buckets, self.base_buckets = every, base
        self._token_bucket_mode, self._graph_max_tokens = mode, max_tokens

    def step_buckets(self, adapted: bool) -> tuple[int, ...]:
        """The token buckets a padded step pads to: every bucket for a step with adapted rows
        (or when base-only steps run the LoRA pieces, ``base_pieces`` off), those up to
        ``mixed_graph_max_tokens`` for one without."""
        return self.token_buckets if adapted or not self.base_pieces else self.base_buckets

    @property
    def prefill_lora_write(self) -> str:
        """``EngineTuning.prefill_lora_write``: "on" (every step's projections write the prefill
        LoRA first and the frozen GEMM adds its product onto it), "off" (added after the product),
        "auto" (written first in steps whose adapted prefill rows are at least
        ``WRITE_FIRST_MIN_SHARE`` of their rows). With "on" / "auto" the steps' tile tables cover
        every row (``PrefillLora.covering``). Settable between steps: the mixed-step pieces of each
        way are kept (built on first use or by ``build_mixed_pieces``), all of them rebuilt when
        the tables' covering changes."""
        return self._prefill_lora_write

    @prefill_lora_write.setter
    def prefill_lora_write(self, mode: str) -> None:
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"prefill_lora_write={mode!r}; allowed: auto, on, off")
        if (mode == "off") != (self._prefill_lora_write == "off"):  # the static tables' covering changes
            self._clear_pieces()
        self._prefill_lora_write = mode

    @property
    def prefill_lora_form(self) -> str | None:
        """The prefill LoRA's Triton kernels (``lora_segments.FORMS``; None: ``DEFAULT_FORM``).
        Settable between steps: the mixed-step pieces, which captured the other form's
        launches, are dropped (rebuilt on first use or by ``build_mixed_pieces``)."""
        return self.model.lora_form

    @prefill_lora_form.setter
    def prefill_lora_form(self, form: str | None) -> None:
        if form is not None and form not in FORMS:
            raise ValueError(f"prefill_lora_form={form!r}; allowed: None, {', '.join(FORMS)}")
        if form != self.model.lora_form:
            self._clear_pieces()
            self.model = dataclasses.replace(self.model, lora_form=form)

    def _write_modes(self) -> list[bool]:
        """The ``PrefillLora.write`` values steps can take, the usual one first."""
        return {"on": [True], "off": [False], "auto": [True, False]}[self._prefill_lora_write]

    def _step_writes(self, lora_rows: int, rows: int) -> bool:
        """Whether a step of ``rows`` rows, ``lora_rows`` of them adapted prefill rows, writes the
        prefill LoRA first."""
        mode = self._prefill_lora_write
        return mode == "on" or (mode == "auto" and lora_rows >= WRITE_FIRST_MIN_SHARE * rows)

    def _reachable(self, write: bool | None, rows: int) -> bool:
        """Whether a padded step of ``rows`` rows (a token bucket) can run the pieces of prefill
        LoRA way ``write``: with "auto", added after (False) needs an adapted prefill row count
        of at least one below ``WRITE_FIRST_MIN_SHARE`` of the rows, which buckets of one and two
        rows cannot hold (one adapted row is already half of them: written first)."""
        return not (write is False and self._prefill_lora_write == "auto" and WRITE_FIRST_MIN_SHARE * rows <= 1)

    @property
    def _mixed(self) -> dict[int, "MixedPieces"]:
        """The pieces of the usual prefill LoRA way, by token bucket."""
        return self._pieces_by_mode[self._write_modes()[0]][0]

    @property
    def _mixed_dora(self) -> dict[int, "MixedPieces"]:
        return self._pieces_by_mode[False][1]

    def clear_mixed_pieces(self) -> None:
        """Drop every built mixed-step piece (rebuilt on first use or by ``build_mixed_pieces``):
        after a kernel knob their captures depend on changed (``lora_segments.SMALL_STEP_ROWS``)."""
        self._clear_pieces()

    def _clear_pieces(self) -> None:
        for built in self._pieces_by_mode.values():
            for pieces in built:
                pieces.clear()

    @property
    def can_capture_mixed(self) -> bool:
        """Whether mixed-step pieces can be captured: a CUDA device and the Triton kernels."""
        return self.device.type == "cuda" and self.lora_backend == "triton" and self.kernel_backend == "triton"

    def use_mixed_pieces(self, mode: str | None) -> None:
        """Padded mixed steps (``pad_mixed``) as pieces: "graphs" (CUDA: each piece captured on
        first use of its token bucket, or by ``build_mixed_pieces``), "eager" (same buffers, run eagerly), or
        None (off: one eager forward, unpadded)."""
        if mode not in (None, "eager", "graphs"):
            raise ValueError(f"mixed pieces mode {mode!r}; allowed: None, 'eager', 'graphs'")
        if mode == "graphs" and not self.can_capture_mixed:
            raise RuntimeError("mixed-step CUDA graphs need a CUDA device and the Triton kernels")
        self.mixed_pieces, self.pad_mixed = mode, mode is not None
        self._clear_pieces()

    def set_mixed_lora(self, *, base_pieces: bool, live_grids: bool) -> None:
        """Steps none of whose rows has an adapter run pieces without LoRA (``base_pieces``; else
        those of the other steps, their LoRA kernels on empty tables); the prefill LoRA of the
        pieces' padded tables runs on live grids (``live_grids``; else grids over the whole
        table). Pieces built the other way are dropped."""
        if (base_pieces, live_grids) != (self.base_pieces, self.live_grids):
            self._clear_pieces()
        self.base_pieces, self.live_grids = base_pieces, live_grids

    def _new_pieces(self, rows: int, dora: bool = False, *, write: bool | None = False,
                    defer_capture: bool = False) -> MixedPieces:
        return MixedPieces.of_runner(self, rows, dora=dora, write=write, defer_capture=defer_capture)

    def build_mixed_pieces(self) -> int:
        """Build (capture, with graphs) the pieces of every token bucket now rather than on the
        first step of each bucket mid-run (both ways of the prefill LoRA with "auto") -> how many
        buckets were new. The pieces serve any
        mix of ranks (adapters loaded later included), so nothing is built per rank. No-op with
        pieces off."""
        if self.mixed_pieces is None:
            return 0
        buckets = set()  # (with "auto" prefill LoRA, each bucket has a set per way: counted once)
        for write in self._write_modes() + ([None] if self.base_pieces else []):
            built = self._pieces_by_mode[write][0]
            new = [rows for rows in self.step_buckets(write is not None)
                   if rows not in built and self._reachable(write, rows)]
            with capture_batch(self.device if self.mixed_pieces == "graphs" else None):
                self._build_pieces(new, write)
            buckets.update(new)
        return len(buckets)

    def _build_pieces(self, new: list[int], write: bool) -> None:
        for rows in new:
            t0 = time.perf_counter()
            self._pieces_by_mode[write][0][rows] = self._new_pieces(rows, write=write)
            log.info("mixed-step pieces of the %d-token bucket (prefill LoRA %s) built in %.2f s", rows,
                     "none" if write is None else "written first" if write else "added after",
                     time.perf_counter() - t0)
