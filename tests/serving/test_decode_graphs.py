"""Decode steps padded to batch-size buckets (what the CUDA graphs run) and graph replay itself."""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.serving import EngineConfig, GenerationRequest, SamplingParams
from lightning_lorafusion.serving.decode_graphs import bucket_for, graph_buckets
from lightning_lorafusion.specs import ConfigError

from test_generation import CASES

LOGPROBS = SamplingParams(max_new_tokens=9, temperature=0.0, ignore_eos=True, logprobs=3)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _requests(cases, sampling=LOGPROBS):
    return [GenerationRequest(prompt_token_ids=p, adapter=a, sampling=sampling) for p, a in cases]


def test_buckets():
    assert graph_buckets(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert graph_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert graph_buckets(1) == (1,)
    buckets = graph_buckets(100)
    assert [bucket_for(n, buckets) for n in (1, 3, 8, 9, 64, 65, 100)] == [1, 4, 8, 16, 64, 100, 100]
    with pytest.raises(ValueError):
        bucket_for(101, buckets)


def test_cuda_graphs_config():
    with pytest.raises(ConfigError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="yes")


def test_cuda_graphs_on_without_cuda_is_refused(make_engine):
    with pytest.raises(ConfigError, match="cuda_graphs='on'"):
        make_engine(num_pages=64, page_size=4, cuda_graphs="on")


def _decode_ready(engine, cases):
    """Submit ``cases``, run their prefill step and schedule the next (a decode-only step, its
    pages taken); -> the decode rows. The engine must read each step before the next call
    (``async_decode`` off): the prefill step's tokens are on the host then."""
    for r in _requests(cases):
        engine.submit(r)
    engine.step()
    plan = engine.scheduler.schedule()
    assert not plan.prefill and len(plan.decode) == len(cases) and all(st.output_ids for st in plan.decode)
    return plan.decode


def test_padded_decode_step_equals_unpadded_and_writes_only_the_scratch_page(make_engine):
    """The graphs' inputs run eagerly on the CPU: 6 rows padded to the bucket of 8 give the
    same logits for the real rows, and the padding rows write nothing but the scratch page."""
    engine = make_engine(num_pages=96, page_size=4)
    runner, pool = engine.runner, engine.pool
    decode = _decode_ready(engine, CASES)
    with torch.no_grad():
        plain = runner.decode_logits(decode).clone()
        kv_before = pool.kv[:pool.num_pages].clone()
        runner.pad_decode = True
        padded = runner.decode_logits(decode)
    assert padded.shape == plain.shape == (len(CASES), engine.model_config.vocab_size)
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)
    # the real rows rewrite their own KV (the same values up to rounding: a GEMM of 8 rows may
    # round differently from one of 6, as on an AMD EPYC host); no other page is touched
    kv = pool.kv[:pool.num_pages]
    torch.testing.assert_close(kv, kv_before, rtol=1e-5, atol=1e-5)
    theirs = sorted({p for st in decode for p in st.pages})
    others = [p for p in range(pool.num_pages) if p not in set(theirs)]
    assert torch.equal(kv[others], kv_before[others])
    inputs = runner.decode_inputs
    rows = bucket_for(len(CASES), runner.buckets)
    assert rows == 8
    assert inputs.step[2, len(CASES):rows].eq(pool.scratch_page).all()
    assert inputs.lora_ranks[:, len(CASES):].eq(0).all()


def _check_tables(engine):
    """Wrap the engine's table loading so every step checks the page table against the rows."""
    inputs = engine.runner.decode_inputs
    load = inputs.load_tables

    def checked(decode, pages_moved):
        rebuilt = load(decode, pages_moved)
        for i, st in enumerate(decode):
            assert inputs.page_table[i, :len(st.pages)].tolist() == st.pages
        return rebuilt

    inputs.load_tables = checked


