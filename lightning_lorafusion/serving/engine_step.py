"""One engine step: admit, run the forward, sample, and hand the tokens to the output assembly;
with the overlapped decode, the launched step whose tokens are read a call later (``_Launched``)."""

from __future__ import annotations

import itertools
import operator
import time

import torch

from .request import RequestState, TokenEvent
from .sampling import LogitAdjustments, SamplingRows, sample_rows_checked, token_logprobs


class EngineStep:
    """``Engine.step``'s body: scheduler -> runner -> sampler -> ``_emit``; the state it reads
    is set up by ``Engine.__init__``."""

    def _step(self) -> list[TokenEvent]:
        """The step itself (caller holds ``_step_lock``)."""
        events: list[TokenEvent] = []
        self._take_incoming(events)
        self._retire_adapters()
        running, self._inflight = self._inflight, None
        plan = None
        now = time.perf_counter()
        ledger = self._ledger  # (read once: another thread may turn it off meanwhile)
        clock = ledger.clock if ledger is not None else None
        drained = False
        if running is not None:  # a step is on the device: launch the next one first
            if self.pool.pages_moved == running.pages_moved:  # (a prefetch's page-in may move them)
                plan = self.scheduler.plan_ahead(running.seqs, admit=self._mixed_ahead)
                if clock is not None:
                    clock.add("schedule_s", time.perf_counter() - now)
            if plan is None:  # the next step depends on its tokens
                self._complete(running, events)
                running, drained = None, True
            else:
                self._counters["mixed_steps_ahead_total" if plan.prefill else "decode_steps_ahead_total"] += 1
        if plan is None:
            t0 = time.perf_counter()
            plan = self.scheduler.schedule()
            if plan.empty:
                if clock is not None and drained:  # the call only read the last launched step's tokens
                    clock.drain(now, time.perf_counter())
                elif clock is not None:
                    clock.drop_phases()
                return events
            if clock is not None:
                clock.add("schedule_s", time.perf_counter() - t0)
        if clock is not None:  # before the step advances the rows' num_cached
            ledger.record(plan.prefill, plan.prefill_lens, plan.decode)
            clock.begin(now)
        for state in plan.prefill:
            if state.first_scheduled is None:
                state.first_scheduled = now
                self._counters["prompt_tokens_total"] += len(state.request.prompt_token_ids)
        with torch.no_grad():
            self._run(plan, events, running)
            if running is not None:
                self._complete(running, events)
        end = time.perf_counter()
        seconds = end - now
        if clock is not None:
            clock.end(end, self.runner.step_kind)
        counters = self._counters
        counters["steps_total"] += 1
        counters["step_rows_total"] += len(plan.prefill) + len(plan.decode)
        counters["step_seconds_total"] += seconds
        if plan.prefill:  # steps with prefill rows run eagerly (decode-only steps replay CUDA graphs where captured)
            counters["prefill_steps_total"] += 1
            counters["prefill_step_seconds_total"] += seconds
        return events

    def _run(self, plan, events: list[TokenEvent], running: "_Launched | None" = None) -> None:
        """Run ``plan``'s forward, sample and emit; under the overlapped decode the step is
        launched and left in ``_inflight`` instead (``_complete`` emits it). ``running``: the
        step still on the device whose rows ``plan`` continues (``Scheduler.plan_ahead``; a
        decode-only step, or a step with prefill rows whose prefills all completed): its
        sampled tokens are the inputs of ``plan``'s decode rows (``plan`` may admit requests
        too: a mixed step planned ahead, ``EngineTuning.mixed_ahead``)."""
        last, self._last_sampled = self._last_sampled, None
        if plan.prefill:
            # planned ahead: the decode rows' newest tokens are the running step's, on the device
            fed = self._fed_tokens(running, plan.decode) if running is not None and plan.decode else None
            batch = self.runner.prepare(plan.prefill, plan.decode, plan.prefill_lens, fed=fed)
            hidden = self.runner.forward(batch)
            seqs, last_rows = [], []  # requests that sample a token this step, and their rows
            for state, n, (start, end) in zip(plan.prefill, plan.prefill_lens, batch.spans):
                if state.wants_prompt_logprobs:
                    self._prompt_logprobs(state, hidden[start:end], state.num_cached)
                state.num_cached += n
                self.scheduler.register_computed_pages(state)
                if state.num_cached == state.num_tokens:  # its prefill is complete (else a chunk ran)
                    seqs.append(state)
                    last_rows.append(end - 1)
            seqs += plan.decode
            last_rows += [end - 1 for _, end in batch.spans[len(plan.prefill):]]
            if not seqs:  # (the step's end marks its launch)
                self._prefetch_after_launch(running)
                return
            # pinned, asynchronous: a copy from pageable memory would wait here for the forward
            rows_t = torch.tensor(last_rows, pin_memory=hidden.is_cuda).to(hidden.device, non_blocking=True)
            logits = self.runner.logits(hidden.index_select(0, rows_t))
        elif running is not None:  # decode only, fed the running step's tokens on the device
            seqs = plan.decode
            logits = self.runner.decode_logits(seqs, token_tensor=self._fed_tokens(running, seqs))
        else:  # decode only: a CUDA graph replay where captured
            seqs = plan.decode
            # the previous step sampled these very rows: their tokens are the inputs
            same = last is not None and len(last[0]) == len(seqs) and all(map(operator.is_, seqs, last[0]))
            logits = self.runner.decode_logits(seqs, last[1] if same else None)
        # planned ahead, every decode row is one token further than its state holds
        ahead = 0 if running is None else 1 if not plan.prefill else [0] * (len(seqs) - len(plan.decode)) + [1] * len(
            plan.decode)
        rows = self._sampled_rows(seqs, ahead=ahead)
        adjust = rows.adjust
        # finite: no NaN / +inf in the row's logits (read off the argmax's pass; a bias or penalty
        # keeps NaN and inf as they are)
        tokens, finite = sample_rows_checked(logits if adjust is None else adjust.apply(logits), rows.sampling)
        if adjust is not None:
            adjust.note(tokens)
        chosen = top_vals = top_ids = None
        if rows.top_n is not None:
            lp_logits, lp_tokens = logits, tokens
            if rows.logprob_index is not None:  # only the rows that asked
                lp_logits, lp_tokens = logits.index_select(0, rows.logprob_index), tokens[rows.logprob_index]
            chosen, top_vals, top_ids = token_logprobs(lp_logits, lp_tokens, rows.top_n)
        for state in plan.decode:
            state.num_cached += 1
        # a row whose logits are not finite (an overflow in its adapter, say) gets token -1:
        # that request ends ("abort", logged), the others go on
        launched = _Launched(seqs, rows, tokens, torch.where(finite, tokens, -1), chosen, top_vals, top_ids,
                             self.pool.pages_moved, decode_only=not plan.prefill)
        ledger = self._ledger  # (read once: another thread may turn it off meanwhile)
        if ledger is not None:
            ledger.clock.launched()
        self._prefetch_after_launch(running)
        if self._overlap:
            self._inflight = launched
            return
        self._complete(launched, events)

    @staticmethod
    def _fed_tokens(running: "_Launched", seqs: list[RequestState]) -> torch.Tensor:
        """The running step's sampled tokens of ``seqs`` (in order; its rows that go on), on the
        device: the inputs of a step planned ahead of them."""
        fed = running.tokens
        if len(seqs) != len(running.seqs):  # rows that end with the running step left out
            ids = set(map(id, seqs))
            keep = [i for i, st in enumerate(running.seqs) if id(st) in ids]
            fed = fed.index_select(0, torch.tensor(keep, pin_memory=fed.is_cuda).to(fed.device, non_blocking=True))
        return fed

    def _prefetch_after_launch(self, running: "_Launched | None") -> None:
        """Page in the next admissions' adapters now that the step is queued on the device
        (``Scheduler.prefetch``): after a step planned ahead (``running``: the step before it
        is still on the device), and after every step with ``prefetch_ahead``."""
        if running is not None or self.scheduler.prefetch_ahead:
            self.scheduler.prefetch()

    def _complete(self, launched: "_Launched", events: list[TokenEvent]) -> None:
        """Read a launched step's tokens (waiting for the device) and emit them."""
        ledger = self._ledger
        clock = ledger.clock if ledger is not None else None
        t0 = time.perf_counter()
        tokens, chosen, top_vals, top_ids = launched.read()
        # (a step launched after this one with prefill rows moved its rows on: nothing to reuse)
        self._last_sampled = (launched.seqs, tokens) if launched.decode_only and self._inflight is None else None
        t1 = time.perf_counter()
        self._emit(launched.seqs, tokens, launched.rows, chosen, top_vals, top_ids, events)
        if clock is not None:
            clock.add("wait_s", t1 - t0)
            clock.add("emit_s", time.perf_counter() - t1)

    def _sampled_rows(self, seqs: list[RequestState], ahead: "int | list[int]" = 0) -> "_SampledRows":
        """What sampling needs of ``seqs``, reused while the batch keeps the same requests in
        the same order (decode steps between arrivals and finishes). ``ahead`` (one value, or one
        per row): the rows with one token more than their states hold (a step planned ahead: its
        decode rows, all rows of the last composition, whose device-side counts already hold
        that token; not the prefill rows of a mixed step planned ahead)."""
        rows = self._rows
        if rows is None or len(rows.states) != len(seqs) or not all(map(operator.is_, seqs, rows.states)):
            rows = self._rows = _SampledRows(seqs, self.device, self.model_config.vocab_size, previous=rows,
                                             ahead=ahead)
        return rows

    def _take_incoming(self, events: list[TokenEvent]) -> None:
        with self._lock:
            incoming, aborts = list(self._incoming), list(self._aborts)
            self._incoming.clear()
            self._aborts.clear()
        for state in incoming:
            self.scheduler.add(state)
        for rid in aborts:
            state = self._states.get(rid)
            if state is not None:
                self._finish(state, "abort", events)


