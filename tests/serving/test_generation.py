"""Engine generation against HF transformers + PEFT: heterogeneous batches, arrivals, stops, logprobs."""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.model.hf_loading import load_base_model
from lightning_lorafusion.serving import (Engine, EngineConfig, GenerationRequest, SamplingParams,
                                          UnknownAdapterError)
from lightning_lorafusion.specs import ConfigError

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)
# (prompt, adapter): base + three adapters of ranks 4/2/8, prompts of different lengths
CASES = [
    ([5, 9, 17], None),
    ([11, 4, 30, 22, 8, 19, 40], "all4"),
    ([7, 13, 21, 33, 45, 50, 6, 12, 28, 31, 9, 14], "attn2"),
    ([60, 2, 35, 18, 26], "mlp8"),
    ([44, 41, 10, 20, 30, 40, 50, 15, 25], "all4"),
    ([8, 16], "mlp8"),
]


def _requests(cases, sampling=GREEDY):
    return [GenerationRequest(prompt_token_ids=p, adapter=a, sampling=sampling) for p, a in cases]


def test_heterogeneous_batch_equals_hf_peft(make_engine, hf_reference):
    engine = make_engine(num_pages=96, page_size=4)
    results = engine.generate(_requests(CASES))
    for (prompt, adapter), res in zip(CASES, results):
        expected = hf_reference.generate(prompt, adapter, GREEDY.max_new_tokens)
        assert list(res.token_ids) == expected, (adapter, prompt)
        assert res.finish_reason == ("stop" if len(expected) < GREEDY.max_new_tokens else "length")
        assert res.adapter == adapter and res.prompt_token_ids == tuple(prompt)
    # the adapters matter: the same prompt under each adapter decodes differently
    outs = {a: engine.generate(_requests([(CASES[1][0], a)]))[0].token_ids for a in (None, "all4", "attn2", "mlp8")}
    assert len(set(outs.values())) == 4
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == stats["kv_pages_used"] == 0
    assert stats["generated_tokens_total"] == sum(len(r.token_ids) for r in results) + sum(len(t) for t in outs.values())


def test_triton_kernels_equal_hf_peft(make_engine, hf_reference):
    """The fused prefill LoRA, lora_gather and paged decode attention kernels (Triton
    interpreter on CPU, fp32) in a base + three-adapter batch."""
    engine = make_engine(num_pages=96, page_size=4, backend="triton")
    sp = SamplingParams(max_new_tokens=3, temperature=0.0)
    for (prompt, adapter), res in zip(CASES[:4], engine.generate(_requests(CASES[:4], sp))):
        assert list(res.token_ids) == hf_reference.generate(prompt, adapter, 3), adapter


def test_triton_mixed_prefill_and_decode_step_equals_torch(make_engine):
    """A step holding prefill rows and decode rows (the decode rows' LoRA gathered from row
    ``first_row`` on, the prefill rows' by row tiles): the Triton
    kernels (interpreter, fp32) give the torch references' tokens and logprobs."""
    sp = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True, logprobs=2)
    cases = [CASES[1], CASES[3], CASES[2]]
    got = []
    for backend in ("torch", "triton"):
        engine = make_engine(num_pages=96, page_size=4, backend=backend)
        reqs = _requests(cases, sp)
        events = []
        for step in range(6):
            if step < 2:  # two requests first; the third joins while they decode
                for r in reqs[:2] if step == 0 else reqs[2:]:
                    engine.submit(r)
            events += engine.step()
        index = {r.request_id: i for i, r in enumerate(reqs)}
        got.append([(index[ev.request_id], ev.token_id, ev.logprob) for ev in events if ev.token_id is not None])
    assert [(r, t) for r, t, _ in got[0]] == [(r, t) for r, t, _ in got[1]] and len(got[0]) == 6
    assert [lp for *_, lp in got[0]] == pytest.approx([lp for *_, lp in got[1]], abs=1e-5)


def test_requests_arriving_at_different_steps_match_running_alone(make_engine):
    engine = make_engine(num_pages=96, page_size=4)
    alone = {i: engine.generate(_requests([c]))[0].token_ids for i, c in enumerate(CASES)}
    reqs = _requests(CASES)
    arrive_at = {0: [0, 1], 2: [2], 3: [3, 4], 6: [5]}  # step -> requests submitted before it
    events = []
    for step in range(40):
        for i in arrive_at.get(step, []):
            engine.submit(reqs[i])
        events += engine.step()
    tokens = {r.request_id: [] for r in reqs}
    finished = set()
    for ev in events:
        if ev.token_id is not None:
            tokens[ev.request_id].append(ev.token_id)
        if ev.finish_reason is not None:
            finished.add(ev.request_id)
    assert finished == {r.request_id for r in reqs}
    for i, r in enumerate(reqs):
        assert tuple(tokens[r.request_id]) == alone[i]


