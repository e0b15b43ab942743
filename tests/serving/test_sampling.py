"""Sampling: seeds make outputs independent of batch-mates; top-k / top-p filter as specified."""

from __future__ import annotations

import torch

from lightning_lorafusion.serving import GenerationRequest, SamplingParams
from lightning_lorafusion.serving.sampling import filter_logits, sample_tokens, uniform_draws

PROMPT = [11, 4, 30, 22, 8, 19, 40]


def _req(prompt=PROMPT, adapter="all4", **sampling):
    sampling.setdefault("max_new_tokens", 8)
    sampling.setdefault("ignore_eos", True)
    return GenerationRequest(prompt_token_ids=prompt, adapter=adapter, sampling=SamplingParams(**sampling))


def test_same_seed_same_tokens_whatever_the_batch(make_engine):
    engine = make_engine(num_pages=96, page_size=4)
    sampled = dict(temperature=1.3, top_p=0.95, top_k=40, seed=1234)
    alone = engine.generate([_req(**sampled)])[0].token_ids
    mates = [_req([5, 9, 17], None, temperature=1.0, seed=1), _req([60, 2, 35], "mlp8", temperature=0.0),
             _req([7, 13, 21, 33], "attn2", temperature=2.0)]
    batched = engine.generate([mates[0], _req(**sampled), *mates[1:]])[1].token_ids
    assert batched == alone
    again = engine.generate([_req(**sampled)])[0].token_ids
    assert again == alone
    others = {engine.generate([_req(**{**sampled, "seed": s})])[0].token_ids for s in range(5)}
    assert len(others | {alone}) > 1  # different seeds give different samples


def test_top_k_1_and_tiny_top_p_are_greedy(make_engine):
    engine = make_engine(num_pages=96, page_size=4)
    greedy = engine.generate([_req(temperature=0.0)])[0].token_ids
    assert engine.generate([_req(temperature=1.5, top_k=1, seed=3)])[0].token_ids == greedy
    assert engine.generate([_req(temperature=1.5, top_p=1e-6, seed=4)])[0].token_ids == greedy
    hot = engine.generate([_req(temperature=5.0, seed=5)])[0].token_ids
    assert hot != greedy  # a hot, unfiltered sampler does leave the argmax path


def test_filter_logits_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 4))
    out = filter_logits(logits, torch.ones(4), torch.tensor([0, 2, 0, 3]), torch.tensor([1.0, 1.0, 0.8, 0.6]))
    kept = torch.isfinite(out)
    assert kept[0].all()
    assert kept[1].tolist() == [True, True, False, False, False]
    # top_p 0.8: tokens are kept while the mass strictly before them is < 0.8 (0.5, 0.7, then 0.85 stops)
    assert kept[2].tolist() == [True, True, True, False, False]
    # top_k 3 first (renormalised 0.588, 0.235, 0.176), then top_p 0.6 keeps two
    assert kept[3].tolist() == [True, True, False, False, False]
    # temperature scales what survives
    hot = filter_logits(logits[:1], torch.tensor([2.0]), torch.tensor([0]), torch.tensor([1.0]))
    assert torch.allclose(hot, logits[:1] / 2)


def test_sampled_tokens_stay_inside_the_filter():
    torch.manual_seed(0)
    logits = torch.randn(1, 50).repeat(200, 1)
    params = [SamplingParams(temperature=1.0, top_k=3)] * 200
    tokens = sample_tokens(logits, params, list(range(200)))
    allowed = set(logits[0].topk(3).indices.tolist())
    assert set(tokens.tolist()) == allowed  # all three drawn over 200 rows, nothing else


def test_draws_are_uniform_and_depend_on_seed_and_counter_only():
    seeds = torch.arange(20_000, dtype=torch.int64) * 7919 + (1 << 40)
    u = uniform_draws(seeds, torch.zeros_like(seeds))
    assert u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())
    counts = torch.histc(u, bins=20, min=0.0, max=1.0)
    expected = len(u) / 20
    assert float(((counts - expected) ** 2 / expected).sum()) < 50  # chi-square, 19 dof (p ~ 1e-4)
    again = uniform_draws(seeds.flip(0), torch.zeros_like(seeds))  # order and batch do not matter
    assert torch.equal(again, u.flip(0))
    later = uniform_draws(seeds, torch.ones_like(seeds))
    assert float((later == u).double().mean()) < 1e-3 and abs(float(torch.corrcoef(torch.stack([u, later]))[0, 1])) < 0.03
    big = uniform_draws(torch.tensor([(1 << 62) - 1, 0]), torch.tensor([1 << 40, 0]))  # no overflow anywhere
    assert bool(((big >= 0) & (big < 1)).all())


def test_sampled_frequencies_follow_the_distribution():
    """Inverting the CDF at one draw per row: over many seeds, each token's share matches its
    probability (chi-square), tokens of probability 0 are never drawn."""
    probs = torch.tensor([0.5, 0.0, 0.25, 0.125, 0.0625, 0.0625, 0.0])
    n = 16_000
    logits = torch.log(probs).repeat(n, 1)
    tokens = sample_tokens(logits, [SamplingParams(temperature=1.0)] * n, list(range(n)))
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    assert counts[probs == 0].sum() == 0
    want = probs[probs > 0].double() * n
    assert float(((counts[probs > 0] - want) ** 2 / want).sum()) < 20  # 4 dof
    # the k-th draw of a seed is the same alone or in a batch, at any row
    alone = sample_tokens(logits[:1], [SamplingParams(temperature=1.0)], [123], [5])
    mixed = sample_tokens(logits[:3], [SamplingParams(temperature=1.0)] * 3, [9, 123, 4], [0, 5, 2])
    assert int(alone[0]) == int(mixed[1])