class _Launched:
    """A step's sampled tokens on the device, and their copies to the host under way (pinned
    memory, an event after them on CUDA): ``read`` waits for that event only, so a step
    launched after this one keeps the device busy meanwhile. ``tokens`` feed the next step;
    ``emitted`` (-1 where the logits were not finite) are what ``read`` returns."""

    __slots__ = ("seqs", "rows", "tokens", "pages_moved", "decode_only", "_host", "_event")

    def __init__(self, seqs: list[RequestState], rows: "_SampledRows", tokens: torch.Tensor,
                 emitted: torch.Tensor, chosen: torch.Tensor | None, top_vals: torch.Tensor | None,
                 top_ids: torch.Tensor | None, pages_moved: int, *, decode_only: bool) -> None:
        self.seqs, self.rows, self.tokens, self.pages_moved = seqs, rows, tokens, pages_moved
        self.decode_only = decode_only
        cuda = tokens.device.type == "cuda"
        self._host = [None if t is None else _to_host(t, cuda) for t in (emitted, chosen, top_vals, top_ids)]
        self._event = None
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def read(self) -> tuple[list[int], list | None, list | None, list | None]:
        if self._event is not None:
            self._event.synchronize()
        return tuple(None if t is None else t.tolist() for t in self._host)


def _to_host(t: torch.Tensor, cuda: bool) -> torch.Tensor:
    if not cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