def test_stop_tokens_strings_and_lengths(make_engine, model_dir, adapter_dirs):
    engine = make_engine(num_pages=96, page_size=4)
    prompt, adapter = CASES[1]
    free = engine.generate(_requests([(prompt, adapter)], SamplingParams(max_new_tokens=10, temperature=0.0,
                                                                         ignore_eos=True)))[0]
    ids = list(free.token_ids)
    assert free.finish_reason == "length" and len(ids) == 10
    words = engine.tokenizer.convert_ids_to_tokens(ids)
    assert free.text == "".join(" " + w for w in words)

    stop_id = ids[4]
    first = ids.index(stop_id)
    res = engine.generate(_requests([(prompt, adapter)], SamplingParams(
        max_new_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_id,))))[0]
    assert res.finish_reason == "stop"
    assert list(res.token_ids) == ids[:first + 1]  # the stop token is returned, its text is not
    assert res.text == "".join(" " + w for w in words[:first])

    stop_str = f"{words[5]} {words[6]}"
    res = engine.generate(_requests([(prompt, adapter)], SamplingParams(
        max_new_tokens=10, temperature=0.0, ignore_eos=True, stop=(stop_str,))))[0]
    cut = free.text.find(stop_str)
    assert res.finish_reason == "stop" and res.text == free.text[:cut]
    assert list(res.token_ids) == ids[:free.text[:cut + len(stop_str)].count(" ")]

    res = engine.generate(_requests([(prompt, adapter)], SamplingParams(max_new_tokens=3, temperature=0.0,
                                                                        ignore_eos=True)))[0]
    assert res.finish_reason == "length" and list(res.token_ids) == ids[:3]

    # EOS ends a request unless ignore_eos; its id is returned, its text is not
    config, params, tokenizer = load_base_model(str(model_dir))
    eos_engine = Engine(config, params, tokenizer, EngineConfig(num_pages=96, page_size=4), eos_token_ids=(stop_id,))
    eos_engine.add_adapter(adapter, adapter_dirs[adapter])
    res = eos_engine.generate(_requests([(prompt, adapter)], SamplingParams(max_new_tokens=10, temperature=0.0)))[0]
    assert res.finish_reason == "stop" and list(res.token_ids) == ids[:first + 1]
    assert engine.tokenizer.eos_token_id in engine.eos_token_ids  # from_pretrained reads the model's EOS

    # the model's context also ends generation with "length"
    short = make_engine(num_pages=96, page_size=4, max_model_len=len(prompt) + 4)
    res = short.generate(_requests([(prompt, adapter)], SamplingParams(max_new_tokens=10, temperature=0.0,
                                                                       ignore_eos=True)))[0]
    assert res.finish_reason == "length" and list(res.token_ids) == ids[:4]


def test_streamed_text_never_shows_a_stop_string(make_engine):
    engine = make_engine(num_pages=96, page_size=4)
    prompt, adapter = CASES[3]
    sp = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    full = engine.generate(_requests([(prompt, adapter)], sp))[0]
    words = full.text.split()
    stop = f" {words[3]} {words[4]}"
    req = _requests([(prompt, adapter)], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True,
                                                        stop=(stop,)))[0]
    engine.submit(req)
    deltas = []
    while True:
        evs = engine.step()
        deltas += [e.text for e in evs]
        if any(e.finish_reason for e in evs):
            break
    assert "".join(deltas) == full.text[:full.text.find(stop)]
    assert words[3] not in "".join(deltas).split()[3:]


def test_prompt_and_token_logprobs_match_hf(make_engine, hf_reference):
    engine = make_engine(num_pages=96, page_size=4)
    sp = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=True, logprobs=2)
    cases = [CASES[2], CASES[0]]
    results = engine.generate(_requests(cases, sp))
    for (prompt, adapter), res in zip(cases, results):
        full = list(prompt) + list(res.token_ids)
        ref = torch.log_softmax(hf_reference.logits(full, adapter).double(), dim=-1)
        assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == len(prompt)
        expected = [ref[t, full[t + 1]].item() for t in range(len(prompt) - 1)]
        assert res.prompt_logprobs[1:] == pytest.approx(expected, abs=1e-4)
        for j, tok in enumerate(res.token_ids):
            row = ref[len(prompt) - 1 + j]
            assert res.logprobs[j] == pytest.approx(row[tok].item(), abs=1e-4)
            top = row.topk(2)
            assert list(res.top_logprobs[j]) == top.indices.tolist()
            assert list(res.top_logprobs[j].values()) == pytest.approx(top.values.tolist(), abs=1e-4)


