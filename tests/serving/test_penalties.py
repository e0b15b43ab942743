"""Logit bias, repetition / frequency / presence penalties and min-p: the sampler's adjustments
against a loop written from their definitions, the engine's greedy tokens against HF
transformers + PEFT (``repetition_penalty``, ``sequence_bias``) and against a step-by-step
reference over the HF model, in mixed batches where only some rows adjust."""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.serving import GenerationRequest, SamplingParams
from lightning_lorafusion.serving.sampling import LogitAdjustments, filter_logits
from lightning_lorafusion.specs import ConfigError

from test_prefix_cache import _run_arriving

EOS = 3  # the tiny model's


def _adjust_reference(logits: torch.Tensor, sp: SamplingParams, prompt, output) -> torch.Tensor:
    """One row, straight from the definitions (SamplingParams' docstring), in float64."""
    row = logits.double().clone()
    for t, b in sp.logit_bias:
        row[t] += b
    seen = set(prompt) | set(output)
    for t in seen:
        if sp.repetition_penalty != 1.0:
            row[t] = row[t] / sp.repetition_penalty if row[t] > 0 else row[t] * sp.repetition_penalty
    for t in set(output):
        row[t] -= sp.frequency_penalty * output.count(t) + sp.presence_penalty
    return row


def test_adjustments_equal_the_definitions_and_follow_each_step():
    g = torch.Generator().manual_seed(0)
    vocab = 50
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.7),
              SamplingParams(temperature=0.9, frequency_penalty=0.6, presence_penalty=-0.4),
              SamplingParams(temperature=0.0, logit_bias={4: 5.0, 9: -100.0}, repetition_penalty=0.8,
                             frequency_penalty=1.5)]
    prompts = [[1, 2, 2, 7], [5, 6], [9, 9, 40]]
    outputs = [[7, 8, 8], [], [11, 11, 11, 4]]
    rows = [0, 2, 3]  # rows 1 and 4 of the batch adjust nothing
    adjust = LogitAdjustments(rows, params, prompts, outputs, vocab, torch.device("cpu"))
    for step in range(3):
        logits = torch.randn(5, vocab, generator=g) * 3
        got = adjust.apply(logits)
        for j, r in enumerate(rows):
            want = _adjust_reference(logits[r], params[j], prompts[j], outputs[j])
            torch.testing.assert_close(got[r].double(), want, rtol=1e-6, atol=1e-5)
        for r in (1, 4):
            assert torch.equal(got[r], logits[r])
        tokens = torch.randint(0, vocab, (5,), generator=g)
        adjust.note(tokens)
        for j, r in enumerate(rows):
            outputs[j].append(int(tokens[r]))
    assert adjust.counts[2, 11] == outputs[2].count(11)


def test_min_p_keeps_tokens_at_least_min_p_times_the_most_likely():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 30, generator=g) * 2
    temperature = torch.tensor([1.0, 0.5, 2.0, 1.0])
    min_p = torch.tensor([0.0, 0.1, 0.3, 1.0])
    out = filter_logits(logits, temperature, torch.zeros(4, dtype=torch.int64), torch.ones(4), min_p)
    probs = (logits / temperature[:, None]).softmax(-1)
    keep = probs >= min_p[:, None] * probs.max(-1, keepdim=True).values
    assert torch.equal(torch.isfinite(out), keep)
    assert keep[3].sum() == 1 and keep[0].all()  # min_p 1: the argmax alone; 0: everything


def test_sampling_settings_are_validated():
    for bad in ({"presence_penalty": 2.1}, {"frequency_penalty": -2.5}, {"repetition_penalty": 0.0},
                {"repetition_penalty": float("inf")}, {"min_p": -0.1}, {"logit_bias": {-1: 1.0}},
                {"logit_bias": {5: 200.0}}, {"logit_bias": {"x": 1.0}}):
        with pytest.raises(ConfigError):
            SamplingParams(**bad)
    sp = SamplingParams(logit_bias={"12": 1, 3: -2})
    assert sp.logit_bias == ((3, -2.0), (12, 1.0)) and sp.adjusts_logits
    assert not SamplingParams(min_p=0.2).adjusts_logits  # a filter, not an adjustment


def _hf_greedy(hf_reference, prompt, adapter, n, **kwargs):
    ids = torch.tensor([prompt])
    out = hf_reference._run(adapter, lambda: hf_reference.model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0,
        **kwargs))
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def _reference_greedy(hf_reference, prompt, adapter, sp: SamplingParams):
    """Greedy decoding over the HF + PEFT model's full-sequence logits, adjusted per step."""
    output: list[int] = []
    while len(output) < sp.max_new_tokens:
        logits = hf_reference.logits(list(prompt) + output, adapter)[-1]
        token = int(_adjust_reference(logits, sp, prompt, output).argmax())
        output.append(token)
        if token == EOS:
            break
    return output


