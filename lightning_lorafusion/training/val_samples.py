"""Greedy generations for fixed validation prompts: every adapter's prompts in one batch of the
multi-adapter generation engine (paged KV cache) over the training module's frozen base."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..data.microbatch import IGNORE_INDEX
from ..model import decoder as dec


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
    backend: str = "auto",
    page_size: int = 16,
) -> list[tuple[int, ...]]:
    """Greedy continuation (at most ``max_new_tokens``, stopping at and keeping ``eos_token_id``)
    of every prompt with its own adapter of ``bank`` (no dropout), all prompts in one
    ``Engine.generate`` call.

    The engine runs over ``params`` in place (their device and dtype, no copy), with a pool of
    exactly the pages these prompts and the adapters they use need, and the adapters' current
    weights; the engine is dropped before returning, so no memory stays held."""
    from ..serving import Engine, EngineConfig, GenerationRequest, SamplingParams
    from ..serving.adapters import adapter_numel

    if not prompts:
        return []
    used = sorted({p.adapter for p in prompts})
    specs = [bank.specs[a] for a in used]
    page_elems = config.num_layers * 2 * page_size * config.kv_size
    kv_pages = sum(-(-(len(p.prompt) + max_new_tokens) // page_size) for p in prompts)
    adapter_pages = sum(-(-adapter_numel(config, s.rank, s.target_modules, s.layout) // page_elems) for s in specs)
    prompt_tokens = sum(len(p.prompt) for p in prompts)
    engine_config = EngineConfig(
        page_size=page_size, num_pages=kv_pages + adapter_pages, max_num_seqs=len(prompts),
        max_num_batched_tokens=max(prompt_tokens, len(prompts)), backend=backend, cuda_graphs="off",
        kv_watermark=0.0, fuse_projections=False)  # the engine shares the training module's weights
    device = dec.embedding_device_dtype(params)[0]
    engine = Engine(config, params, None, engine_config, device=device,
                    eos_token_ids=() if eos_token_id is None else (eos_token_id,))
    try:
        for a, spec in zip(used, specs):
            factors, magnitudes = {}, {}
            for layer, module in spec.layout.adapted(config.num_layers):
                f = bank.factors(a, layer, module)
                factors[(layer, module)] = (f.lora_A.detach(), f.lora_B.detach())
                if f.lora_magnitude is not None:  # DoRA
                    magnitudes[(layer, module)] = f.lora_magnitude.detach().cpu()
            engine.add_adapter_weights(spec.name, factors, rank=spec.rank, alpha=spec.alpha, layout=spec.layout,
                                       magnitudes=magnitudes or None)
        greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
        requests = [GenerationRequest(prompt_token_ids=p.prompt, adapter=bank.specs[p.adapter].name,
                                      sampling=greedy) for p in prompts]
        # the base's own dtype, whatever autocast the caller runs under
        with torch.autocast(device_type=device.type, enabled=False):
            results = engine.generate(requests)
    finally:
        engine.close()
        del engine
    return [tuple(r.token_ids) for r in results]


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
