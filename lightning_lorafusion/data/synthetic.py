"""Synthetic summarisation workloads whose sample lengths follow XSum, CNN/DailyMail and WikiSum.

No dataset can be downloaded where this project is tested, so tests and benchmarks draw
sample lengths (prompt = instruction template + document, completion = summary) from
log-normal distributions matched to published corpus statistics. Lengths are in
Llama-style BPE tokens; published figures are in words/whitespace tokens and are converted
with ``TOKENS_PER_WORD`` (an assumption, see below).

Sources of the parameters (mean length, in words, of the document and of the summary):

- ``xsum``: Narayan, Cohen & Lapata 2018, "Don't Give Me the Details, Just the Summary!"
  (EMNLP), Table 1: documents 431.07 words, summaries 23.26 words (one sentence).
- ``cnn_dailymail``: See, Liu & Manning 2017, "Get To The Point" (ACL), Section 4:
  articles 781 tokens on average, summaries 56 tokens (3.75 sentences); their tokens are
  whitespace/punctuation tokens, treated here as words.
- ``wikisum``: Cohen, Kalinsky, Ziser & Moschitti 2021, "WikiSum: Coherent Summarization
  Dataset for Efficient Human-Evaluation" (ACL short), WikiHow how-to articles with
  coherent-paragraph summaries. We could not consult the paper's statistics table offline;
  the means used (documents 1,250 words, summaries 140 words: longer documents than
  CNN/DM and paragraph-long summaries, as the paper describes) are ASSUMPTIONS to be
  replaced by the table's values when checked.

Spreads are not reported by these papers; we assume a coefficient of variation of 0.5 for
documents and 0.4 for summaries (long right tails, as news-article lengths have).
``TOKENS_PER_WORD = 1.3`` is the usual rule of thumb for English under Llama/GPT BPE
vocabularies (assumption). Every prompt also carries ``TEMPLATE_TOKENS`` of instruction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

TOKENS_PER_WORD = 1.3
TEMPLATE_TOKENS = 16
IGNORE_INDEX = -100


@dataclass(frozen=True, kw_only=True)
class LengthDistribution:
    """Log-normal prompt/completion lengths in tokens, from mean words and coefficient of variation."""

    name: str
    document_mean_words: float
    summary_mean_words: float
    document_cv: float = 0.5
    summary_cv: float = 0.4
    source: str = ""

    def lognormal_params(self, mean_tokens: float, cv: float) -> tuple[float, float]:
        """(mu, sigma) of the log-normal with the given mean and coefficient of variation."""
        sigma2 = math.log1p(cv * cv)
        return math.log(mean_tokens) - sigma2 / 2.0, math.sqrt(sigma2)

    def draw(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        mu_d, s_d = self.lognormal_params(self.document_mean_words * TOKENS_PER_WORD, self.document_cv)
        mu_s, s_s = self.lognormal_params(self.summary_mean_words * TOKENS_PER_WORD, self.summary_cv)
        doc = rng.lognormal(mu_d, s_d, size=n)
        summ = rng.lognormal(mu_s, s_s, size=n)
        prompt = np.rint(doc).astype(np.int64) + TEMPLATE_TOKENS
        completion = np.maximum(np.rint(summ).astype(np.int64), 1)
        return prompt, completion


DISTRIBUTIONS: dict[str, LengthDistribution] = {
    "xsum": LengthDistribution(
        name="xsum",
        document_mean_words=431.07,
        summary_mean_words=23.26,
        source="Narayan et al. 2018, Table 1",
    ),
    "cnn_dailymail": LengthDistribution(
        name="cnn_dailymail",
        document_mean_words=781.0,
        summary_mean_words=56.0,
        source="See et al. 2017, Section 4",
    ),
    "wikisum": LengthDistribution(
        name="wikisum",
        document_mean_words=1250.0,
        summary_mean_words=140.0,
        source="Cohen et al. 2021 (means assumed, see module docstring)",
    ),
}
BASE_DISTRIBUTIONS = tuple(DISTRIBUTIONS)
MIXED = "mixed"
DISTRIBUTION_NAMES = BASE_DISTRIBUTIONS + (MIXED,)
# Benchmark workloads of the planner issue; "heterogeneous" gives adapter i the i-th
# entry of HETEROGENEOUS_CYCLE (one adapter per corpus plus one mixed, repeating).
WORKLOADS = ("xsum", "cnn_dailymail", "wikisum", "mixed", "heterogeneous")
HETEROGENEOUS_CYCLE = ("xsum", "cnn_dailymail", "wikisum", "mixed")


def _check_distribution(distribution: str) -> None:
    if distribution not in DISTRIBUTION_NAMES:
        raise ValueError(
            f"unknown length distribution {distribution!r}; allowed: {list(DISTRIBUTION_NAMES)}"
        )


def sample_prompt_completion_lengths(
    distribution: str,
    n: int,
    *,
    seed: int,
    min_length: int = 8,
    max_length: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and completion token counts ``[n]`` int64 each, deterministic for ``seed``.

    Totals are clipped to ``[min_length, max_length]`` by shortening the prompt (the document
    is truncated, the summary kept), as a tokenizer with ``max_length`` truncation would do;
    the completion itself is shortened only when it alone exceeds ``max_length - 1``.
    ``"mixed"`` draws every sample from one of the three corpora chosen uniformly at random.
    """
    _check_distribution(distribution)
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    if min_length < 2:
        raise ValueError(f"min_length={min_length} must be >= 2 (one prompt and one completion token)")
    if max_length is not None and max_length < min_length:
        raise ValueError(f"max_length={max_length} must be >= min_length={min_length}")
    rng = np.random.default_rng(seed)
    if distribution == MIXED:
        which = rng.integers(0, len(BASE_DISTRIBUTIONS), size=n)
        prompt = np.empty(n, dtype=np.int64)
        completion = np.empty(n, dtype=np.int64)
        for k, name in enumerate(BASE_DISTRIBUTIONS):
            p, c = DISTRIBUTIONS[name].draw(rng, n)
            prompt[which == k] = p[which == k]
            completion[which == k] = c[which == k]
    else:
        prompt, completion = DISTRIBUTIONS[distribution].draw(rng, n)
    if max_length is not None:
        completion = np.minimum(completion, max_length - 1)
        prompt = np.minimum(prompt, max_length - completion)
    prompt = np.maximum(prompt, min_length - completion).astype(np.int64)
    prompt = np.maximum(prompt, 1)
    return prompt, completion.astype(np.int64)