@pytest.mark.parametrize("arrivals", [False, True])
def test_padded_generation_equals_unpadded(make_engine, arrivals):
    """Whole generations with every decode step padded (and so every module's gather run for
    adapter rows): same tokens and logprobs as unpadded, also with requests joining mid-run
    (mixed prefill + decode steps, rows changing) in a pool so small that adapters are evicted
    and paged back in; the page table always matches the rows' pages."""
    config = dict(num_pages=40, page_size=4, kv_watermark=0.0)
    reference = make_engine(**config)
    padded = make_engine(**config)
    padded.runner.pad_decode = True
    _check_tables(padded)
    results = []
    for engine in (reference, padded):
        reqs = _requests(CASES)
        if not arrivals:
            results.append([(r.token_ids, r.logprobs, r.top_logprobs) for r in engine.generate(reqs)])
            continue
        out = {r.request_id: ([], [], []) for r in reqs}
        step = 0
        while step < len(reqs) or engine.scheduler.has_work():
            if step < len(reqs):
                engine.submit(reqs[step])
            for ev in engine.step():
                if ev.token_id is not None:
                    for acc, value in zip(out[ev.request_id], (ev.token_id, ev.logprob, ev.top_logprobs)):
                        acc.append(value)
            step += 1
            assert step < 400
        results.append([out[r.request_id] for r in reqs])
    for (tok_a, lp_a, top_a), (tok_b, lp_b, top_b) in zip(*results):
        assert list(tok_a) == list(tok_b) and len(tok_a) == LOGPROBS.max_new_tokens
        assert list(lp_a) == pytest.approx(list(lp_b), abs=1e-5)
        assert [sorted(t) for t in top_a] == [sorted(t) for t in top_b]
    assert padded.stats()["adapter_evictions_total"] > 0


@cuda
def test_graph_replay_equals_eager_decode(model_dir, adapter_dirs, hf_reference):
    """On a GPU (fp32): a replayed decode step gives the eager padded step's logits, and whole
    generations with graphs on equal graphs off and HF + PEFT's greedy tokens."""
    from lightning_lorafusion.serving import Engine
    from lightning_lorafusion.serving.config import EngineTuning

    def engine(graphs):  # read after each step (``_decode_ready`` plans the decode step itself)
        return Engine.from_pretrained(str(model_dir), adapter_dirs, EngineConfig(
            num_pages=96, page_size=4, max_num_seqs=16, cuda_graphs=graphs,
            tuning=EngineTuning(async_decode="off")), device="cuda",
            dtype=torch.float32)

    on, off = engine("on"), engine("off")
    assert on.runner.graphs is not None and off.runner.graphs is None
    decode = _decode_ready(on, CASES)
    with torch.no_grad():
        replayed = on.runner.decode_logits(decode).clone()
        on.runner.graphs, graphs = None, on.runner.graphs  # same padded inputs, eagerly
        eager = on.runner.decode_logits(decode).clone()
        on.runner.graphs = graphs
    torch.testing.assert_close(replayed, eager, rtol=1e-6, atol=1e-6)
    for r in list(on.scheduler.running):
        on.abort(r.request_id)
    on.step()

    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, logprobs=2)
    got_on = on.generate(_requests(CASES, greedy))
    got_off = off.generate(_requests(CASES, greedy))
    for (prompt, adapter), a, b in zip(CASES, got_on, got_off):
        assert list(a.token_ids) == list(b.token_ids) == hf_reference.generate(prompt, adapter, 8)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    on.close()
    off.close()


@cuda
def test_decode_lora_shrinks_beside_the_gemms_give_the_same_logits(model_dir, adapter_dirs, monkeypatch):
    """On a GPU (fp32): a decode step's LoRA shrinks launched on the second stream beside the
    frozen GEMMs (``lora_gather.BESIDE_MAX_ROWS``) give the logits of the shrinks in stream
    order bit for bit, replayed from the decode graphs and eagerly."""
    from lightning_lorafusion.kernels import lora_gather
    from lightning_lorafusion.serving import Engine
    from lightning_lorafusion.serving.config import EngineTuning

    monkeypatch.setattr(lora_gather, "BESIDE_MAX_ROWS", 64)
    engine = Engine.from_pretrained(str(model_dir), adapter_dirs, EngineConfig(
        num_pages=96, page_size=4, max_num_seqs=16, cuda_graphs="on", tuning=EngineTuning(async_decode="off")),
        device="cuda", dtype=torch.float32)
    runner = engine.runner
    assert runner.model.lora_stream is not None
    runner.decode_lora_beside = "few"  # (the row bound decides; "wide" takes every step beside)
    decode = _decode_ready(engine, CASES)
    got = {}
    with torch.no_grad():
        for beside in (64, None):
            monkeypatch.setattr(lora_gather, "BESIDE_MAX_ROWS", beside)
            runner.capture_decode_graphs()
            got[beside, "replayed"] = runner.decode_logits(decode).clone()
            runner.graphs, graphs = None, runner.graphs
            got[beside, "eager"] = runner.decode_logits(decode).clone()
            runner.graphs = graphs
    for how in ("replayed", "eager"):
        assert torch.equal(got[64, how], got[None, how]), how
    engine.close()
