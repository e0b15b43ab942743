"""The mixed-step pieces' LoRA launches: a padded step none of whose rows has an adapter runs the
pieces without LoRA (no LoRA kernel launched, the GEMMs writing their outputs), and the prefill
LoRA of the other steps runs on live grids over the padded tables (``ModelRunner.set_mixed_lora``);
the same greedy tokens and logprobs as the pieces with every LoRA launch and table-long grids."""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.serving import GenerationRequest, SamplingParams
from lightning_lorafusion.serving import paged_forward
from lightning_lorafusion.serving.mixed_graphs import LIVE_GRID_MAX_ROWS, MixedPieces


def _count_lora_launches(monkeypatch) -> dict[str, int]:
    """Count the paged forward's LoRA launches: prefill row tiles, per-row gathers, and the
    decode rows' tables handed to the RoPE / SwiGLU epilogues."""
    calls = {"segments": 0, "gather": 0, "epilogue": 0}
    seg, gather, gathered = paged_forward.segment_lora_add, paged_forward.lora_gather, paged_forward.gathered

    def count_seg(*args, **kwargs):
        calls["segments"] += 1
        return seg(*args, **kwargs)

    def count_gather(*args, **kwargs):
        calls["gather"] += 1
        return gather(*args, **kwargs)

    def count_gathered(*args, **kwargs):
        out = gathered(*args, **kwargs)
        calls["epilogue"] += out is not None
        return out

    monkeypatch.setattr(paged_forward, "segment_lora_add", count_seg)
    monkeypatch.setattr(paged_forward, "lora_gather", count_gather)
    monkeypatch.setattr(paged_forward, "gathered", count_gathered)
    return calls


@pytest.mark.parametrize("write", [True, False])
def test_pieces_without_lora_launch_no_lora_kernel_as_captured(make_engine, monkeypatch, write):
    """Every piece run as a CUDA graph would capture it (``dry_run``: every module's LoRA
    launched): the pieces with LoRA launch the prefill tiles and the decode gathers, those
    without launch none; they hold no LoRA table."""
    engine = make_engine(num_pages=64, page_size=4, mixed_graphs="eager", async_decode="off",
                         prefill_lora_write="on" if write else "off")
    runner = engine.runner
    calls = _count_lora_launches(monkeypatch)
    rows, dec = 16, runner.decode_inputs.max_rows
    kwargs = dict(max_tiles=MixedPieces.max_tiles(rows, runner.segment_block_m, dec, covering=write),
                  max_adapters=dec, capture=True, defer_capture=True, write=write)
    MixedPieces(runner, rows, **kwargs).dry_run()
    layers = runner.config.num_layers
    assert calls["segments"] == 4 * layers and calls["gather"] + calls["epilogue"] >= 4 * layers
    calls.update(segments=0, gather=0, epilogue=0)
    base = MixedPieces(runner, rows, **kwargs, lora=False)
    base.dry_run()
    assert calls == {"segments": 0, "gather": 0, "epilogue": 0}
    assert base.lora is None and base.live is None and base.batch.decode_offsets is None


def _run(engine, prompts: dict[int, list[tuple[str, str | None, int]]], steps: int):
    """Greedy tokens and logprobs by request; the kinds of padded steps run (with or without LoRA)."""
    out: dict[str, list] = {}
    kinds = []
    forward = engine.runner.forward

    def recording(batch):
        hidden = forward(batch)
        if batch.real_rows is None:  # not a padded mixed step (on CUDA: a decode-only step's own path)
            kinds.append("other")
        else:
            kinds.append("base" if batch.prefill_lora is None and not batch.decode_modules else "lora")
            built, rows = engine.runner._pieces_by_mode, batch.input_ids.shape[0]  # the pieces just run
            if batch.prefill_lora is not None and engine.runner.live_grids and rows <= LIVE_GRID_MAX_ROWS:
                pieces = built[batch.prefill_lora.write][0][rows]
                assert int(pieces.live) == batch.prefill_lora.tiles.shape[1]
        return hidden

    engine.runner.forward = recording
    for step in range(steps):
        for rid, adapter, n in prompts.get(step, []):
            engine.submit(GenerationRequest(
                prompt_token_ids=[(5 * j + 3 * len(rid) + n) % 60 + 1 for j in range(n)], adapter=adapter,
                request_id=rid, sampling=SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True,
                                                        logprobs=1)))
        for ev in engine.step():
            if ev.token_id is not None:
                out.setdefault(ev.request_id, []).append((ev.token_id, ev.logprob))
    engine.runner.forward = forward
    return out, kinds


