"""Greedy val-sample generation: all adapters' prompts in one batch of the generation engine (KV
cache) give the same tokens as a no-cache greedy decode of each prompt alone, unpacked, with its
own adapter; ROUGE scoring."""

import pytest
import torch

from lightning_lorafusion.data.tokenization import TokenizedSample
from lightning_lorafusion.model.adapter_bank import AdapterBank
from lightning_lorafusion.model.decoder import logits
from lightning_lorafusion.model.hf_loading import load_base_model
from lightning_lorafusion.training.val_samples import greedy_generate, rouge_scores, split_prompt
from test_equivalence import tiny_specs


def _alone(params, bank, config, prompt, max_new_tokens, eos_token_id=None):
    """Reference (no KV cache): one prompt, unpacked, its own adapter, the whole sequence re-run
    per token."""
    seq = list(prompt.prompt)
    for _ in range(max_new_tokens):
        if len(seq) > len(prompt.prompt) and seq[-1] == eos_token_id:
            break
        n = len(seq)
        routing = bank.routing([(0, n, prompt.adapter)], 0, n, train=False)
        out = logits(params, bank.view(), torch.tensor(seq), torch.arange(n),
                     torch.tensor([0, n], dtype=torch.int32), routing, config=config)
        seq.append(int(out[-1].argmax()))
    return tuple(seq[len(prompt.prompt):])


def test_packed_greedy_generation_equals_each_prompt_alone(tiny_model_dir):
    config, params, _ = load_base_model(tiny_model_dir, dtype=torch.float32)
    specs = tiny_specs(dropout=0.3)  # dropout must be off
    bank = AdapterBank(specs, config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in bank.parameters():  # B = 0 at init: give every adapter a real effect
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    samples = [TokenizedSample(input_ids=tuple(range(3 + k, 3 + k + n)), labels=(-100,) * (m - 1) + tuple(range(3 + k + m, 3 + k + n)) + (-100,))
               for k, (n, m) in enumerate([(9, 4), (13, 6), (5, 2), (11, 3)])]
    prompts = [split_prompt(a, s) for a, s in zip([2, 0, 2, 1], samples)]
    assert prompts[0].prompt == samples[0].input_ids[:4] and prompts[0].reference == samples[0].input_ids[4:]
    got = greedy_generate(params, bank, config, prompts, max_new_tokens=5, eos_token_id=None)
    want = [_alone(params, bank, config, p, 5) for p in prompts]
    assert got == want
    assert len({g for g in got}) > 1  # the adapters do differ


def _random_bank(specs, config, seed):
    bank = AdapterBank(specs, config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in bank.parameters():  # B = 0 at init: give every adapter a real effect
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return bank


def test_engine_samples_equal_no_cache_greedy_across_pages(tiny_model_dir):
    """Prompts and generations spanning several KV pages (page_size 4), heterogeneous ranks and
    targets in one batch, an adapter of the bank that no prompt uses, EOS mid-generation: the
    same tokens as the no-cache decode, fp32."""
    config, params, _ = load_base_model(tiny_model_dir, dtype=torch.float32)
    bank = _random_bank(tiny_specs(), config, seed=1)
    gen = torch.Generator().manual_seed(2)
    prompts = [split_prompt(a, TokenizedSample(input_ids=tuple(ids), labels=(-100,) * (n - 1) + (ids[-1],)))
               for a, n in [(2, 9), (0, 17), (2, 3), (0, 6), (2, 1)]
               for ids in [torch.randint(3, config.vocab_size, (n,), generator=gen).tolist()]]
    want = [_alone(params, bank, config, p, 11) for p in prompts]
    eos = want[1][4]  # stops one prompt early (and any other that produces it)
    want = [_alone(params, bank, config, p, 11, eos_token_id=eos) for p in prompts]
    got = greedy_generate(params, bank, config, prompts, max_new_tokens=11, eos_token_id=eos, page_size=4)
    assert got == want
    assert len(got[1]) <= 5 and any(len(g) == 11 for g in got)


def test_generation_stops_at_eos(tiny_model_dir):
    config, params, _ = load_base_model(tiny_model_dir, dtype=torch.float32)
    bank = AdapterBank(tiny_specs()[:1], config, dtype=torch.float32)
    prompt = split_prompt(0, TokenizedSample(input_ids=(5, 6, 7), labels=(-100, 7, -100)))
    first = greedy_generate(params, bank, config, [prompt], max_new_tokens=4, eos_token_id=None)[0]
    stopped = greedy_generate(params, bank, config, [prompt], max_new_tokens=4, eos_token_id=first[1])[0]
    assert stopped == first[: first.index(first[1]) + 1]


def test_rouge_scores():
    import logging

    handlers = list(logging.getLogger().handlers)
    scores = rouge_scores(["the cat sat on the mat", "a b c"], ["the cat sat on the mat", "x y z"])
    assert scores["rouge1"] == pytest.approx(0.5) and scores["rougeL"] == pytest.approx(0.5)
    assert logging.getLogger().handlers == handlers  # rouge-score's absl logging left no root handler
