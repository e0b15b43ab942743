"""Two ways a mixed step spends less device time on what is not its own work: attention's
launches write their rows of the layer's output in place (``EngineTuning.attention_in_place``:
no concatenation, no copy into the pieces' buffer), and steps above ``mixed_graph_max_tokens``
run unpadded and eagerly instead of padded to a bucket. Both give the previous path's tokens
and logprobs (fp32; torch references and the Triton kernels in the interpreter)."""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.serving import GenerationRequest, SamplingParams
from lightning_lorafusion.serving.config import EngineTuning
from lightning_lorafusion.serving.decode_graphs import GRAPH_MAX_FLOPS, graph_token_limit
from lightning_lorafusion.specs import ConfigError

# prompts joining running decodes (steps of 11-42 rows with the decode rows), adapters and the base
PROMPTS = [(17, "all4"), (9, None), (30, "mlp8"), (4, "attn2"), (12, None)]


def _run(engine, prompts=PROMPTS, new=3):
    """Greedy tokens and logprobs of ``prompts`` arriving over three steps (two, two, the rest),
    ``new`` tokens each, and each step's (rows, real rows, kind)."""
    sp = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True, logprobs=1)
    reqs = [GenerationRequest(prompt_token_ids=[(5 * i + j) % 50 + 3 for j in range(n)], adapter=a, sampling=sp,
                              request_id=f"r{i}") for i, (n, a) in enumerate(prompts)]
    arrive = {0: reqs[:2], 1: reqs[2:4], 2: reqs[4:]}
    steps, forward = [], engine.runner.forward

    def recording(batch):
        out = forward(batch)
        steps.append((batch.input_ids.shape[0], batch.real_rows, engine.runner.step_kind.label))
        return out

    engine.runner.forward = recording
    events = []
    for step in range(new + 4):
        for r in arrive.get(step, []):
            engine.submit(r)
        events += [(ev.request_id, ev.token_id, ev.logprob) for ev in engine.step() if ev.token_id is not None]
    engine.runner.forward = forward
    assert len(events) == new * len(prompts)
    return events, steps


CONFIG = dict(num_pages=256, page_size=4, max_num_batched_tokens=64, max_num_seqs=8, prefix_caching=False,
              mixed_graphs="eager")


@pytest.mark.parametrize("backend,attention", [("torch", "varlen"), ("triton", "paged")])
def test_attention_in_place_equals_concatenated_outputs(make_engine, backend, attention):
    """The pieces' attention written into their static buffer (padding rows zeroed once a step)
    and the eager steps' into one new output: bit for bit the concatenated and copied outputs.
    (The interpreter runs fewer, shorter requests.)"""
    got = {}
    run = {} if backend == "torch" else {"prompts": [(9, "all4"), (5, None), (6, "mlp8")], "new": 2}
    assert make_engine(**CONFIG, attention_in_place="off").runner.attention_in_place is False
    engine = make_engine(**CONFIG, backend=backend, prefill_attention=attention)
    for mode in ("on", "off"):  # (settable between steps: attention runs outside the pieces)
        engine.runner.attention_in_place = mode == "on"
        got[mode] = _run(engine, **run)
    (on, on_steps), (off, off_steps) = got["on"], got["off"]
    assert on == off and on_steps == off_steps
    assert any(real is not None and real < rows for rows, real, _ in on_steps)  # padded pieces ran


def test_base_steps_above_the_graph_limit_run_unpadded_and_eager(make_engine):
    """``mixed_graph_max_tokens`` 16: steps none of whose rows has an adapter run unpadded and
    eagerly above 16 rows (labelled by the bucket they would have taken), padded as pieces up to
    16; steps with adapted rows pad to every bucket as before; no base piece is built above 16
    rows; the same tokens and logprobs as every step padded."""
    base = [(n, None) for n, _ in PROMPTS]
    mixed = [(17, None), (9, None), (30, "mlp8"), (4, None), (12, None)]  # step 1 holds an adapted prompt
    padded_all = make_engine(**CONFIG, mixed_graph_max_tokens="all")
    assert padded_all.runner.mixed_graph_max_tokens is None
    engine = make_engine(**CONFIG, mixed_graph_max_tokens=16)
    runner = engine.runner
    assert runner.mixed_graph_max_tokens == 16 and runner.base_buckets == (1, 2, 4, 8, 16)
    assert runner.token_buckets == padded_all.runner.token_buckets
    for prompts in (base, mixed):
        want, want_steps = _run(padded_all, prompts)
        got, steps = _run(engine, prompts)
        assert [(r, t) for r, t, _ in got] == [(r, t) for r, t, _ in want]
        assert [lp for *_, lp in got] == pytest.approx([lp for *_, lp in want], abs=1e-5)
        for (rows, real, kind), (_, _, want_kind) in zip(steps, want_steps):
            if real is None:
                continue
            if real > 16 and " base " in kind:
                assert rows == real and kind == want_kind.replace("pieces", "eager")
            else:  # up to the limit, or with adapted rows: padded as before
                assert kind == want_kind and kind.endswith("pieces")
        assert any(real is not None and real > 16 and kind.endswith("eager") for _, real, kind in steps)
    assert any(real > 16 and " lora " in kind and kind.endswith("pieces") for _, real, kind in steps if real)
    assert max(runner._pieces_by_mode[None][0]) <= 16  # base pieces only up to the limit
    runner.mixed_graph_max_tokens = None  # raised between steps: every bucket again
    assert runner.base_buckets == runner.token_buckets


def test_graph_limit_settings():
    assert EngineTuning().mixed_graph_max_tokens == "auto" and EngineTuning().attention_in_place == "on"
    eight_b = 32 * (4096 * 6144 + 4096 * 4096 + 2 * 4096 * 14336 + 14336 * 4096)  # the 8B shape's projections
    assert graph_token_limit("auto", eight_b) == int(GRAPH_MAX_FLOPS // (2 * eight_b)) == 2149
    assert graph_token_limit("all", eight_b) is None and graph_token_limit(512, eight_b) == 512
    for bad in (0, "some", 1.5, True):
        with pytest.raises(ConfigError, match="mixed_graph_max_tokens"):
            EngineTuning(mixed_graph_max_tokens=bad)
        with pytest.raises(ValueError, match="mixed_graph_max_tokens"):
            graph_token_limit(bad, eight_b)
    with pytest.raises(ConfigError, match="attention_in_place"):
        EngineTuning(attention_in_place="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_pieces_below_the_limit_and_eager_steps_above_it(make_engine):
    """On a GPU: base-only pieces captured as CUDA graphs up to 16 rows, larger base-only steps
    eager, attention in place: the tokens of every step padded and captured with the outputs
    concatenated (fp32, Triton kernels)."""
    config = dict(CONFIG, backend="triton", mixed_graphs="on")
    base = [(n, None) for n, _ in PROMPTS]  # (steps with adapted rows pad to every bucket)
    want, _ = _run(make_engine(**config, mixed_graph_max_tokens="all", attention_in_place="off"), base)
    engine = make_engine(**config, mixed_graph_max_tokens=16)
    got, steps = _run(engine, base)
    assert [(r, t) for r, t, _ in got] == [(r, t) for r, t, _ in want]
    assert [lp for *_, lp in got] == pytest.approx([lp for *_, lp in want], abs=1e-4)
    kinds = {kind.split()[-1] for rows, real, kind in steps if real is not None}
    assert kinds == {"graph", "eager"}
    assert all(p.graphs is not None for p in engine.runner._pieces_by_mode[None][0].values())
