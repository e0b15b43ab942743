"""Multi-adapter microbatch planning: grouping, greedy and MILP packing, merge, verification."""

from .config import PlannerConfig, PlanningError
from .microbatch_planner import PlanReport, WaveReport, plan_microbatches, plan_window
from .plan import Plan, PlannedMicrobatch, SampleRef, padded_length
from .verify import check_plan, fix_plan, verify_plan

__all__ = [
    "Plan",
    "PlanReport",
    "PlannedMicrobatch",
    "PlannerConfig",
    "PlanningError",
    "SampleRef",
    "WaveReport",
    "check_plan",
    "fix_plan",
    "padded_length",
    "plan_microbatches",
    "plan_window",
    "verify_plan",
]