def sample_lengths(
    distribution: str,
    n: int,
    *,
    seed: int,
    min_length: int = 8,
    max_length: int | None = None,
) -> np.ndarray:
    """Total tokens (prompt + completion) of ``n`` samples, ``[n]`` int64."""
    prompt, completion = sample_prompt_completion_lengths(
        distribution, n, seed=seed, min_length=min_length, max_length=max_length
    )
    return prompt + completion


def synthetic_token_samples(
    distribution: str,
    n: int,
    *,
    vocab_size: int,
    seed: int,
    max_length: int | None = None,
    min_length: int = 8,
) -> list[tuple[list[int], list[int]]]:
    """``n`` samples ``(input_ids, labels)`` of random tokens in ``[0, vocab_size)``.

    ``labels`` equals ``input_ids`` on the completion and ``IGNORE_INDEX`` (-100) on the
    prompt; it is aligned with ``input_ids`` (not shifted). The training data path wants
    pre-shifted labels: convert with ``data.tokenization.shifted_labels`` (the ``synthetic``
    source kind does).
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size} must be >= 1")
    prompt, completion = sample_prompt_completion_lengths(
        distribution, n, seed=seed, min_length=min_length, max_length=max_length
    )
    rng = np.random.default_rng([seed, 1])
    out: list[tuple[list[int], list[int]]] = []
    for p, c in zip(prompt.tolist(), completion.tolist()):
        ids = rng.integers(0, vocab_size, size=p + c).tolist()
        out.append((ids, [IGNORE_INDEX] * p + ids[p:]))
    return out


def adapter_distributions(workload: str, num_adapters: int) -> tuple[str, ...]:
    """The length distribution of each adapter of a benchmark ``workload``."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; allowed: {list(WORKLOADS)}")
    if num_adapters < 1:
        raise ValueError(f"num_adapters={num_adapters} must be >= 1")
    if workload == "heterogeneous":
        return tuple(HETEROGENEOUS_CYCLE[i % len(HETEROGENEOUS_CYCLE)] for i in range(num_adapters))
    return (workload,) * num_adapters


def workload_lengths(
    workload: str,
    num_adapters: int,
    *,
    num_batches: int,
    batch_size: int,
    seed: int,
    max_length: int | None = None,
    min_length: int = 8,
) -> list[list[list[int]]]:
    """Token lengths ``[adapter][global batch][sample]`` of a benchmark workload.

    This is the input format of ``lightning_lorafusion.planner.plan_microbatches``. Adapter
    ``a`` draws from ``adapter_distributions(workload, num_adapters)[a]`` with its own seed
    stream ``(seed, a)``, so adding adapters does not change the others' samples.
    """
    if num_batches < 0 or batch_size < 1:
        raise ValueError(f"num_batches={num_batches} must be >= 0 and batch_size={batch_size} >= 1")
    out: list[list[list[int]]] = []
    for a, dist in enumerate(adapter_distributions(workload, num_adapters)):
        seed_a = int(np.random.SeedSequence([seed, a]).generate_state(1)[0])
        flat = sample_lengths(
            dist, num_batches * batch_size, seed=seed_a, min_length=min_length, max_length=max_length
        ).tolist()
        out.append([flat[j * batch_size : (j + 1) * batch_size] for j in range(num_batches)])
    return out