def test_prompt_top_logprobs_and_scoring_only(make_engine, hf_reference):
    """``prompt_logprobs=k``: each prompt position's top-k equals HF + PEFT's log-softmax;
    ``max_new_tokens=0`` scores the prompt, generates nothing and ends with "length", in a batch
    with a request that generates."""
    engine = make_engine(num_pages=96, page_size=4)
    score = SamplingParams(max_new_tokens=0, prompt_logprobs=3)
    generate = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=True)
    cases = [CASES[2], CASES[3], CASES[1]]
    reqs = _requests(cases[:2], score) + _requests(cases[2:], generate)
    results = engine.generate(reqs)
    for (prompt, adapter), res in zip(cases[:2], results):
        assert res.token_ids == () and res.finish_reason == "length" and res.text == ""
        ref = torch.log_softmax(hf_reference.logits(prompt, adapter).double(), dim=-1)
        assert res.prompt_logprobs[0] is None and res.prompt_top_logprobs[0] is None
        assert len(res.prompt_logprobs) == len(res.prompt_top_logprobs) == len(prompt)
        for t in range(1, len(prompt)):
            assert res.prompt_logprobs[t] == pytest.approx(ref[t - 1, prompt[t]].item(), abs=1e-4)
            top = ref[t - 1].topk(3)
            assert list(res.prompt_top_logprobs[t]) == top.indices.tolist()
            assert list(res.prompt_top_logprobs[t].values()) == pytest.approx(top.values.tolist(), abs=1e-4)
    generated = results[2]
    assert len(generated.token_ids) == 4 and generated.prompt_top_logprobs[1:] == [{}] * (len(cases[2][0]) - 1)
    assert engine.stats()["generated_tokens_total"] == 4 and engine.stats()["kv_pages_used"] == 0
    assert SamplingParams(prompt_logprobs=True).prompt_logprobs == 0
    assert SamplingParams(prompt_logprobs=False).prompt_logprobs is None
    for bad in (21, -1, 1.5):
        with pytest.raises(ConfigError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=-1, prompt_logprobs=1)


def test_bad_requests_fail_alone(make_engine):
    engine = make_engine(num_pages=24, page_size=4, max_model_len=64)
    good = _requests([CASES[0]])[0]
    engine.submit(good)
    with pytest.raises(UnknownAdapterError, match="nope"):
        engine.submit(GenerationRequest(prompt_token_ids=[1, 2], adapter="nope"))
    with pytest.raises(ConfigError, match="context"):
        engine.submit(GenerationRequest(prompt_token_ids=[1] * 64))
    with pytest.raises(ConfigError, match=r"\[0, 64\)"):
        engine.submit(GenerationRequest(prompt_token_ids=[1, 64]))
    with pytest.raises(ConfigError, match="never fit"):
        engine.submit(GenerationRequest(prompt_token_ids=[1] * 40, adapter="mlp8",
                                        sampling=SamplingParams(max_new_tokens=20)))
    with pytest.raises(ConfigError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ConfigError, match="empty"):
        GenerationRequest(prompt_token_ids=[])
    with pytest.raises(UnknownAdapterError):  # generate validates every request before queueing any
        engine.generate(_requests([CASES[1], ([1, 2], "nope")]))
    assert engine.stats()["requests_total"] == 1
    events = []
    while not any(e.finish_reason for e in events):
        events += engine.step()
    assert [e.request_id for e in events] == [good.request_id] * len(events)


def test_abort(make_engine):
    engine = make_engine(num_pages=96, page_size=4)
    reqs = _requests(CASES[:2], SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True))
    for r in reqs:
        engine.submit(r)
    engine.step()
    engine.abort(reqs[0].request_id)
    events = engine.step()
    ended = [e for e in events if e.finish_reason == "abort"]
    assert [e.request_id for e in ended] == [reqs[0].request_id] and ended[0].token_id is None
    assert all(e.request_id == reqs[1].request_id for e in events if e.token_id is not None)
    while engine.stats()["running"]:
        engine.step()
    assert engine.stats()["kv_pages_used"] == 0


