"""The decode graphs' rank variant (``decode_graphs.graph_key``): a decode step replays its
bucket's graph captured for the kernels' rank variant of the step's largest rank; warm-up
captures every variant of every bucket up front, at most two per bucket, and which ranks are
loaded changes neither the captured keys nor whether a later step finds its graph (CPU: the
keys' logic, no CUDA graph)."""

from __future__ import annotations

from lightning_lorafusion.kernels import lora_gather
from lightning_lorafusion.serving.decode_graphs import captured_keys, graph_buckets, graph_key


def test_every_step_finds_a_captured_graph_and_buckets_have_at_most_two_variants(monkeypatch):
    for name, value in (("FEW_ROWS", 8), ("RANK_SPLIT_MAX_ROWS", 64), ("UNSPLIT_MAX_RANK", 16)):
        monkeypatch.setattr(lora_gather, name, value)
    buckets = graph_buckets(256)
    keys = captured_keys(buckets)
    assert len(keys) == len(set(keys)) == 2 * len(buckets) + 3  # 16, 32 and 64 rows: two variants each
    for rows in buckets:
        lora_keys = {k for k in keys if k[0] == rows and k[1]}
        assert len(lora_keys) == (2 if rows in (16, 32, 64) else 1)
        assert {k for k in keys if k[0] == rows and not k[1]} == {(rows, False, False, None)}
        for max_rank in range(0, 129):  # any mix of loaded ranks: its step's key was captured
            assert graph_key(rows, True, False, max_rank) in lora_keys
            assert graph_key(rows, False, False, max_rank) == (rows, False, False, None)
    assert graph_key(64, True, False, 16) == (64, True, False, 16) and graph_key(64, True, False, 17)[3] is None
    assert graph_key(64, True, True, 8) == (64, True, True, 16)  # DoRA graphs (captured on first use) too
    monkeypatch.setattr(lora_gather, "UNSPLIT_MAX_RANK", None)  # the variant off: the keys of before
    assert captured_keys(buckets) == [(rows, lora, False, None) for lora in (True, False)
                                      for rows in sorted(buckets, reverse=True)]
