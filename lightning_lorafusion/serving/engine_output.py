"""The engine's output assembly: each step's sampled tokens become request outputs, logprobs and
events (``_emit``), prompts are scored (``_prompt_logprobs``), requests end (``_finish``)."""

from __future__ import annotations

import logging
import time

import torch

from .detokenize import add_tokens
from .request import RequestState, Status, TokenEvent

log = logging.getLogger("lightning_lorafusion.serving")

# Rows of prompt logits materialised at once when scoring prompts ([rows, vocab] fp32).
PROMPT_LOGPROB_CHUNK = 512
FINISHED = Status.FINISHED


class OutputAssembly:
    """``Engine``'s per-row output: tokens, logprobs and finishes into ``TokenEvent`` s."""

    def _emit(self, seqs: list[RequestState], tokens: list[int], rows: "_SampledRows", chosen: list[float] | None,
              top_vals: list[list[float]] | None, top_ids: list[list[int]] | None, events: list[TokenEvent]) -> None:
        """Record each row's sampled token (its text already given to the detokenizer unless it
        is a stop token) and emit its event, finishing the requests that stop on it: on a stop
        token or stop string ("stop"), at ``max_output`` tokens ("length"). This loop runs for
        every row of every step: per-request constants only, no calls it can avoid."""
        if self.tokenizer is not None:  # every row's text in one batched decode, except rows that end on this token
            if rows.all_generate and rows.stop_ids.isdisjoint(tokens) and min(tokens) >= 0:  # the common case
                items = zip(rows.detokenizers, tokens)
            else:
                items = [(st.detokenizer, t) for st, t in zip(seqs, tokens)
                         if t not in st.stop_ids and st.max_output and t >= 0]
            add_tokens(items, self._token_texts)
        now = time.perf_counter()
        generated = first = 0
        ttft = 0.0
        lp_row = rows.logprob_row
        for i, (state, token) in enumerate(zip(seqs, tokens)):
            if state.status is FINISHED:  # stopped (or aborted) after this step was launched: discarded
                self._counters["decode_rows_discarded_total"] += 1
                continue
            if not state.max_output:  # scoring the prompt only
                self._finish(state, "length", events)
                continue
            if token < 0:
                self._counters["nonfinite_logits_total"] += 1
                log.error("request %r (adapter %r): its logits are not finite (NaN or inf) after %d tokens; it "
                          "is aborted", state.request_id, state.request.adapter, len(state.output_ids))
                state.cacheable = False  # its KV may hold NaN: never reused
                self.pool.forget_prefixes(state.pages)
                self._finish(state, "abort", events)
                continue
            out = state.output_ids
            out.append(token)
            generated += 1
            if state.first_token is None:
                state.first_token = now
                first += 1
                ttft += now - state.arrival
            lp = top = None
            if state.logprobs is not None:
                j = lp_row[i]
                want = state.sampling.logprobs
                lp = chosen[j]
                top = {} if not want else dict(zip(top_ids[j][:want], top_vals[j][:want]))
                state.logprobs.append(lp)
                state.top_logprobs.append(top)
            detok = state.detokenizer
            if token in state.stop_ids or detok.stopped:
                self._finish(state, "stop", events, token=token, logprob=lp, top=top)
            elif len(out) >= state.max_output:
                self._finish(state, "length", events, token=token, logprob=lp, top=top)
            else:
                event = TokenEvent._make((state.request.request_id, token, detok.take_delta(), lp, top, None,
                                          state.adapter_version))
                events.append(event)
                if state.on_event is not None:
                    state.on_event(event)
        counters = self._counters
        counters["generated_tokens_total"] += generated
        if first:
            counters["first_tokens_total"] += first
            counters["ttft_seconds_total"] += ttft

    def _prompt_logprobs(self, state: RequestState, hidden: torch.Tensor, first: int) -> None:
        """Each prompt token's logprob given the tokens before it (None for the first), and with
        ``prompt_logprobs=k > 0`` the k most likely tokens at each position. ``hidden`` ``[n, H]``:
        the rows of positions ``first .. first + n - 1`` (a prefill chunk, or the whole prompt),
        whose logits score prompt tokens ``first + 1 ..``; complete once the last is scored."""
        prompt = state.request.prompt_token_ids
        p, k = len(prompt), state.sampling.prompt_logprobs
        if first == 0:  # (again, after a preemption)
            state.partial_prompt_logprobs = ([None], [None])
        chosen, tops = state.partial_prompt_logprobs
        rows = min(hidden.shape[0], p - 1 - first)
        targets = torch.tensor(prompt[first + 1:first + 1 + rows], device=self.device)
        for c in range(0, rows, PROMPT_LOGPROB_CHUNK):
            lp = torch.log_softmax(self.runner.logits(hidden[c:min(c + PROMPT_LOGPROB_CHUNK, rows)]), dim=-1)
            chosen += lp.gather(1, targets[c:c + lp.shape[0], None]).squeeze(1).tolist()
            if k:
                values, ids = lp.topk(k, dim=-1)
                tops += [dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
            else:
                tops += [{} for _ in range(lp.shape[0])]
        if len(chosen) == p:
            state.prompt_logprobs, state.prompt_top_logprobs = chosen, tops
            state.partial_prompt_logprobs = None

    def _finish(self, state: RequestState, reason: str, events: list[TokenEvent], *, token: int | None = None,
                logprob: float | None = None, top: dict[int, float] | None = None) -> None:
        if state.status is Status.FINISHED:
            return
        self.scheduler.finish(state)
        state.finish_reason = reason
        state.finished = time.perf_counter()
        with self._lock:
            self._states.pop(state.request_id, None)
            if state.request_id in self._keep_results:
                self._keep_results[state.request_id] = state.result()
        event = TokenEvent(state.request_id, token, state.detokenizer.take_delta(final=True), logprob, top,
                           reason, state.adapter_version)
        events.append(event)
        if state.on_event is not None:
            state.on_event(event)

