"""scripts/tune_kernels.py on CPU (Triton interpreter, one tiny shape, the timer replaced by a
fixed cost per candidate): the search runs every stage through the public
``fused_lora_projections``, returns valid block sizes that keep the winners' fields, and the
table keeps other devices' entries."""

import json

from _script_loader import load_script


def test_tune_picks_the_cheapest_candidate_per_stage(tmp_path, monkeypatch):
    module = load_script("tune_kernels")
    monkeypatch.setattr(module, "SHAPES", [(48, 32, 40)])
    monkeypatch.setattr(module, "FWD_CANDIDATES", [(32, 32, 32, 4, 2), (64, 32, 32, 4, 2)])
    monkeypatch.setattr(module, "DX_CANDIDATES", [(32, 32, 32, 4, 2), (64, 32, 16, 4, 2), (32, 16, 16, 4, 2)])
    monkeypatch.setattr(module, "SKINNY_CANDIDATES", module.SKINNY_CANDIDATES[:2])
    monkeypatch.setattr(module, "ADD_CANDIDATES", module.ADD_CANDIDATES[:2])
    cost = {"calls": 0}

    def fake_ms(fn, graph=False):  # runs the real kernels once; the last candidate of each stage "wins"
        fn()
        cost["calls"] += 1
        return 1000.0 - cost["calls"]

    monkeypatch.setattr(module, "kernel_ms", fake_ms)
    sizes = module.tune("cpu", log=lambda msg: None)
    assert (sizes.block_m, sizes.fwd_block_n, sizes.fwd_block_k) == (64, 32, 32)  # the later fwd candidate
    assert (sizes.dx_block_k, sizes.dx_block_n) == (32, 16)  # the only dX candidate with block_m 64
    assert sizes.skinny_block_k == module.SKINNY_CANDIDATES[1]["skinny_block_k"]
    assert sizes.add_n_blocks == module.ADD_CANDIDATES[1]["add_n_blocks"]
    assert sizes.gemm == module.GEMM_MODES[-1]
    assert cost["calls"] == 2 + 1 + 2 + 2 + len(module.GEMM_MODES)

    table = tmp_path / "block_sizes.json"
    table.write_text(json.dumps({"devices": {"Other GPU": {"block_m": 64}}}))
    module.write_table("Test GPU", sizes, table)
    saved = json.loads(table.read_text())["devices"]
    assert saved["Other GPU"] == {"block_m": 64} and saved["Test GPU"]["block_m"] == 64
