"""Mixed steps padded to token buckets (``ModelRunner.pad_mixed``: the fixed shapes a captured
mixed step needs; every row's LoRA by row tiles, decode rows as tiles of one row, no decode
gather): the same tokens and logprobs as unpadded eager steps, with the torch references and
with the Triton kernels (interpreter, fp32), through prefills that arrive while others decode."""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.serving import GenerationRequest, SamplingParams

CASES = [([5, 9, 11, 3, 7, 2, 2], "all4"), ([2, 8, 8, 1], "mlp8"), ([4, 4, 6, 30, 12, 9, 1, 1, 3], None),
         ([13, 2, 5, 6, 7], "attn2"), ([9, 9, 9], "all4")]


def _run(engine, pad: bool):
    engine.runner.pad_mixed = pad
    sp = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)
    reqs = [GenerationRequest(prompt_token_ids=p, adapter=a, sampling=sp, request_id=f"r{i}")
            for i, (p, a) in enumerate(CASES)]
    arrive = {0: reqs[:2], 1: reqs[2:3], 2: reqs[3:5]}  # later prompts join running decodes
    events, shapes = [], []
    forward = engine.runner.forward

    def recording(batch):
        shapes.append((batch.input_ids.shape[0], batch.real_rows))
        return forward(batch)

    engine.runner.forward = recording
    for step in range(9):
        for r in arrive.get(step, []):
            engine.submit(r)
        events += [(ev.request_id, ev.token_id, ev.logprob) for ev in engine.step() if ev.token_id is not None]
    engine.runner.forward = forward
    return events, shapes


@pytest.mark.parametrize("backend,attention", [("torch", "varlen"), ("triton", "paged")])
def test_padded_mixed_steps_equal_unpadded(make_engine, backend, attention):
    got = {}
    for pad in (False, True):
        engine = make_engine(num_pages=128, page_size=4, backend=backend, prefill_attention=attention,
                             max_num_batched_tokens=64, max_num_seqs=8, prefix_caching=False)
        got[pad] = _run(engine, pad)
    (plain, plain_shapes), (padded, padded_shapes) = got[False], got[True]
    assert [(r, t) for r, t, _ in plain] == [(r, t) for r, t, _ in padded] and len(plain) == 5 * 4
    assert [lp for *_, lp in plain] == pytest.approx([lp for *_, lp in padded], abs=1e-5)
    mixed = [(t, real) for t, real in padded_shapes if real is not None]
    assert len(mixed) == 3  # the three steps with prefill rows, each padded to a power of two
    for t, real in mixed:
        assert t >= real and t & (t - 1) == 0
    assert any(t > real for t, real in mixed)
    assert all(real is None for _, real in plain_shapes)


@pytest.mark.parametrize("backend,attention", [("torch", "varlen"), ("triton", "paged")])
def test_mixed_pieces_on_static_buffers_equal_one_forward(make_engine, backend, attention):
    """``mixed_graphs: eager``: the pieces a GPU captures, run eagerly over their static buffers
    (inputs and fixed-length LoRA tables copied in per step): the same tokens and logprobs as the
    plain eager forward; one set of pieces per (token bucket, rank block), reused."""
    config = dict(num_pages=128, page_size=4, backend=backend, prefill_attention=attention,
                  max_num_batched_tokens=64, max_num_seqs=8, prefix_caching=False)
    plain, _ = _run(make_engine(**config), False)
    engine = make_engine(**config, mixed_graphs="eager")
    assert engine.runner.mixed_pieces == "eager" and engine.runner.pad_mixed
    engine.runner.pad_mixed = True
    events, shapes = _run(engine, True)
    assert [(r, t) for r, t, _ in plain] == [(r, t) for r, t, _ in events]
    assert [lp for *_, lp in plain] == pytest.approx([lp for *_, lp in events], abs=1e-5)
    built = engine.runner._mixed
    assert built and all(rows in engine.runner.token_buckets for rows, _ in built)
    assert len(built) <= len({t for t, real in shapes if real is not None})  # reused across steps


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_mixed_graphs_on_cuda_equal_one_forward(make_engine):
    """``mixed_graphs: on``: each piece captured as a CUDA graph (fp32, Triton kernels)."""
    config = dict(num_pages=128, page_size=4, backend="triton", max_num_batched_tokens=64, max_num_seqs=8,
                  prefix_caching=False)
    plain, _ = _run(make_engine(**config), False)
    engine = make_engine(**config, mixed_graphs="on")
    events, _ = _run(engine, True)
    assert [(r, t) for r, t, _ in plain] == [(r, t) for r, t, _ in events]
    assert [lp for *_, lp in plain] == pytest.approx([lp for *_, lp in events], abs=1e-4)
    assert all(p.graphs is not None for p in engine.runner._mixed.values())
