"""Checking a finished plan (coverage, capacity, bubble lemma) and repairing it with no-op slots."""

from __future__ import annotations

from typing import Mapping, Sequence

from .config import Lengths, PlanningError
from .plan import Plan, PlannedMicrobatch

# What a plan leaves behind for the next one, per adapter: (last global batch seen,
# microbatches from that batch's step point to the end of the plan, i.e. len - step).
CarryState = Mapping[int, tuple[int, int]]


def _first_and_step(microbatches: tuple[PlannedMicrobatch, ...]) -> tuple[dict, dict]:
    first: dict[tuple[int, int], int] = {}
    step: dict[tuple[int, int], int] = {}
    for i, mb in enumerate(microbatches):
        for s in mb.samples:
            first.setdefault((s.adapter, s.batch), i)
            step[(s.adapter, s.batch)] = i
    return first, step


def lemma_violations(
    microbatches: tuple[PlannedMicrobatch, ...], num_stages: int, carry_in: CarryState | None = None
) -> list[str]:
    """Bubble-lemma problems: batch j+1 of an adapter must start >= num_stages after j's step."""
    first, step = _first_and_step(microbatches)
    problems = []
    for (a, j), f in sorted(first.items()):
        if (a, j - 1) in step:
            gap = f - step[(a, j - 1)]
        elif carry_in is not None and a in carry_in and carry_in[a][0] == j - 1:
            gap = f + carry_in[a][1]
        else:
            continue
        if gap < num_stages:
            problems.append(
                f"bubble lemma: adapter {a} batch {j} starts at microbatch {f}, only {gap} "
                f"microbatch(es) after batch {j - 1}'s step point (need >= num_stages={num_stages})"
            )
    return problems


def verify_plan(
    plan: Plan,
    lengths: Lengths | None = None,
    *,
    batch_offsets: Sequence[int] | None = None,
    carry_in: CarryState | None = None,
) -> list[str]:
    """Every problem of ``plan`` as a sentence; an empty list means the plan is valid.

    Checks capacity (padded tokens), adapter order inside each microbatch, step points,
    the bubble lemma and no duplicate samples; with ``lengths`` (the planner's input, batch
    ``j`` of adapter ``a`` being global batch ``batch_offsets[a] + j``) also that every sample
    appears exactly once with its length. ``carry_in`` (see ``carry_state``) extends the
    lemma check across the boundary with the plan executed before this one.
    """
    problems: list[str] = []
    seen: dict[tuple[int, int, int], int] = {}
    for i, mb in enumerate(plan.microbatches):
        padded = mb.padded_tokens(plan.pad_multiple)
        if padded > plan.capacity:
            problems.append(
                f"capacity: microbatch {i} holds {padded} padded tokens > capacity {plan.capacity}"
            )
        keys = [(s.adapter, s.batch, s.index) for s in mb.samples]
        if keys != sorted(keys):
            problems.append(f"order: microbatch {i} samples are not sorted by (adapter, batch, index)")
        for s in mb.samples:
            k = (s.adapter, s.batch, s.index)
            if k in seen:
                problems.append(
                    f"coverage: adapter {s.adapter} batch {s.batch} sample {s.index} appears in "
                    f"microbatches {seen[k]} and {i}"
                )
            seen[k] = i
    if plan.step_points != Plan.compute_step_points(plan.microbatches):
        problems.append("step_points: do not match Plan.compute_step_points(microbatches)")
    problems += lemma_violations(plan.microbatches, plan.num_stages, carry_in)
    if lengths is not None:
        lengths_by_key = {}
        for a, batches in enumerate(lengths):
            off = 0 if batch_offsets is None else batch_offsets[a]
            for j, batch in enumerate(batches):
                for idx, n in enumerate(batch):
                    lengths_by_key[(a, off + j, idx)] = int(n)
        planned = {(s.adapter, s.batch, s.index): s.length for mb in plan.microbatches for s in mb.samples}
        for k in sorted(lengths_by_key.keys() - planned.keys()):
            problems.append(f"coverage: adapter {k[0]} batch {k[1]} sample {k[2]} is missing")
        for k in sorted(planned.keys() - lengths_by_key.keys()):
            problems.append(f"coverage: adapter {k[0]} batch {k[1]} sample {k[2]} is not in the input")
        for k in sorted(planned.keys() & lengths_by_key.keys()):
            if planned[k] != lengths_by_key[k]:
                problems.append(
                    f"coverage: adapter {k[0]} batch {k[1]} sample {k[2]} has length {planned[k]} "
                    f"in the plan but {lengths_by_key[k]} in the input"
                )
    return problems


