"""Where a run's time goes (serving/step_times.py): the engine's per-step kinds and times add up
to its busy time, each step lands in the kind of what it ran, and the breakdown by kind sums."""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.serving import GenerationRequest, SamplingParams
from lightning_lorafusion.serving.decode_graphs import bucket_for
from lightning_lorafusion.serving.floor import FloorShape, StepLedger, breakdown, run_floor
from lightning_lorafusion.serving.step_times import StepClock, StepKind, breakdown_table

PROMPTS = {"x": ([5, 6, 7, 8, 9], "all4"), "y": ([9, 8, 7, 6, 5, 4, 3], "attn2"), "z": ([11, 12, 13], None),
           "w": ([20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], None)}


def _requests(prefix: str, max_new: int = 5):
    sp = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    return [GenerationRequest(prompt_token_ids=p, adapter=a, sampling=sp, request_id=prefix + rid)
            for rid, (p, a) in PROMPTS.items()]


def _run_with_ledger(engine, pad_decode: bool = False):
    engine.runner.pad_decode = pad_decode
    before = engine.stats()["step_seconds_total"]
    ledger = engine.enable_step_ledger()
    engine.generate(_requests("a"))
    for r in _requests("b", 3)[2:]:  # a second wave on the base, admitted while nothing runs
        engine.submit(r)
    while engine.has_work():
        engine.step()
    engine.disable_step_ledger()
    return ledger, engine.stats()["step_seconds_total"] - before


@pytest.mark.parametrize("tuning", [dict(async_decode="off"),
                                    dict(async_decode="on"),
                                    dict(async_decode="on", enable_chunked_prefill=True, max_num_batched_tokens=6),
                                    dict(async_decode="off", mixed_graphs="eager", pad_decode=True)])
def test_step_times_sum_to_busy_time_and_kinds_match_the_steps(make_engine, tuning):
    pad_decode = tuning.pop("pad_decode", False)
    engine = make_engine(prefix_caching=False, max_num_seqs=4, **tuning)
    ledger, busy = _run_with_ledger(engine, pad_decode)
    clock, runner = ledger.clock, engine.runner
    times = clock.times
    assert len(times) == len(ledger.steps) > 0 and not clock.cuda
    # the steps' wall times are the engine's busy time; with the time between them and the calls
    # that only read a launched step's tokens, the whole span from the first step to the last read
    assert sum(t.wall_s for t in times) == pytest.approx(busy, rel=1e-9, abs=1e-9)
    span = clock.last_end - times[0].start
    assert sum(t.wall_s for t in times) + clock.gap_s + clock.drain_s == pytest.approx(span, rel=1e-9, abs=1e-9)
    # each step's gap: the time between steps before it (reads of a launched step's tokens aside)
    assert sum(t.gap_s for t in times) <= clock.gap_s + 1e-9
    assert times[0].gap_s == 0.0 and sum(t.gap_s for t in times[1:]) > 0  # the second wave waited
    assert (clock.drain_s > 0) == (tuning["async_decode"] == "on")  # the last call read the last step
    for record, t in zip(ledger.steps, times):
        kind = t.kind
        assert t.schedule_s + t.launch_s + t.wait_s + t.emit_s <= t.wall_s + 1e-9 and t.launch_s > 0
        assert kind.adapters == ("lora" if record.adapters else "base")
        if record.prefill:
            assert kind.phase == "mixed"
            assert kind.bucket == bucket_for(record.tokens, runner.token_buckets)
            assert kind.mode == ("pieces" if tuning.get("mixed_graphs") == "eager" else "eager")
        else:
            assert kind.phase == "decode" and kind.mode == "eager"
            assert kind.bucket == bucket_for(record.decode_rows, runner.buckets)
        assert t.gpu_s is None and t.events is None  # a CPU: no device events
    kinds = {t.kind.phase for t in times}
    assert kinds == {"decode", "mixed"}
    assert {t.kind.adapters for t in times} == {"lora", "base"}