CASES = [([11, 4, 30, 22, 8, 19, 40], "all4"), ([7, 13, 21, 33, 45, 50, 6, 12], "attn2"),
         ([60, 2, 35, 18, 26], "mlp8"), ([5, 9, 17], None)]


def test_repetition_penalty_and_logit_bias_equal_hf_peft(make_engine, hf_reference):
    engine = make_engine(num_pages=96, page_size=4)
    n = 12
    rep = SamplingParams(max_new_tokens=n, temperature=0.0, repetition_penalty=1.8)
    bias = SamplingParams(max_new_tokens=n, temperature=0.0, logit_bias={21: 4.0, 30: -3.0})
    plain = SamplingParams(max_new_tokens=n, temperature=0.0)
    reqs = [GenerationRequest(prompt_token_ids=p, adapter=a, sampling=sp)
            for p, a in CASES for sp in (rep, bias, plain)]
    results = engine.generate(reqs)  # one mixed batch: every adapter, adjusted rows and plain rows
    changed = 0
    for req, res in zip(reqs, results):
        p, a, sp = list(req.prompt_token_ids), req.adapter, req.sampling
        kwargs = {}
        if sp.repetition_penalty != 1.0:
            kwargs["repetition_penalty"] = sp.repetition_penalty
        if sp.logit_bias:
            kwargs["sequence_bias"] = {(t,): b for t, b in sp.logit_bias}
        want = _hf_greedy(hf_reference, p, a, n, **kwargs)
        assert list(res.token_ids) == want, (a, sp)
        changed += bool(kwargs) and want != _hf_greedy(hf_reference, p, a, n)
    assert changed >= 4  # the settings change what is generated (the check is not vacuous)
    assert engine.stats()["kv_pages_used"] == 0


def test_frequency_and_presence_penalties_equal_a_step_by_step_reference(make_engine, hf_reference):
    engine = make_engine(num_pages=96, page_size=4)
    settings = [SamplingParams(max_new_tokens=10, temperature=0.0, frequency_penalty=1.5),
                SamplingParams(max_new_tokens=10, temperature=0.0, presence_penalty=2.0, logit_bias={8: 1.0}),
                SamplingParams(max_new_tokens=10, temperature=0.0, frequency_penalty=0.7, presence_penalty=-0.5,
                               repetition_penalty=1.3),
                SamplingParams(max_new_tokens=10, temperature=0.0)]
    reqs = [GenerationRequest(prompt_token_ids=p, adapter=a, sampling=sp) for (p, a), sp in zip(CASES, settings)]
    want = [_reference_greedy(hf_reference, r.prompt_token_ids, r.adapter, r.sampling) for r in reqs]
    assert want[0] != want[3] or want[1] != want[3]  # the penalties change what is generated
    # together, and arriving at different steps: the batch's composition (and the counts kept
    # for its adjusted rows) changes mid-run
    together = engine.generate(reqs)
    assert [list(r.token_ids) for r in together] == want
    again = [GenerationRequest(prompt_token_ids=r.prompt_token_ids, adapter=r.adapter, sampling=r.sampling)
             for r in reqs]
    assert [list(t) for t in _run_arriving(engine, again, {0: [0], 2: [1, 3], 5: [2]})] == want
    assert engine.stats()["kv_pages_used"] == 0


def test_seeded_sampling_with_penalties_ignores_the_rest_of_the_batch(make_engine):
    engine = make_engine(num_pages=96, page_size=4)
    sp = SamplingParams(max_new_tokens=8, temperature=0.8, seed=5, frequency_penalty=0.8, repetition_penalty=1.2,
                        min_p=0.05)
    alone = engine.generate([GenerationRequest(prompt_token_ids=CASES[0][0], adapter="all4", sampling=sp)])[0]
    others = [GenerationRequest(prompt_token_ids=p, adapter=a,
                                sampling=SamplingParams(max_new_tokens=5 + i, temperature=0.7, seed=i,
                                                        presence_penalty=0.3 * i))
              for i, (p, a) in enumerate(CASES[1:])]
    mixed = engine.generate(others + [GenerationRequest(prompt_token_ids=CASES[0][0], adapter="all4", sampling=sp)])
    assert mixed[-1].token_ids == alone.token_ids


def test_logit_bias_outside_the_vocabulary_is_refused(make_engine):
    engine = make_engine(num_pages=96, page_size=4)
    with pytest.raises(ConfigError, match="logit_bias"):
        engine.submit(GenerationRequest(prompt_token_ids=[5, 6], sampling=SamplingParams(logit_bias={64: 1.0})))