def fix_plan(plan: Plan, *, carry_in: CarryState | None = None) -> Plan:
    """Insert the fewest no-op slots that make ``plan`` respect the bubble lemma.

    ``carry_in`` describes the plan executed just before this one (see ``carry_state``), so
    plans of consecutive windows can be stitched. Raises PlanningError when no insertion can
    help: capacity exceeded, a sample twice, or batches of one adapter interleaved.
    """
    mbs = plan.microbatches
    first, step = _first_and_step(mbs)
    for (a, j), f in sorted(first.items()):
        if (a, j - 1) in step and f <= step[(a, j - 1)]:
            raise PlanningError(
                f"plan cannot be fixed with no-ops: adapter {a} batch {j} starts at microbatch "
                f"{f}, before batch {j - 1} completes at microbatch {step[(a, j - 1)]}"
            )
    hard = [p for p in verify_plan(plan) if not p.startswith(("bubble lemma", "step_points"))]
    if hard:
        raise PlanningError("plan cannot be fixed with no-ops: " + "; ".join(hard))
    # out_pos[i]: position of input microbatch i in the output; inserting only delays, so one
    # forward pass placing each microbatch as early as its constraints allow is minimal.
    out: list[PlannedMicrobatch] = []
    out_pos: list[int] = []
    starts_at: dict[int, list[tuple[int, int]]] = {}
    for key, f in first.items():
        starts_at.setdefault(f, []).append(key)
    for i, mb in enumerate(mbs):
        earliest = len(out)
        for a, j in starts_at.get(i, ()):
            if (a, j - 1) in step:
                earliest = max(earliest, out_pos[step[(a, j - 1)]] + plan.num_stages)
            elif carry_in is not None and a in carry_in and carry_in[a][0] == j - 1:
                earliest = max(earliest, plan.num_stages - carry_in[a][1])
        out.extend(PlannedMicrobatch() for _ in range(earliest - len(out)))
        out_pos.append(len(out))
        out.append(mb)
    new = tuple(out)
    return Plan(
        capacity=plan.capacity,
        pad_multiple=plan.pad_multiple,
        num_stages=plan.num_stages,
        microbatches=new,
        step_points=Plan.compute_step_points(new),
    )


def carry_state(plan: Plan, carry_in: CarryState | None = None) -> dict[int, tuple[int, int]]:
    """Per adapter, (last batch, microbatches from its step point to the plan's end) after ``plan``."""
    state = {a: (j, d + len(plan.microbatches)) for a, (j, d) in (carry_in or {}).items()}
    last: dict[int, int] = {}
    for (a, j) in plan.step_points:
        last[a] = max(last.get(a, j), j)
    for a, j in last.items():
        state[a] = (j, len(plan.microbatches) - plan.step_points[(a, j)])
    return state


def check_plan(plan: Plan, lengths: Lengths | None = None, *, batch_offsets: Sequence[int] | None = None) -> None:
    """Raise PlanningError listing every problem of ``plan`` (see ``verify_plan``)."""
    problems = verify_plan(plan, lengths, batch_offsets=batch_offsets)
    if problems:
        shown = "; ".join(problems[:10])
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise PlanningError(f"invalid plan: {shown}{more}")