def test_breakdown_by_kind_sums_to_the_run(make_engine):
    engine = make_engine(prefix_caching=False, max_num_seqs=4, async_decode="on")
    ledger, busy = _run_with_ledger(engine)
    shape = FloorShape.from_config(engine.model_config)
    report = breakdown(ledger, shape, peak_flops=1e9, bandwidth=1e9)
    total = report["total"]
    assert report["gpu_times"] is False and total["gpu_s"] is None and total["gpu_gap_s"] is None
    assert total["steps"] == len(ledger.steps) == sum(r["steps"] for r in report["kinds"])
    assert total["wall_s"] == pytest.approx(busy, rel=1e-9)
    assert total["wall_s"] == pytest.approx(sum(r["wall_s"] for r in report["kinds"]), rel=1e-9)
    floor = run_floor(ledger, shape, peak_flops=1e9, bandwidth=1e9)["floor_s"]
    assert total["floor_s"] == pytest.approx(floor, rel=1e-9)
    assert total["floor_s"] == pytest.approx(sum(r["floor_s"] for r in report["kinds"]), rel=1e-9)
    for part, s in total["part_floor_s"].items():  # each part's own floor, summed by kind
        assert s == pytest.approx(sum(r["part_floor_s"][part] for r in report["kinds"]), rel=1e-9)
    assert sum(total["part_floor_s"].values()) >= total["floor_s"] * (1 - 1e-9)
    assert total["floor_over_gpu"] == pytest.approx(floor / busy, rel=1e-9)  # floor / wall without GPU times
    by_label = {r["kind"]: r for r in report["kinds"]}
    expected = {}
    for t in ledger.clock.times:
        expected[t.kind.label] = expected.get(t.kind.label, 0) + 1
    assert {k: r["steps"] for k, r in by_label.items()} == expected
    tokens = {}  # each kind's tokens fed: a mixed step's real rows, a decode step's rows
    for t, rec in zip(ledger.clock.times, ledger.steps):
        tokens[t.kind.label] = tokens.get(t.kind.label, 0) + rec.tokens
    assert {k: r["tokens"] for k, r in by_label.items()} == tokens
    assert total["tokens"] == sum(s.tokens for s in ledger.steps) > 0
    assert total["gap_s"] == ledger.clock.gap_s > 0
    text = breakdown_table(report)
    assert all(label in text for label in expected) and "between steps" in text


def test_clock_by_hand():
    clock = StepClock(cuda=False)
    clock.add("wait_s", 0.5)  # a read before the step began (the previous step's tokens)
    clock.begin(10.0)
    clock.add("schedule_s", 0.25)
    clock.end(11.0, StepKind("decode", 8, "lora", "graph"))
    clock.drop_phases()
    clock.begin(13.0)
    clock.end(13.5, StepKind("mixed", 64, "base", "eager"))
    clock.drain(14.0, 14.25)
    first, second = clock.times
    assert (first.wall_s, first.gap_s, first.wait_s, first.schedule_s) == (1.0, 0.0, 0.5, 0.25)
    assert (second.wall_s, second.gap_s, second.wait_s) == (0.5, 2.0, 0.0)
    assert clock.drain_s == 0.25 and first.kind.label == "decode b8 lora graph"
    assert second.kind.label == "mixed t64 base eager"
    ledger = StepLedger(base_weight_bytes=1, kv_bytes_per_token=1, adapter_elem_bytes=1, clock=clock)
    shape = FloorShape(num_layers=1, num_heads=1, head_dim=1, hidden_size=1, vocab_size=1,
                       module_dims={"q_proj": (1, 1)})
    with pytest.raises(ValueError, match="2 step times"):  # no step records beside the times
        breakdown(ledger, shape, peak_flops=1.0, bandwidth=1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: CUDA timing events")
def test_step_times_read_cuda_events_gpu(make_engine):
    engine = make_engine(prefix_caching=False, max_num_seqs=4, device="cuda")
    ledger, busy = _run_with_ledger(engine)
    report = breakdown(ledger, FloorShape.from_config(engine.model_config), peak_flops=1e12, bandwidth=1e11)
    times = ledger.clock.times
    assert ledger.clock.cuda and report["gpu_times"] is True
    assert all(t.gpu_s is not None and t.gpu_s > 0 for t in times)
    assert all(t.gpu_gap_s is not None for t in times[1:]) and report["total"]["gpu_gap_s"] >= 0
    assert report["total"]["gpu_s"] == pytest.approx(sum(t.gpu_s for t in times), rel=1e-9)
    assert report["total"]["floor_over_gpu"] == pytest.approx(report["total"]["floor_s"] / report["total"]["gpu_s"])
