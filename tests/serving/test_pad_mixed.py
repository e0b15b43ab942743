"""Mixed steps padded to token buckets (``ModelRunner.pad_mixed``: the fixed shapes a captured
mixed step needs; the decode rows first with their LoRA gathered per row, the prefill rows'
LoRA by row tiles): the same tokens and logprobs as unpadded eager steps (prefill rows first),
with the torch references and with the Triton kernels (interpreter, fp32), through prefills
that arrive while others decode."""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.serving import GenerationRequest, SamplingParams
from lightning_lorafusion.serving import mixed_settings as pieces_module

CASES = [([5, 9, 11, 3, 7, 2, 2], "all4"), ([2, 8, 8, 1], "mlp8"), ([4, 4, 6, 30, 12, 9, 1, 1, 3], None),
         ([13, 2, 5, 6, 7], "attn2"), ([9, 9, 9], "all4")]


def _run(engine, pad: bool, layouts: list | None = None):
    layouts = [] if layouts is None else layouts
    engine.runner.pad_mixed = pad
    sp = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)
    reqs = [GenerationRequest(prompt_token_ids=p, adapter=a, sampling=sp, request_id=f"r{i}")
            for i, (p, a) in enumerate(CASES)]
    # later prompts join running decodes; r0 and r4 (one adapter) decode side by side from step 1
    arrive = {0: [reqs[0], reqs[1], reqs[4]], 1: reqs[2:3], 2: reqs[3:4]}
    events, shapes = [], []
    forward = engine.runner.forward

    def recording(batch):
        shapes.append((batch.input_ids.shape[0], batch.real_rows))
        if batch.real_rows is not None:  # a padded step: where its rows and LoRA tables are
            segments = batch.prefill_lora.segments if batch.prefill_lora is not None else ()
            layouts.append((batch.decode_first, batch.prefill_start, min((a for a, _, _ in segments), default=None),
                            None if batch.decode_scales is None else batch.decode_scales.shape[0]))
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
    got, layouts = {}, []
    for pad in (False, True):
        engine = make_engine(num_pages=128, page_size=4, backend=backend, prefill_attention=attention,
                             max_num_batched_tokens=64, max_num_seqs=8, prefix_caching=False)
        got[pad] = _run(engine, pad, layouts if pad else None)
    (plain, plain_shapes), (padded, padded_shapes) = got[False], got[True]
    assert [(r, t) for r, t, _ in plain] == [(r, t) for r, t, _ in padded] and len(plain) == 5 * 4
    assert [lp for *_, lp in plain] == pytest.approx([lp for *_, lp in padded], abs=1e-5)
    mixed = [(t, real) for t, real in padded_shapes if real is not None]
    assert len(mixed) == 3  # the three steps with prefill rows, each padded to a power of two
    for t, real in mixed:
        assert t >= real and t & (t - 1) == 0
    assert any(t > real for t, real in mixed)
    assert all(real is None for _, real in plain_shapes)
    # decode rows first, their LoRA from the decode tables (one table row per decode row), the
    # prefill segments after them: step 0 has no decode rows, steps 1 and 2 have 3 and 4; the
    # prompt of step 1 (r2) has no adapter, so no segment
    assert layouts == [(True, 0, 0, None), (True, 3, None, 3), (True, 4, 4, 4)]


@pytest.mark.parametrize("backend,attention", [("torch", "varlen"), ("triton", "varlen")])
def test_padded_chunked_prefill_with_decode_rows_first(make_engine, backend, attention):
    """Chunked prefill into a small budget, padded and run as eager pieces: every step's decode
    rows come first, the prompts' chunks after them (fresh chunks varlen from the row after the
    decode rows, later chunks over their pages); the same tokens and logprobs as unpadded steps."""
    config = dict(num_pages=128, page_size=4, backend=backend, prefill_attention=attention,
                  max_num_batched_tokens=16, max_num_seqs=8, prefix_caching=False, enable_chunked_prefill=True)
    plain, _ = _run(make_engine(**config), False)
    engine = make_engine(**config, mixed_graphs="eager")
    layouts = []
    events, shapes = _run(engine, True, layouts)
    assert [(r, t) for r, t, _ in plain] == [(r, t) for r, t, _ in events] and len(plain) == 5 * 4
    assert [lp for *_, lp in plain] == pytest.approx([lp for *_, lp in events], abs=1e-5)
    assert all(first for first, *_ in layouts)
    # some padded steps hold decode rows before a prompt's chunk
    assert any(start > 0 and seg is not None and seg >= start for _, start, seg, _ in layouts)
    assert all(t in engine.runner.token_buckets for t, real in shapes if real is not None)


