"""Synthetic length distributions: determinism, published means, clipping, token samples."""

import numpy as np
import pytest

from lightning_lorafusion.data import synthetic as syn


@pytest.mark.parametrize("dist", syn.DISTRIBUTION_NAMES)
def test_same_seed_same_lengths_other_seed_differs(dist):
    a = syn.sample_lengths(dist, 500, seed=3)
    b = syn.sample_lengths(dist, 500, seed=3)
    c = syn.sample_lengths(dist, 500, seed=4)
    assert a.dtype == np.int64 and a.shape == (500,)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.mark.parametrize("dist", syn.BASE_DISTRIBUTIONS)
def test_means_match_published_statistics(dist):
    # Expected means in tokens, derived by hand from the papers' word counts (module docstring).
    spec = syn.DISTRIBUTIONS[dist]
    prompt, completion = syn.sample_prompt_completion_lengths(dist, 200_000, seed=0)
    want_prompt = spec.document_mean_words * syn.TOKENS_PER_WORD + syn.TEMPLATE_TOKENS
    want_completion = spec.summary_mean_words * syn.TOKENS_PER_WORD
    assert abs(prompt.mean() - want_prompt) / want_prompt < 0.01
    assert abs(completion.mean() - want_completion) / want_completion < 0.02
    # Spread: coefficient of variation of the document part.
    doc = prompt - syn.TEMPLATE_TOKENS
    assert abs(doc.std() / doc.mean() - spec.document_cv) < 0.03


def test_corpora_ordered_by_length_and_mixed_spans_them():
    means = {d: syn.sample_lengths(d, 20_000, seed=1).mean() for d in syn.DISTRIBUTION_NAMES}
    assert means["xsum"] < means["cnn_dailymail"] < means["wikisum"]
    # Mixed is an equal-weight mixture: its mean is the average of the three.
    avg = np.mean([means[d] for d in syn.BASE_DISTRIBUTIONS])
    assert abs(means["mixed"] - avg) / avg < 0.03


def test_max_length_truncates_prompt_and_keeps_summary():
    p0, c0 = syn.sample_prompt_completion_lengths("wikisum", 5000, seed=2)
    p, c = syn.sample_prompt_completion_lengths("wikisum", 5000, seed=2, max_length=1024, min_length=16)
    total = p + c
    assert total.max() <= 1024 and total.min() >= 16 and p.min() >= 1
    np.testing.assert_array_equal(c, np.minimum(c0, 1023))
    untouched = (p0 + c0) <= 1024
    np.testing.assert_array_equal(p[untouched], np.maximum(p0[untouched], 16 - c0[untouched]))
    assert (total[~untouched] == 1024).all()


def test_token_samples_mask_prompt():
    samples = syn.synthetic_token_samples("xsum", 20, vocab_size=50, seed=5, max_length=512)
    p, c = syn.sample_prompt_completion_lengths("xsum", 20, seed=5, max_length=512)
    for (ids, labels), pl, cl in zip(samples, p, c):
        assert len(ids) == len(labels) == pl + cl
        assert all(0 <= t < 50 for t in ids)
        assert labels[:pl] == [syn.IGNORE_INDEX] * pl
        assert labels[pl:] == ids[pl:]


def test_workload_shapes_and_independent_adapter_streams():
    w = syn.workload_lengths("heterogeneous", 5, num_batches=3, batch_size=4, seed=0, max_length=4096)
    assert len(w) == 5 and all(len(b) == 3 and all(len(s) == 4 for s in b) for b in w)
    assert syn.adapter_distributions("heterogeneous", 5) == (
        "xsum", "cnn_dailymail", "wikisum", "mixed", "xsum",
    )
    fewer = syn.workload_lengths("heterogeneous", 3, num_batches=3, batch_size=4, seed=0, max_length=4096)
    assert fewer == w[:3]
    assert max(n for b in w for s in b for n in s) <= 4096


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: syn.sample_lengths("pubmed", 3, seed=0), "unknown length distribution"),
        (lambda: syn.sample_lengths("xsum", 3, seed=0, max_length=4, min_length=8), "max_length"),
        (lambda: syn.workload_lengths("nope", 2, num_batches=1, batch_size=1, seed=0), "unknown workload"),
        (lambda: syn.synthetic_token_samples("xsum", 1, vocab_size=0, seed=0), "vocab_size"),
    ],
)
def test_bad_input_raises(call, match):
    with pytest.raises(ValueError, match=match):
        call()