# base rows only, then adapted prompts joining base decodes, then a base prompt beside adapted decodes
PROMPTS = {0: [("b0", None, 9), ("b1", None, 5)], 3: [("a0", "all4", 7), ("a1", None, 3)],
           5: [("a2", "mlp8", 11)], 7: [("b2", None, 6)]}


@pytest.mark.parametrize("backend,write", [("torch", "auto"), ("triton", "on"), ("triton", "off")])
def test_pieces_without_lora_and_live_grids_give_the_old_paths_tokens(make_engine, monkeypatch, backend, write):
    """Adapters loaded, some steps using none of them: greedy tokens and logprobs equal with the
    pieces without LoRA and the live grids on and both off (every step through the LoRA pieces,
    grids over the whole padded table); the base-only steps launch no LoRA kernel when on."""
    runs, launches = {}, {}
    for new in (True, False):
        engine = make_engine(num_pages=96, page_size=4, mixed_graphs="eager", async_decode="off", backend=backend,
                             prefill_lora_write=write, prefix_caching=False, max_num_seqs=8)
        engine.runner.set_mixed_lora(base_pieces=new, live_grids=new)
        calls = _count_lora_launches(monkeypatch)
        counts = []
        steps = engine.runner.forward

        def counted(batch, steps=steps, calls=calls, counts=counts):
            before = sum(calls.values())
            hidden = steps(batch)
            counts.append(sum(calls.values()) - before)
            return hidden

        engine.runner.forward = counted
        runs[new], kinds = _run(engine, PROMPTS, 12)
        launches[new] = list(zip(counts, kinds))  # one entry per forward, in order
        monkeypatch.undo()
        assert "base" in kinds and "lora" in kinds
        if new:
            assert engine.runner._pieces_by_mode[None][0], "the base-only steps ran the pieces without LoRA"
    assert runs[True].keys() == runs[False].keys() and len(runs[True]) == 6
    for rid in runs[False]:
        assert [t for t, _ in runs[True][rid]] == [t for t, _ in runs[False][rid]]
        assert [lp for _, lp in runs[True][rid]] == pytest.approx([lp for _, lp in runs[False][rid]], abs=1e-5)
    # the padded steps of base rows only (the first steps among them) launch no LoRA kernel with
    # the pieces without LoRA (eager pieces of the old way launch only the modules a step adapts,
    # so none either: what a captured piece launches is the test above's)
    base_steps = [n for n, kind in launches[True] if kind == "base"]
    assert launches[True][0] == (0, "base") and base_steps == [0] * len(base_steps)
    assert sum(n for n, kind in launches[True] if kind == "lora") > 0


def test_set_mixed_lora_drops_the_pieces_built_the_other_way(make_engine):
    engine = make_engine(num_pages=64, page_size=4, mixed_graphs="eager", async_decode="off")
    runner = engine.runner
    assert runner.base_pieces and runner.live_grids  # the defaults
    assert runner.build_mixed_pieces() == len(runner.token_buckets)
    assert set(runner._pieces_by_mode[None][0]) == set(runner.token_buckets)  # built ahead, like the others
    # live grids up to LIVE_GRID_MAX_ROWS rows, grids over the whole table above
    assert all((p.live is not None) == (rows <= LIVE_GRID_MAX_ROWS) for rows, p in runner._mixed.items())
    assert any(p.live is not None for p in runner._mixed.values())
    runner.set_mixed_lora(base_pieces=True, live_grids=True)  # unchanged: kept
    assert runner._mixed
    runner.set_mixed_lora(base_pieces=False, live_grids=False)
    assert not runner._mixed and not runner._pieces_by_mode[None][0]
    runner.build_mixed_pieces()
    assert not runner._pieces_by_mode[None][0] and all(p.live is None for p in runner._mixed.values())
