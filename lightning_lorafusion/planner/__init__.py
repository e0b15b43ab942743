"""Multi-adapter microbatch planning: grouping, greedy and MILP packing, merge, verification."""
