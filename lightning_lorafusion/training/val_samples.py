"""Greedy generations for fixed validation prompts, every adapter's prompts packed into one forward.

A simple loop over the functional decoder (no KV cache: each new token recomputes the prefix),
enough for a few prompts per adapter at each validation; the multi-adapter serving engine is
the fast path for real generation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from ..data.microbatch import IGNORE_INDEX
from ..data.packing import PackingConfig, SampleLookup, pack_microbatch
from ..data.tokenization import TokenizedSample
from ..model import decoder as dec
from ..planner.plan import PlannedMicrobatch, SampleRef, padded_length


@dataclass(frozen=True)
class ValPrompt:
    """One val sample split at its first label: ``prompt`` tokens and the ``reference`` completion."""

    adapter: int
    prompt: tuple[int, ...]
    reference: tuple[int, ...]


def split_prompt(adapter: int, sample: Any) -> ValPrompt:
    """The prompt is every token up to the first one with a label (labels are pre-shifted:
    ``labels[i]`` is the target after token ``i``); the reference is the rest."""
    first = next((i for i, t in enumerate(sample.labels) if t != IGNORE_INDEX), len(sample.labels) - 1)
    ids = tuple(sample.input_ids)
    return ValPrompt(adapter=adapter, prompt=ids[: first + 1], reference=ids[first + 1:])


def greedy_generate(
    params: Any,
    bank: Any,
    config: dec.DecoderConfig,
    prompts: Sequence[ValPrompt],
    *,
    max_new_tokens: int,
    eos_token_id: int | None,
    pad_multiple: int = 1,
    pad_token_id: int = 0,
    backend: str = "torch",
    device: torch.device | str = "cpu",
) -> list[tuple[int, ...]]:
    """Greedy continuation (at most ``max_new_tokens``, stopping at ``eos_token_id``) of every
    prompt with its own adapter: one packed forward per new token for all prompts still going."""
    seqs = [list(p.prompt) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    num_adapters = bank.num_adapters
    for _ in range(max_new_tokens):
        if not live:
            break
        order = sorted(live, key=lambda i: (prompts[i].adapter, i))
        datasets: list[list[TokenizedSample]] = [[] for _ in range(num_adapters)]
        refs = []
        for i in order:
            a = prompts[i].adapter
            refs.append(SampleRef(adapter=a, batch=0, index=len(datasets[a]), length=len(seqs[i])))
            datasets[a].append(TokenizedSample(input_ids=tuple(seqs[i]), labels=(IGNORE_INDEX,) * len(seqs[i])))
        # where each sequence's last token lands: adapter segments in order, each padded
        last_rows, cursor, start, current = [], 0, 0, None
        for ref in refs:
            if ref.adapter != current:  # a new segment starts after the previous one's padding
                start = cursor = start + padded_length(cursor - start, pad_multiple)
                current = ref.adapter
            cursor += ref.length
            last_rows.append(cursor - 1)
        used = start + padded_length(cursor - start, pad_multiple)
        capacity = padded_length(max(used, 1), pad_multiple)
        lookup = SampleLookup(datasets, [[list(range(len(d)))] for d in datasets])
        mb = pack_microbatch(
            PlannedMicrobatch(tuple(refs)), lookup,
            config=PackingConfig(capacity=capacity, pad_multiple=pad_multiple, pad_token_id=pad_token_id),
            num_adapters=num_adapters, denominators={(a, 0): 1 for a in range(num_adapters)},
            step_adapters=(), index=0,
        ).to(device)
        routing = bank.routing(mb.segments, 0, mb.capacity, train=False)
        h = dec.embed(params, mb.input_ids)
        h = dec.decoder_layers(params, bank.view(), h, mb.position_ids, mb.cu_seqlens, routing,
                               config=config, backend=backend)
        h = h[torch.tensor(last_rows, device=h.device)]
        logits = F.linear(dec.rms_norm(h, params["norm"], config.rms_norm_eps), params["lm_head"])
        next_ids = logits.argmax(dim=-1).tolist()
        still = []
        for i, token in zip(order, next_ids):
            out[i].append(int(token))
            seqs[i].append(int(token))
            if token != eos_token_id:
                still.append(i)
        live = sorted(still)
    return [tuple(o) for o in out]


def rouge_scores(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Mean ROUGE-1 / ROUGE-2 / ROUGE-L F1 (the ``rouge-score`` package, Porter stemming)."""
    try:
        from rouge_score import rouge_scorer
    except ImportError as err:
        from ..specs import ConfigError

        raise ConfigError("metric: rouge needs the rouge-score package; pip install 'rouge-score>=0.1.2'") from err
    root = logging.getLogger()
    handlers = list(root.handlers)
    try:
        scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    finally:  # its first absl log line installs a root handler: every log line would print twice
        root.handlers[:] = handlers
    totals = {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    for prediction, reference in zip(predictions, references):
        for key, score in scorer.score(reference, prediction).items():
            totals[key] += score.fmeasure
    n = max(1, len(predictions))
    return {key: value / n for key, value in totals.items()}
