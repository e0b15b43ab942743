"""Decode-row groupings for the grouped LoRA kernels' tests (imported by test_lora_gather.py and
test_lora_epilogues.py)."""

from __future__ import annotations

import torch


def wrong_groups(keys: list[int], wrong: str) -> torch.Tensor:
    """A grouping of rows whose adapters are ``keys`` that does not match them: "one_adapter"
    (every row told it shares one adapter), "shifted" (each row given its neighbour's
    adapter), "dropped_group" (the first group's columns replaced by a copy of the second's:
    its rows are left out, the second's come twice), "duplicated_row" (the second group's
    first row replaced by the first group's first: one row twice, one missing)."""
    from lightning_lorafusion.kernels.lora_gather import adapter_groups

    rows = len(keys)
    if wrong == "one_adapter":
        return adapter_groups([1] * rows, rows)
    if wrong == "shifted":
        return adapter_groups(keys[1:] + keys[:1], rows)
    groups = adapter_groups(keys, rows)
    if wrong == "dropped_group":
        groups[:, 0] = groups[:, 1]
    else:
        groups[2, groups[0, 1]] = groups[2, groups[0, 0]]
    return groups


def assert_per_row_bits(got: torch.Tensor, per_row: torch.Tensor) -> None:
    """The row-loop form runs the per-row kernel's helpers in the same order: under the Triton
    interpreter that gives the same bits. Compiled for a GPU, the two kernels may contract a
    multiply and an add into one FMA in different places, so there the bar is a few units in
    the last place of ``got``'s dtype."""
    if got.device.type == "cpu":
        assert torch.equal(got, per_row)
    else:
        eps = torch.finfo(got.dtype).eps
        torch.testing.assert_close(got, per_row, rtol=4 * eps, atol=4 * eps)
