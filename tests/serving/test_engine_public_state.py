"""``Engine.async_decode`` and ``Engine.has_work()``: what a caller driving ``step()`` itself
(the benchmarks) reads instead of the engine's private state."""

from __future__ import annotations

from lightning_lorafusion.serving import GenerationRequest, SamplingParams


def test_async_decode_resolves_the_config(make_engine):
    assert make_engine(with_adapters=False, async_decode="on").async_decode is True
    assert make_engine(with_adapters=False, async_decode="off").async_decode is False
    assert make_engine(with_adapters=False, async_decode="auto").async_decode is False  # auto: CUDA only


def test_has_work_until_the_last_step_is_read(make_engine):
    for mode in ("off", "on"):
        engine = make_engine(with_adapters=False, async_decode=mode)
        assert not engine.has_work()
        engine.submit(GenerationRequest(prompt_token_ids=[5, 6, 7], request_id="a",
                                        sampling=SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)))
        assert engine.has_work()
        finished, steps = False, 0
        while engine.has_work():
            events = engine.step()
            finished = finished or any(e.finish_reason is not None for e in events)
            steps += 1
            assert steps < 50
        assert finished and engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0