_greedy = operator.attrgetter("greedy")
_adjusts = operator.attrgetter("adjusts_logits")
_logprobs = operator.attrgetter("logprobs")


class _SampledRows:
    """What a step needs of its sampled requests (``states``, in row order), gathered once per
    batch composition: their sampling settings, their logit adjustments, the rows that want
    logprobs, their detokenizers and stop ids."""

    def __init__(self, states: list[RequestState], device: torch.device, vocab: int,
                 previous: "_SampledRows | None" = None, ahead: "int | list[int]" = 0) -> None:
        self.states = list(states)
        rows = range(len(states))
        aheads = ahead if isinstance(ahead, list) else [int(ahead)] * len(states)
        if all(map(_greedy, states)):  # (what build gives for greedy rows only, without a pass over them)
            self.sampling = SamplingRows.build((), (), (), device)
        else:
            self.sampling = SamplingRows.build([s.sampling for s in states], [s.seed for s in states],
                                               [len(s.output_ids) + a for s, a in zip(states, aheads)], device)
        # bias and penalties: their rows' token counts, kept up to date while the batch lasts
        adjusted = list(itertools.compress(rows, map(_adjusts, states)))
        self.adjust = None if not adjusted else LogitAdjustments(
            adjusted, [states[i].sampling for i in adjusted], [states[i].request.prompt_token_ids for i in adjusted],
            [states[i].output_ids for i in adjusted], vocab, device, [states[i].stop_ids for i in adjusted],
            # keyed by the states themselves (a request id may come back for a new request;
            # ``previous`` holds its states, so no id() of theirs is reused meanwhile)
            ids=[id(states[i]) for i in adjusted], previous=None if previous is None else previous.adjust,
            ahead=[aheads[i] for i in adjusted])
        # rows that asked for logprobs (their states' lists, possibly still empty, are not None)
        want = list(itertools.compress(rows, map(operator.is_not, map(_logprobs, states), itertools.repeat(None))))
        self.top_n = max((states[i].sampling.logprobs for i in want), default=None)
        self.logprob_row = {i: j for j, i in enumerate(want)}  # row -> its row in the logprob tensors
        self.logprob_index = (torch.tensor(want, pin_memory=device.type == "cuda").to(device, non_blocking=True)
                              if want and len(want) < len(states) else None)
        # for detokenization: every row generates (none only scores its prompt), the stop ids of any row
        self.all_generate = all(s.max_output for s in states)
        self.stop_ids = frozenset().union(*(s.stop_ids for s in states))
        self.detokenizers = [s.detokenizer for s in states]
