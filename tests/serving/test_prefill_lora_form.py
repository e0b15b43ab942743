"""The engine's prefill LoRA form (``ModelRunner.prefill_lora_form``): the split-K kernels
(``lora_splitk``) as mixed-step pieces (padded tables, live counts, kept arrival counters),
written first, give the torch reference's greedy tokens (the decode rows' kernels are the torch
ones in both runs: the interpreter's time goes to the form under test)."""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.kernels import lora_segments
from lightning_lorafusion.serving import GenerationRequest, SamplingParams
from lightning_lorafusion.serving import paged_forward

# (prompt length, adapter, step it arrives at): an adapted prompt joining a base one's decode
PROMPTS = [(9, "all4", 0), (5, None, 0), (13, "mlp8", 1)]


def _run(engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for step in range(6):
        for i, (n, adapter, at) in enumerate(PROMPTS):
            if at == step:
                engine.submit(GenerationRequest(
                    prompt_token_ids=[(7 * i + 3 * j) % 61 + 1 for j in range(n)], adapter=adapter,
                    request_id=f"r{i}", sampling=SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)))
        for ev in engine.step():
            if ev.token_id is not None:
                tokens.setdefault(ev.request_id, []).append(ev.token_id)
    return tokens


@pytest.mark.parametrize("pieces,expand", [("eager", "tile"), ("off", "tile"), ("eager", "held"), ("off", "held")])
def test_splitk_gives_the_references_tokens(make_engine, monkeypatch, pieces, expand):
    """As mixed-step pieces (padded tables, live counts, their counters) and as eager steps (the
    runner's counters); with either expand after the split-K shrink (``SPLITK_EXPAND``)."""
    monkeypatch.setattr(lora_segments, "SPLITK_EXPAND", expand)
    held, real_held = [], lora_segments._held_launches
    monkeypatch.setattr(lora_segments, "_held_launches", lambda *a, **kw: held.append(1) or real_held(*a, **kw))
    forms = []
    real = lora_segments.segment_lora_add

    def spy(*args, form=None, **kw):
        forms.append((kw.get("backend"), form))
        return real(*args, form=form, **kw)

    monkeypatch.setattr(paged_forward, "segment_lora_add", spy)
    runs = {}
    for backend in ("torch", "triton"):
        engine = make_engine(num_pages=64, page_size=4, prefill_lora_write="on", mixed_graphs=pieces,
                             async_decode="off", backend=backend, decode_backend="torch", prefix_caching=False)
        engine.runner.prefill_lora_form = "splitk"
        runs[backend] = _run(engine)
        if backend == "triton":
            built = [p for by_rows in engine.runner._pieces_by_mode.values() for p in by_rows[0].values()
                     if p.lora is not None]
            assert bool(built) == (pieces == "eager")
            assert all(not p.lora.counters.any() for p in built)  # left zero by the shrinks
            assert not engine.runner.prefill_counters.any()
    assert ("triton", "splitk") in forms
    assert bool(held) == (expand == "held")
    assert runs["triton"] == runs["torch"] and len(runs["torch"]) == len(PROMPTS)


def test_prefill_lora_form_is_checked_and_drops_the_pieces(make_engine):
    engine = make_engine(num_pages=64, page_size=4, mixed_graphs="eager", async_decode="off")
    runner = engine.runner
    with pytest.raises(ValueError, match="prefill_lora_form"):
        runner.prefill_lora_form = "rows"
    runner.build_mixed_pieces()
    assert any(by_rows[0] for by_rows in runner._pieces_by_mode.values())
    runner.prefill_lora_form = "splitk"
    assert runner.model.lora_form == "splitk"
    assert not any(by_rows[0] for by_rows in runner._pieces_by_mode.values())


@pytest.mark.parametrize("pieces", ["eager", "off"])
@pytest.mark.parametrize("epilogues", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the Triton epilogues in the interpreter: ~30 s an engine"))])
def test_gate_up_lora_inside_swiglu_gives_the_references_tokens(make_engine, monkeypatch, pieces, epilogues):
    """The prefill rows' gate/up expand inside SwiGLU (``paged_forward.PREFILL_SWIGLU``: covering
    tables, the split-K form) gives the torch engine's greedy tokens, as mixed-step pieces (whose
    decode launch spans the prefill rows too: they are written again) and eagerly, after the
    torch epilogue or the Triton one; the kernel ran."""
    from lightning_lorafusion.kernels import lora_epilogues

    calls = []
    real = lora_epilogues.swiglu_segments
    monkeypatch.setattr(lora_epilogues, "swiglu_segments", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    monkeypatch.setattr(paged_forward, "PREFILL_SWIGLU", True)
    runs = {}
    for backend, decode in (("torch", "torch"), ("triton", epilogues)):
        engine = make_engine(num_pages=64, page_size=4, prefill_lora_write="auto", mixed_graphs=pieces,
                             async_decode="off", backend=backend, decode_backend=decode, prefix_caching=False)
        engine.runner.prefill_lora_form = "splitk"
        runs[backend] = _run(engine)
    assert calls and (pieces == "off" or epilogues == "torch" or any(kw.get("adapted_only") for kw in calls))
    assert runs["triton"] == runs["torch"] and len(runs["torch"]) == len(PROMPTS)
