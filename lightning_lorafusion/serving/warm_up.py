"""Engine warm-up: synthetic requests through every kind of step the loaded adapters make."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ..specs import ConfigError
from .request import GenerationRequest
from .sampling import SamplingParams

log = logging.getLogger("lightning_lorafusion.serving")


class EngineWarmUp:
    """``Engine.warm_up``."""

    def warm_up(self, *, prompt_len: int = 24, max_new_tokens: int = 2) -> dict[str, Any]:
        """Run a few synthetic greedy requests through every kind of step the loaded adapters
        make, so first-time costs (Triton compiles per rank block and launch specialisation, the
        first replays of the decode graphs, cuBLAS heuristics) are paid here and not by the first
        users (a step whose mix of ranks is new to the process stalls for seconds on a GPU:
        docs/BENCHMARKS.md, generation engine). Rounds: the base and one adapter of each distinct
        rank alone; all of them in one batch; two of each with prompts 4x longer (tiles spanning
        rows, two requests per adapter). Then drops the prompts' cached prefix pages, and builds
        (on a GPU: captures) the mixed-step pieces of every token bucket for the adapters' rank
        blocks (``ModelRunner.build_mixed_pieces``). Returns what ran. Call it before serving
        (``serve`` does, unless ``warm_up: false``)."""
        if prompt_len < 1 or max_new_tokens < 1:
            raise ConfigError(f"warm_up: prompt_len={prompt_len} and max_new_tokens={max_new_tokens} must be >= 1")
        t0 = time.perf_counter()
        by_rank: dict[int, str] = {}
        for info in sorted(self.adapters(), key=lambda a: a.name):
            by_rank.setdefault(info.rank, info.name)
        names: list[str | None] = [None, *(by_rank[r] for r in sorted(by_rank))]
        vocab = self.model_config.vocab_size
        pool = self.pool
        gen = torch.Generator().manual_seed(0)
        serial = iter(range(1 << 30))

        def request(adapter: str | None, length: int) -> GenerationRequest:
            # within the context, and within half of what the pool leaves beside the adapter (a
            # request that fits alone is admitted once the batch's others finish)
            pages = pool.num_pages - (pool.pages_for_adapter(self._adapters[adapter]) if adapter else 0)
            length = max(1, min(length, self.max_model_len - max_new_tokens - 1,
                                pages // 2 * pool.page_size - max_new_tokens))
            prompt = torch.randint(1, vocab, (length,), generator=gen).tolist()
            return GenerationRequest(prompt_token_ids=prompt, adapter=adapter, request_id=f"warm-up-{next(serial)}",
                                     sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                                             ignore_eos=True))

        rounds = [[request(n, prompt_len)] for n in names]
        rounds.append([request(n, prompt_len) for n in names])
        rounds.append([request(n, 4 * prompt_len) for n in names for _ in range(2)])
        for batch in rounds:
            self.generate(batch)
        freed = self.reset_prefix_cache()
        # mixed steps as pieces: every token bucket's, for the rank blocks these adapters make,
        # built (captured) now rather than by the first step of each (bucket, rank block)
        t_pieces = time.perf_counter()
        with self._step_lock:
            pieces = self.runner.build_mixed_pieces(by_rank)
        pieces_s = time.perf_counter() - t_pieces
        if pieces:
            log.info("mixed-step pieces: %d (token bucket, rank block) keys %s in %.1f s", pieces,
                     "captured" if self.runner.mixed_pieces == "graphs" else "built", pieces_s)
        seconds = time.perf_counter() - t0
        ranks = sorted(by_rank)
        return {"requests": sum(map(len, rounds)), "rounds": len(rounds), "ranks": ranks, "seconds": seconds,
                "prefix_pages_freed": freed, "mixed_piece_keys": pieces, "mixed_pieces_s": pieces_s}