@pytest.mark.parametrize("backend,attention", [("torch", "varlen"), ("triton", "paged")])
def test_mixed_pieces_on_static_buffers_equal_one_forward(make_engine, backend, attention, monkeypatch):
    """``mixed_graphs: eager``: the pieces a GPU captures, run eagerly over their static buffers
    (inputs and fixed-length LoRA tables copied in per step): the same tokens and logprobs as the
    plain eager forward; one set of pieces per token bucket, reused."""
    config = dict(num_pages=128, page_size=4, backend=backend, prefill_attention=attention,
                  max_num_batched_tokens=64, max_num_seqs=8, prefix_caching=False)
    plain, _ = _run(make_engine(**config), False)
    engine = make_engine(**config, mixed_graphs="eager")
    assert engine.runner.mixed_pieces == "eager" and engine.runner.pad_mixed
    engine.runner.pad_mixed = True
    q_ptrs = {}

    class Recorded(pieces_module.MixedPieces):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            q_ptrs[id(self)] = self.q.data_ptr()

    monkeypatch.setattr(pieces_module, "MixedPieces", Recorded)
    events, shapes = _run(engine, True)
    assert [(r, t) for r, t, _ in plain] == [(r, t) for r, t, _ in events]
    assert [lp for *_, lp in plain] == pytest.approx([lp for *_, lp in events], abs=1e-5)
    built = engine.runner._mixed
    assert built and all(rows in engine.runner.token_buckets for rows in built)
    # attention reads each piece's q through one buffer fixed at construction, never a tensor a
    # piece allocated (under capture that would be wherever the last capture put it)
    for pieces in built.values():
        assert pieces.q.data_ptr() == q_ptrs[id(pieces)]
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