def test_min_tokens_holds_eos_back_like_hf_min_new_tokens(make_engine, hf_reference):
    """EOS made likely with a logit bias (the tiny model's greedy outputs never end early by
    themselves): with min_tokens the engine gives HF + PEFT's ``min_new_tokens`` tokens (after
    the same ``sequence_bias``), in a batch with rows that only carry the bias."""
    engine = make_engine(num_pages=96, page_size=4)
    n, k = 10, 4
    reqs, want = [], []
    for prompt, adapter in CASES:
        for bias in (3.0, 6.0):
            biased = {EOS: bias}
            for min_tokens in (0, k):
                reqs.append(GenerationRequest(prompt_token_ids=prompt, adapter=adapter, sampling=SamplingParams(
                    max_new_tokens=n, temperature=0.0, logit_bias=biased, min_tokens=min_tokens)))
                want.append(_hf_greedy(hf_reference, prompt, adapter, n, sequence_bias={(EOS,): bias},
                                       min_new_tokens=min_tokens))
    early = [w for w, r in zip(want, reqs) if r.sampling.min_tokens == 0 and len(w) < k]
    held = [w for w, r in zip(want, reqs) if r.sampling.min_tokens == k]
    assert early and all(len(w) >= k and EOS not in w[:k] for w in held)  # the check is not vacuous
    assert [list(r.token_ids) for r in engine.generate(reqs)] == want


def test_min_tokens_holds_stop_token_ids_and_stop_strings_back(make_engine):
    engine = make_engine(num_pages=96, page_size=4)
    prompt, adapter = CASES[0]
    free = engine.generate([GenerationRequest(prompt_token_ids=prompt, adapter=adapter, sampling=SamplingParams(
        max_new_tokens=8, temperature=0.0, ignore_eos=True))])[0]
    first = free.token_ids[0]
    # stopping on the first token's id: at once without min_tokens, not before 4 tokens with it
    stop = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=(first,))
    held = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=(first,), min_tokens=4)
    a, b = engine.generate([GenerationRequest(prompt_token_ids=prompt, adapter=adapter, sampling=sp)
                            for sp in (stop, held)])
    assert a.token_ids == (first,) and a.finish_reason == "stop"
    assert len(b.token_ids) >= 4 and first not in b.token_ids[:4]
    # a stop string in the first token's text is not looked for until 4 tokens are out
    word = engine.tokenizer.decode([first]).strip()
    c = engine.generate([GenerationRequest(prompt_token_ids=prompt, adapter=adapter, sampling=SamplingParams(
        max_new_tokens=8, temperature=0.0, ignore_eos=True, stop=(word,), min_tokens=4))])[0]
    assert c.token_ids[:4] == free.token_ids[:4] and word in c.text
    with pytest.raises(ConfigError, match="min_tokens"):
        SamplingParams(max_new_tokens=3, min_tokens=4)


def test_adjustments_carried_over_equal_rebuilt_ones():
    """A new composition's adjustments copy the kept rows' counts and prompt tokens from the
    last composition's (on the device) and build only newcomers': the same tensors as building
    everything from the token lists."""
    g = torch.Generator().manual_seed(2)
    vocab = 40
    sp = [SamplingParams(repetition_penalty=1.4, frequency_penalty=0.5), SamplingParams(presence_penalty=1.0),
          SamplingParams(repetition_penalty=0.9)]
    prompts = [[1, 2, 3], [4, 4], [7, 8, 9, 9]]
    outputs = [[5, 5, 6], [7], [1]]
    first = LogitAdjustments([0, 1, 2], sp, prompts, outputs, vocab, torch.device("cpu"), ids=["a", "b", "c"])
    tokens = torch.randint(0, vocab, (3,), generator=g)
    first.note(tokens)
    for j in range(3):
        outputs[j].append(int(tokens[j]))
    # "b" left, "d" joined, "c" and "a" kept (in a new order and at new rows)
    sp2 = [sp[2], SamplingParams(frequency_penalty=1.0, repetition_penalty=1.1), sp[0]]
    prompts2, outputs2 = [prompts[2], [11, 12], prompts[0]], [outputs[2], [13, 13], outputs[0]]
    carried = LogitAdjustments([1, 2, 4], sp2, prompts2, outputs2, vocab, torch.device("cpu"), ids=["c", "d", "a"],
                               previous=first)
    rebuilt = LogitAdjustments([1, 2, 4], sp2, prompts2, outputs2, vocab, torch.device("cpu"))
    assert torch.equal(carried.counts, rebuilt.counts) and torch.equal(carried.in_prompt, rebuilt.in_prompt)
    logits = torch.randn(5, vocab, generator=g)
    assert torch.equal(carried.apply(logits), rebuilt.apply(logits))
