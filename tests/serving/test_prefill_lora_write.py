"""The prefill rows' LoRA written first (``EngineTuning.prefill_lora_write`` "on", or "auto" in
steps mostly of adapted prefill rows): covering tile tables, the write-first expand into the
projection's output and the frozen GEMM adding its product onto it (``paged_forward.write_first``);
the same tokens as the additive path."""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.kernels import lora_segments
from lightning_lorafusion.serving import GenerationRequest, SamplingParams
from lightning_lorafusion.serving import paged_forward
from lightning_lorafusion.serving.config import ConfigError, EngineTuning
from lightning_lorafusion.serving.mixed_graphs import MixedPieces

# (prompt length, adapter): adapted and base prompts side by side, so a step's rows hold gaps
CASES = [(9, "all4"), (5, None), (17, "attn2"), (12, "mlp8"), (7, None), (21, "all4"), (6, "attn2")]


def _spy(monkeypatch) -> list[bool]:
    """Record ``accumulate`` of every prefill LoRA call of the paged forward."""
    seen: list[bool] = []
    real = lora_segments.segment_lora_add

    def spy(*args, accumulate: bool = True, **kw):
        seen.append(accumulate)
        return real(*args, accumulate=accumulate, **kw)

    monkeypatch.setattr(paged_forward, "segment_lora_add", spy)
    return seen


def _run(engine) -> dict[str, list[int]]:
    arrive_at = {0: [0, 1, 2], 2: [3, 4], 4: [5, 6]}  # later prompts join steps with decode rows
    tokens: dict[str, list[int]] = {}
    for step in range(40):
        for i in arrive_at.get(step, []):
            n, adapter = CASES[i]
            engine.submit(GenerationRequest(
                prompt_token_ids=[(7 * i + 3 * j) % 61 + 1 for j in range(n)], adapter=adapter, request_id=f"r{i}",
                sampling=SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)))
        for ev in engine.step():
            if ev.token_id is not None:
                tokens.setdefault(ev.request_id, []).append(ev.token_id)
    return tokens


@pytest.mark.parametrize("pieces,backend", [("off", "torch"), ("eager", "torch"), ("off", "triton")])
def test_write_first_gives_the_additive_paths_tokens(make_engine, monkeypatch, pieces, backend):
    """Greedy tokens equal with the LoRA written first and read-added after the product, eager
    and as mixed-step pieces (padded steps: decode rows first, padding rows last), the torch
    reference and the Triton kernels; "on" runs the write-first calls only, "off" none."""
    seen = _spy(monkeypatch)
    runs = {}
    for mode in ("on", "off"):
        seen.clear()
        engine = make_engine(num_pages=96, page_size=4, prefill_lora_write=mode, mixed_graphs=pieces,
                             async_decode="off", backend=backend, prefix_caching=False)
        runs[mode] = _run(engine)
        assert seen and set(seen) == ({False} if mode == "on" else {True})
    assert runs["on"] == runs["off"] and len(runs["on"]) == len(CASES)
    assert all(len(t) == 4 for t in runs["on"].values())


@pytest.mark.parametrize("pieces", ["off", "eager"])
def test_auto_writes_first_only_in_steps_mostly_of_adapted_prefill_rows(make_engine, monkeypatch, pieces):
    """"auto": a step of long adapted prompts writes first; a later step of many decode rows and
    one short adapted prompt (well under half its rows) adds after; tokens equal "off"'s."""
    seen = _spy(monkeypatch)
    runs = {}
    for mode in ("auto", "off"):
        seen.clear()
        engine = make_engine(num_pages=128, page_size=4, prefill_lora_write=mode, mixed_graphs=pieces,
                             async_decode="off", prefix_caching=False)
        tokens = {}
        prompts = {0: [("a", "all4", 40), ("b", "attn2", 40), ("c", None, 5), ("d", None, 5), ("e", None, 5)],
                   3: [("f", "mlp8", 2)]}
        for step in range(12):
            for rid, adapter, n in prompts.get(step, []):
                engine.submit(GenerationRequest(
                    prompt_token_ids=[(5 * j + len(rid)) % 60 + 1 for j in range(n)], adapter=adapter, request_id=rid,
                    sampling=SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)))
            for ev in engine.step():
                if ev.token_id is not None:
                    tokens.setdefault(ev.request_id, []).append(ev.token_id)
        runs[mode] = tokens
        assert set(seen) == ({False, True} if mode == "auto" else {True})
    assert runs["auto"] == runs["off"] and len(runs["auto"]) == 6