def _write_family(path, family):
    """A tiny random Qwen2 (q/k/v biases) or Mistral (sliding window 6) directory with the
    word-level tokenizer of ``write_random_llama``."""
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

    from lightning_lorafusion.model.random_model import write_random_llama

    write_random_llama(path, vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=0,
                  bos_token_id=2, eos_token_id=3)
    cfg = (Qwen2Config(**common) if family == "qwen2"
           else MistralConfig(sliding_window=6, **common))
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.15) if p.dim() > 1 or name.endswith("bias") else p.fill_(1.0)
    for f in path.glob("*.safetensors"):
        f.unlink()
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_other_families_equal_hf_peft(tmp_path, family, write_random_peft_adapter):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir = _write_family(tmp_path / family, family)
    adapters = {"a": write_random_peft_adapter(model_dir, tmp_path / "a", rank=3, alpha=6.0,
                                               targets=["q_proj", "k_proj", "v_proj", "down_proj"], seed=1),
                "b": write_random_peft_adapter(model_dir, tmp_path / "b", rank=5, alpha=5.0,
                                               targets=["o_proj", "up_proj"], seed=2)}
    engine = Engine.from_pretrained(str(model_dir), {k: str(v) for k, v in adapters.items()},
                                    EngineConfig(num_pages=64, page_size=4), device="cpu")
    cases = [([5, 9, 17, 30, 2, 44, 8, 12], "a"), ([11, 4, 30], "b"), ([7, 13, 21, 33, 45], None)]
    sp = SamplingParams(max_new_tokens=8, temperature=0.0)  # prompt + 8 tokens > window 6
    results = engine.generate(_requests(cases, sp))
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(base, adapters["a"], adapter_name="a")
    peft_model.load_adapter(adapters["b"], adapter_name="b")
    for (prompt, adapter), res in zip(cases, results):
        ids = torch.tensor([prompt])
        kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                      pad_token_id=0)
        with torch.no_grad():
            if adapter is None:
                with peft_model.disable_adapter():
                    out = peft_model.generate(**kwargs)
            else:
                peft_model.set_adapter(adapter)
                out = peft_model.generate(**kwargs)
        assert list(res.token_ids) == out[0, len(prompt):].tolist(), (family, adapter)


@pytest.mark.parametrize("expand_bound,single_rows,hybrid", [(10**9, False, None), (32, False, None), (32, True, None),
                                                             (10**9, False, 32)])
def test_triton_decode_rows_grouped_by_adapter_equal_torch(make_engine, monkeypatch, expand_bound, single_rows,
                                                           hybrid):
    """A decode batch of at least ``GROUPED_MIN_ROWS`` rows (lowered to 32 here, to keep the
    interpreter quick) takes the shrink that reads each adapter's A once for its group of rows
    (rows of one adapter scattered over the batch, base rows among them), and from
    ``GROUPED_EXPAND_MIN_ROWS`` the expands (q/k/v before RoPE, o, gate/up in SwiGLU, down)
    that read its B once (``single_rows``: groups cut at one row, each done per row inside the
    grouped shrink; ``hybrid``: from that many rows the hybrid expands, q/k/v's, o's, down's and
    SwiGLU's groups of 2+ rows by one dot each, the rows alone per row): same tokens and logprobs
    as the torch references (interpreter, fp32)."""
    from lightning_lorafusion.kernels import lora_gather

    monkeypatch.setattr(lora_gather, "HYBRID_MIN_ROWS", hybrid)
    monkeypatch.setattr(lora_gather, "HYBRID_QKV", True)  # (q/k/v's groups in the RoPE + KV epilogue too)
    monkeypatch.setattr(lora_gather, "GROUPED_MIN_ROWS", 32)
    monkeypatch.setattr(lora_gather, "GROUPED_EXPAND_MIN_ROWS", expand_bound)
    monkeypatch.setattr(lora_gather, "GROUPED_SHRINK_SINGLE_ROWS", single_rows)
    if single_rows:
        monkeypatch.setattr(lora_gather, "GROUP_ROWS", 1)
    GROUPED_MIN_ROWS = 32
    sp = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True, logprobs=1)
    names = [None, "all4", "attn2", "mlp8"]
    cases = [([3 + i, (7 + 5 * i) % 60, 11], names[i % 4]) for i in range(GROUPED_MIN_ROWS + 2)]
    got = []
    for backend in ("torch", "triton"):
        engine = make_engine(num_pages=256, page_size=4, max_num_seqs=64, backend=backend)
        results = engine.generate(_requests(cases, sp))
        got.append([(r.token_ids, list(r.logprobs)) for r in results])
    assert [t for t, _ in got[0]] == [t for t, _ in got[1]]
    flat = [[lp for _, lps in run for lp in lps] for run in got]
    assert flat[0] == pytest.approx(flat[1], abs=1e-5)
