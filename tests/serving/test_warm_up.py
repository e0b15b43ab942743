"""Engine.warm_up: synthetic requests through the base and one adapter (whatever ranks are
loaded: nothing compiled depends on them), alone and mixed, before serving; nothing of them stays behind (pages, cached prefixes, running requests),
and what the engine answers afterwards is what a fresh engine answers."""

from __future__ import annotations

import pytest

from lightning_lorafusion.serving import GenerationRequest, SamplingParams
from lightning_lorafusion.specs import ConfigError

PROMPTS = [([5, 9, 11, 3, 7], "all4"), ([2, 8, 8, 1], "mlp8"), ([4, 4, 6, 30, 12, 9], None), ([13, 2, 5], "attn2")]


def _answers(engine):
    sp = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    reqs = [GenerationRequest(prompt_token_ids=p, adapter=a, sampling=sp, request_id=f"q{i}")
            for i, (p, a) in enumerate(PROMPTS)]
    return [r.token_ids for r in engine.generate(reqs)]


def test_warm_up_runs_the_base_and_one_adapter_alone_and_mixed_and_leaves_nothing(make_engine):
    engine = make_engine(num_pages=96, page_size=4)
    before = engine.stats()
    done = engine.warm_up(prompt_len=6)
    # adapters of ranks 2, 4, 8 loaded; base + the first adapter alone (2), together (2), two of
    # each with longer prompts (4): no request per rank
    assert (done["requests"], done["rounds"], done["ranks"]) == (8, 4, [2, 4, 8])
    stats = engine.stats()
    assert stats["requests_total"] - before["requests_total"] == 8
    assert stats["running"] == stats["waiting"] == stats["kv_pages_used"] == 0  # prefix pages dropped too
    assert done["prefix_pages_freed"] > 0 and done["seconds"] >= 0
    assert _answers(engine) == _answers(make_engine(num_pages=96, page_size=4))


def test_warm_up_fits_a_small_pool_and_a_short_context(make_engine):
    """Its prompts shrink to what the context and the pool hold (half of what the adapter leaves)."""
    engine = make_engine(num_pages=24, page_size=4, max_model_len=16)
    done = engine.warm_up(prompt_len=40, max_new_tokens=3)
    assert done["requests"] == 8 and engine.stats()["kv_pages_used"] == 0
    with pytest.raises(ConfigError, match="must be >= 1"):
        engine.warm_up(prompt_len=0)


def test_warm_up_without_adapters(make_engine):
    engine = make_engine(with_adapters=False, num_pages=64, page_size=4)
    done = engine.warm_up(prompt_len=4)
    assert (done["requests"], done["ranks"]) == (1 + 1 + 2, [])


def test_warm_up_builds_the_mixed_pieces_of_every_bucket(make_engine):
    """With mixed-step pieces on, warm-up builds (on a GPU: captures) every token bucket's pieces,
    one set per bucket for any ranks, so no step mid-run pays a capture; answers afterwards equal
    a fresh engine's. Pieces off: none."""
    config = dict(num_pages=96, page_size=4, max_num_batched_tokens=64, max_num_seqs=8)
    engine = make_engine(**config, mixed_graphs="eager")
    done = engine.warm_up(prompt_len=6)
    buckets = engine.runner.token_buckets
    assert set(engine.runner._mixed) == set(buckets)
    assert 0 < done["mixed_piece_keys"] <= len(buckets)  # the rounds built some keys already
    assert done["captures"]["mixed_piece_keys"] == len(buckets) and done["captures"]["decode_graph_keys"] == 0
    assert engine.runner.build_mixed_pieces() == 0  # nothing left to build, whatever ranks come later
    assert _answers(engine) == _answers(make_engine(**config))
    assert make_engine(**config).warm_up(prompt_len=6)["mixed_piece_keys"] == 0


def test_warm_up_logs_each_stage_as_it_ends(make_engine, caplog):
    """A warm-up cut short (a benchmark's limit, a killed start) still shows where its time went."""
    engine = make_engine(num_pages=96, page_size=4)
    with caplog.at_level("INFO", logger="lightning_lorafusion.serving"):
        done = engine.warm_up(prompt_len=6)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up:")]
    assert any("compiled ahead" in m for m in lines) and any("token buckets built" in m for m in lines)
    assert sum(m.startswith("warm-up: round ") for m in lines) == done["rounds"]
