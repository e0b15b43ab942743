"""Multi-adapter microbatch planning: grouping, greedy and MILP packing, merge, verification."""

from .config import PlannerConfig, PlanningError
from .microbatch_planner import plan_microbatches
from .plan import Plan, PlannedMicrobatch, SampleRef, padded_length
from .stream import WindowPlan, join_plans, plan_stream
from .verify import check_plan, fix_plan, verify_plan
from .window import PlanReport, WaveReport, plan_window

__all__ = [
    "Plan",
    "PlanReport",
    "PlannedMicrobatch",
    "PlannerConfig",
    "PlanningError",
    "SampleRef",
    "WaveReport",
    "WindowPlan",
    "check_plan",
    "fix_plan",
    "join_plans",
    "padded_length",
    "plan_microbatches",
    "plan_stream",
    "plan_window",
    "verify_plan",
]
