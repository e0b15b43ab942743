"""EngineTuning.prefill_attention: prompts from position 0 through the paged prefill kernel (one
launch with prefix hits and later chunks) give the varlen path's and HF + PEFT's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.serving import Engine, EngineConfig, GenerationRequest, SamplingParams
from lightning_lorafusion.serving.config import EngineTuning
from lightning_lorafusion.specs import ConfigError

from test_generation import _requests, _write_family
from test_prefix_cache import SYSTEM, _run_arriving

SP = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)


def _record_prefill_steps(engine: Engine) -> list[dict]:
    """Per step with prefill rows: its varlen rows, the paged launch's (first position, rows)
    per request, and its decode rows (``ModelRunner.prepare`` wrapped)."""
    steps = []
    prepare = engine.runner.prepare

    def recording(prefill, decode, prefill_lens=None, **kwargs):
        batch = prepare(prefill, decode, prefill_lens, **kwargs)
        if prefill:
            pre = batch.prefill_prefixes
            lens = [] if pre is None else (pre.cu_seqlens[1:] - pre.cu_seqlens[:-1]).tolist()
            steps.append({"varlen_rows": batch.num_fresh_rows, "decode": len(decode),
                          "paged": [] if pre is None else list(zip(pre.starts.tolist(), lens))})
        return batch

    engine.runner.prepare = recording
    return steps


def test_prefill_attention_is_checked_and_auto_follows_the_backend(make_engine):
    with pytest.raises(ConfigError, match="prefill_attention='flash'.*auto.*varlen.*paged"):
        EngineTuning(prefill_attention="flash")
    assert EngineConfig().tuning.prefill_attention == "auto"  # the default: paged with the Triton kernels
    assert make_engine(num_pages=32, page_size=4, backend="triton").runner.prefill_attention == "paged"
    assert make_engine(num_pages=32, page_size=4, backend="torch").runner.prefill_attention == "varlen"
    auto = {"num_pages": 32, "page_size": 4, "prefill_attention": "auto"}
    assert make_engine(**auto, backend="torch").runner.prefill_attention == "varlen"
    assert make_engine(**auto, backend="triton").runner.prefill_attention == "paged"
    assert make_engine(num_pages=32, page_size=4, backend="triton",
                       prefill_attention="varlen").runner.prefill_attention == "varlen"


def test_paged_fresh_prompts_with_the_torch_reference(make_engine, hf_reference):
    """``prefill_attention="paged"`` with the torch kernels (the paged prefill reference, a gather
    + SDPA per request): fresh prompts of different lengths, a prefix hit and decodes sharing
    steps give the varlen engine's and HF + PEFT's tokens; no step has varlen rows."""
    cases = [(SYSTEM + [1], "all4"), ([5, 9, 17], None),
             (SYSTEM + [18, 28, 45], "all4"), ([7, 13, 21, 33, 45, 50, 6, 12, 28], "attn2"), ([60, 2], "mlp8")]
    arrive = {0: [0, 1], 1: [2, 3, 4]}
    varlen = _run_arriving(make_engine(num_pages=96, page_size=4, prefill_attention="varlen"), _requests(cases, SP),
                           arrive)
    engine = make_engine(num_pages=96, page_size=4, prefill_attention="paged")
    steps = _record_prefill_steps(engine)
    paged = _run_arriving(engine, _requests(cases, SP), arrive)
    assert paged == varlen
    for (prompt, adapter), out in zip(cases, paged):
        assert list(out) == hf_reference.generate(prompt, adapter, 3), adapter
    assert all(s["varlen_rows"] == 0 for s in steps)
    # step 1: the hit (4 new tokens after 12 cached) and the two fresh prompts in one launch
    assert sorted(steps[1]["paged"]) == [(0, 2), (0, 9), (12, 4)] and steps[1]["decode"] == 2
    engine.pool.check()


def test_fresh_prompts_hits_and_chunks_in_one_triton_launch(make_engine, hf_reference):
    """Triton kernels (interpreter, fp32), chunked prefill and prefix caching on, pages of 4,
    16 tokens a step. Step 0: two fresh prompts (14 tokens, and the first 2 of an 8-token one);
    step 1: that prompt's later chunk (6 tokens from position 2, inside a page), a prefix hit
    (4 new tokens after 12 cached), a fresh 5-token prompt and a decode row. With
    ``prefill_attention="paged"`` each step's prefill rows attend in one paged launch; the
    tokens equal the varlen torch engine's and HF + PEFT's."""
    cases = [(SYSTEM + [1], "all4"), ([(7 * i + 1) % 64 for i in range(8)], None),
             (SYSTEM + [18, 28, 45], "all4"), ([60, 2, 35, 18, 26], "mlp8")]
    arrive = {0: [0, 1], 1: [2, 3]}
    config = dict(num_pages=96, page_size=4, max_num_seqs=4, max_num_batched_tokens=16, enable_chunked_prefill=True)
    varlen = _run_arriving(make_engine(**config, prefill_attention="varlen"), _requests(cases, SP), arrive)
    engine = make_engine(**config, backend="triton", prefill_attention="paged")
    steps = _record_prefill_steps(engine)
    reqs = _requests(cases, SP)
    paged = _run_arriving(engine, reqs, arrive)
    assert paged == varlen
    for (prompt, adapter), out in zip(cases, paged):
        assert list(out) == hf_reference.generate(prompt, adapter, 3), adapter
    assert [s["varlen_rows"] for s in steps[:2]] == [0, 0]
    assert sorted(steps[0]["paged"]) == [(0, 2), (0, 14)] and steps[0]["decode"] == 0
    assert sorted(steps[1]["paged"]) == [(0, 5), (2, 6), (12, 4)] and steps[1]["decode"] == 1
    assert engine.stats()["prefix_cache_hits_total"] == 1 and engine.stats()["prefill_chunks_total"] == 1
    engine.pool.check()


def test_sliding_window_fresh_prompts_through_the_triton_kernel(tmp_path, write_random_peft_adapter,
                                                                  hf_reference_of):
    """A tiny Mistral (sliding window 6), Triton kernels (interpreter, fp32): fresh prompts of 5
    to 14 tokens and a prefix hit, prefilled in one paged launch with the window, give the
    varlen torch engine's and HF + PEFT's tokens (8 new tokens: decode past the window too)."""
    model_dir = _write_family(tmp_path / "mistral", "mistral")
    adapters = {"a": str(write_random_peft_adapter(model_dir, tmp_path / "a", rank=3, alpha=6.0,
                                                   targets=["q_proj", "k_proj", "v_proj", "down_proj"], seed=1)),
                "b": str(write_random_peft_adapter(model_dir, tmp_path / "b", rank=5, alpha=5.0,
                                                   targets=["o_proj", "up_proj"], seed=2))}
    long = [5, 9, 17, 30, 2, 44, 8, 12, 11, 4, 30, 22, 8, 19]
    cases = [(long, "a"), (long[:12] + [40, 41, 42], "a"), ([7, 13, 21, 33, 45, 50, 6, 12, 28], "b"),
             ([11, 4, 30, 22, 9], None)]
    arrive = {0: [0], 1: [1, 2, 3]}
    sp = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)

    def run(**config):
        # Triton kernels on CPU tensors need the interpreter, which conftest sets only without a GPU
        device = "cuda" if config.get("backend") == "triton" and torch.cuda.is_available() else "cpu"
        engine = Engine.from_pretrained(str(model_dir), adapters, EngineConfig(num_pages=64, page_size=4, **config),
                                        device=device, dtype=torch.float32)
        try:
            steps = _record_prefill_steps(engine)
            return _run_arriving(engine, _requests(cases, sp), arrive), steps, engine.stats()
        finally:
            engine.close()

    varlen, _, _ = run(tuning=EngineTuning(prefill_attention="varlen"))
    paged, steps, stats = run(backend="triton", tuning=EngineTuning(prefill_attention="paged"))
    assert paged == varlen
    reference = hf_reference_of(model_dir, adapters)
    for (prompt, adapter), out in zip(cases, paged):
        assert list(out) == reference.generate(prompt, adapter, 8), adapter
    assert sorted(steps[1]["paged"]) == [(0, 5), (0, 9), (12, 3)] and steps[1]["varlen_rows"] == 0
    assert stats["prefix_cache_hits_total"] == 1