@pytest.mark.parametrize("mode", ["eager", pytest.param("on", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a GPU"))])
def test_mixed_pieces_on_a_wide_model(tmp_path, write_adapter, mode):
    """Pieces (eager; on a GPU also captured) on a model wide and deep enough that a graph pool
    reuses and splits large blocks between captures (the tiny model's tensors all fit small
    blocks): fp32 tokens and logprobs equal to the plain engine's, prompts of 40-300 tokens
    joining running decodes, adapters of ranks 8 and 16 and the base in the same steps."""
    from lightning_lorafusion.model.random_model import write_random_llama
    from lightning_lorafusion.serving import Engine, EngineConfig
    from lightning_lorafusion.serving.config import EngineTuning

    model_dir = tmp_path / "wide"
    write_random_llama(model_dir, vocab_size=256, hidden_size=512, intermediate_size=1536, num_layers=4,
                       num_heads=8, num_kv_heads=4, init_std=0.05, max_positions=1024, seed=5)
    adapters = {f"a{r}": str(write_adapter(model_dir, tmp_path / f"a{r}", rank=r, alpha=2.0 * r,
                                                     targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                              "up_proj", "down_proj"], seed=r))
                for r in (8, 16)}
    g = torch.Generator().manual_seed(0)
    lens = [40, 300, 120, 77, 250, 64, 180, 90]
    names = ["a8", "a16", None, "a8", "a16", "a8", None, "a16"]
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    results = {}
    device = "cuda" if mode == "on" else "cpu"
    for m in ("off", mode):
        engine = Engine.from_pretrained(str(model_dir), adapters, EngineConfig(
            num_pages=512, page_size=16, max_num_batched_tokens=1024, max_num_seqs=16, prefix_caching=False,
            tuning=EngineTuning(mixed_graphs=m)), device=device, dtype=torch.float32)
        reqs = [GenerationRequest(prompt_token_ids=torch.randint(1, 256, (n,), generator=g).tolist(), adapter=a,
                                  sampling=sp, request_id=f"r{i}") for i, (n, a) in enumerate(zip(lens, names))]
        g = torch.Generator().manual_seed(0)  # the same prompts for the second engine
        events = []
        for step in range(20):
            for r in reqs[2 * step:2 * step + 2]:  # two arrivals per step while earlier ones decode
                engine.submit(r)
            events += [(ev.request_id, ev.token_id, ev.logprob) for ev in engine.step() if ev.token_id is not None]
        if m != "off":
            assert engine.runner._mixed and all((p.graphs is not None) == (m == "on")
                                                for p in engine.runner._mixed.values())
        engine.close()
        results[m] = events
    off, on = results["off"], results[mode]
    assert len(off) == len(lens) * 6
    assert [(r, t) for r, t, _ in off] == [(r, t) for r, t, _ in on]
    assert [lp for *_, lp in off] == pytest.approx([lp for *_, lp in on], abs=1e-3)


def test_mixed_graphs_modes_resolve_per_device(make_engine):
    """"auto" (the default) captures mixed steps only where decode steps are CUDA graphs: off on
    the CPU; "on" without CUDA is a clear error; a bad value is refused by the config."""
    from lightning_lorafusion.serving import EngineConfig
    from lightning_lorafusion.serving.config import EngineTuning
    from lightning_lorafusion.specs import ConfigError

    assert EngineConfig().tuning.mixed_graphs == "auto"
    engine = make_engine(num_pages=64, page_size=4)
    assert engine.runner.mixed_pieces is None and not engine.runner.pad_mixed
    assert make_engine(num_pages=64, page_size=4, mixed_graphs="eager").runner.mixed_pieces == "eager"
    with pytest.raises(ConfigError, match="mixed_graphs='on' needs a CUDA device"):
        make_engine(num_pages=64, page_size=4, mixed_graphs="on", device="cpu")
    with pytest.raises(ConfigError, match="allowed: auto, on, off, eager"):
        EngineTuning(mixed_graphs="yes")


def test_token_buckets_between_powers_of_two():
    from lightning_lorafusion.serving.decode_graphs import token_buckets

    assert token_buckets(8192, "fine") == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096,
                                           6144, 8192)
    assert token_buckets(8192) == token_buckets(8192, "fine")
    assert token_buckets(8192, "quarters") == (
        1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096,
        5120, 6144, 7168, 8192)
    assert token_buckets(8192, "pow2") == tuple(2 ** i for i in range(14))
    assert token_buckets(600) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 600)  # the budget is the last bucket
    with pytest.raises(ValueError, match="token buckets"):
        token_buckets(64, "thirds")


def test_fine_token_buckets_pad_less_and_give_the_same_tokens(make_engine):
    """A step of 635 tokens (eight prompts) is padded to 768 with "fine" buckets (the default), 640
    with "quarters" and 1,024 with "pow2": the same tokens and logprobs as unpadded steps every way
    (eager pieces, torch references)."""
    prompts = [[(7 * i + j) % 60 + 3 for j in range(n)] for i, n in enumerate((90,) * 7 + (5,))]
    sp = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True, logprobs=1)
    got = {}
    for mode in ("plain", "quarters", "fine", "pow2"):
        engine = make_engine(num_pages=512, page_size=4, max_num_batched_tokens=1024, max_num_seqs=8,
                             prefix_caching=False, **({} if mode == "plain" else {"mixed_graphs": "eager"}))
        if mode in ("quarters", "pow2"):
            engine.runner.token_bucket_mode = mode
        shapes = []
        forward = engine.runner.forward

        def recording(batch, forward=forward, shapes=shapes):
            shapes.append((batch.input_ids.shape[0], batch.real_rows))
            return forward(batch)

        engine.runner.forward = recording
        results = engine.generate([GenerationRequest(prompt_token_ids=p, adapter=a, sampling=sp)
                                   for p, a in zip(prompts, [None, "all4", "mlp8", None] * 2)])
        got[mode] = ([list(r.token_ids) for r in results], [lp for r in results for lp in r.logprobs], shapes)
    assert got["quarters"][2][0] == (640, 635) and got["fine"][2][0] == (768, 635)
    assert got["pow2"][2][0] == (1024, 635) and got["plain"][2][0] == (635, None)
    for mode in ("quarters", "fine", "pow2"):
        assert got[mode][0] == got["plain"][0]
        assert got[mode][1] == pytest.approx(got["plain"][1], abs=1e-5)