def test_prefill_lora_write_is_checked(make_engine):
    assert EngineTuning().prefill_lora_write == "auto"
    with pytest.raises(ValueError, match="prefill_lora_write='yes'"):
        make_engine(num_pages=32, page_size=4).runner.prefill_lora_write = "yes"
    with pytest.raises(ConfigError, match="prefill_lora_write='yes'"):
        EngineTuning(prefill_lora_write="yes")


def test_covering_pieces_leave_room_for_the_gaps_and_cover_a_step_without_lora():
    """A covering table has up to ``segments + 1`` more runs (the rows between them); pieces of
    covering tables load tiles of no adapter over every row for a step without prefill LoRA."""
    assert MixedPieces.max_tiles(100, 16, 5) == 7 + 5
    assert MixedPieces.max_tiles(100, 16, 5, covering=True) == 7 + 11
    rows, block_m = 100, 16
    segments = [(1, 3, 0), (3, 40, 1), (41, 42, 0), (60, 99, 2), (99, 100, 1)]  # worst case: gaps between
    tiles = lora_segments.segment_tiles(segments, block_m, rows=rows)
    assert len(tiles) <= MixedPieces.max_tiles(rows, block_m, len(segments), covering=True)
    assert [(s, e) for s, e, _ in tiles] == sorted((s, e) for s, e, _ in tiles)
    assert sum(e - s for s, e, _ in tiles) == rows


def test_pieces_of_covering_tables_run_a_step_without_prefill_lora(make_engine):
    """Eager pieces with write-first: a base-only prompt (no prefill LoRA tables) still gets every
    row of its outputs written (the pieces' own tiles of no adapter), the same tokens as off.
    (With the pieces without LoRA off: otherwise such a step runs those.)"""
    runs = {}
    for mode in ("on", "off"):
        engine = make_engine(num_pages=96, page_size=4, prefill_lora_write=mode, mixed_graphs="eager",
                             async_decode="off", prefix_caching=False)
        engine.runner.set_mixed_lora(base_pieces=False, live_grids=True)
        tokens = {}
        engine.submit(GenerationRequest(prompt_token_ids=list(range(1, 12)), adapter=None, request_id="base",
                                        sampling=SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)))
        for _ in range(10):
            for ev in engine.step():
                if ev.token_id is not None:
                    tokens.setdefault(ev.request_id, []).append(ev.token_id)
        pieces = next(iter(engine.runner._mixed.values()))
        assert (pieces.no_lora_tiles is not None) == (mode == "on")
        runs[mode] = tokens
    assert runs["on"] == runs["off"] and len(runs["on"]["base"]) == 3


def test_write_first_falls_back_for_a_bias_or_a_quantized_weight(make_engine):
    """A projection with a bias (Qwen2's q/k/v) or a non-tensor weight keeps the additive path."""
    engine = make_engine(num_pages=64, page_size=4)
    m = engine.runner.model
    lp = dict(m.params["layers"][0])
    x = torch.randn(3, m.config.hidden_size)
    fused, names = paged_forward._QKV
    key = fused if fused in lp else names[0]
    with_bias = dict(lp)
    with_bias[key] = dict(lp[key], bias=torch.zeros(lp[key]["weight"].shape[0]))
    assert paged_forward.write_first(m, x, with_bias, paged_forward._QKV, 0, None) is None
