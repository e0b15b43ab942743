"""scripts/profile_decode_lora.py: its trace reading (kernels mapped to the layer's pieces, per-layer
means) on a hand-made trace, and a tiny CPU run (interpreter, fp32) whose LoRA paths agree."""

import json

from _script_loader import load_script


def _trace(tmp_path):
    def ev(cat, name, ts, dur, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}

    events = [ev("user_annotation", "piece:qkv", 0, 10), ev("user_annotation", "piece:o", 20, 10),
              ev("cuda_driver", "cuLaunchKernel", 2, 1, correlation=1),
              ev("cuda_driver", "cuLaunchKernel", 5, 1, correlation=2),
              ev("cuda_runtime", "cudaLaunchKernel", 22, 1, correlation=3),
              ev("kernel", "_lora_shrink_kernel", 100, 6, correlation=1, grid=[64, 8, 3], block=[128, 1, 1],
                 **{"est. achieved occupancy %": 50}),
              ev("kernel", "_rope_kv_kernel", 107, 4, correlation=2, grid=[64, 48, 1], block=[128, 1, 1]),
              ev("kernel", "_lora_shrink_kernel", 112, 2, correlation=3, grid=[64, 8, 1], block=[128, 1, 1]),
              # no launch record: placed by the GPU-side range
              ev("gpu_user_annotation", "piece:o", 111, 9),
              ev("kernel", "_lora_expand_kernel", 115, 4, correlation=99, grid=[64, 16, 1], block=[128, 1, 1])]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events * 1}))
    return str(path)


def test_parse_trace_maps_kernels_to_pieces_and_averages_per_layer(tmp_path):
    script = load_script("profile_decode_lora")
    got = {(k["piece"], k["kernel"]): k for k in script.parse_trace(_trace(tmp_path), reps=1, layers=2)}
    assert set(got) == {("qkv", "_lora_shrink_kernel"), ("qkv", "_rope_kv_kernel"), ("o", "_lora_shrink_kernel"),
                        ("o", "_lora_expand_kernel")}
    shrink = got[("qkv", "_lora_shrink_kernel")]
    assert shrink["us"] == 3.0 and shrink["launches"] == 0.5 and shrink["grid"] == [64, 8, 3]
    assert shrink["occupancy_pct"] == 50 and got[("o", "_lora_expand_kernel")]["us"] == 2.0
    pieces = {"o": {"a": 10, "b": 20, "a_rows": 40, "b_rows": 80, "x": 1, "y": 2}}
    assert script.kernel_bytes(got[("o", "_lora_shrink_kernel")], pieces, True) == (11, 41)
    assert script.kernel_bytes(got[("o", "_lora_expand_kernel")], pieces, True) == (24, 84)
    assert script.kernel_bytes(got[("o", "_lora_expand_kernel")], pieces, False) == (4, 4)


def test_profile_decode_lora_tiny_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    script = load_script("profile_decode_lora")
    from lightning_lorafusion.kernels import lora_gather

    before = {name: getattr(lora_gather, name) for name in script.SETTINGS}
    report = script.main(["--device", "cpu", "--dtype", "float32", "--tiny", "--cases", "16x3,6x6c",
                          "--rank-sets", "4,8", "--modes", "base,per_row,grouped_hybrid", "--layers", "1",
                          "--out", str(tmp_path)])
    assert {name: getattr(lora_gather, name) for name in script.SETTINGS} == before
    drawn, cycled = report["rows"]
    for row in (drawn, cycled):
        assert [m["mode"] for m in row["modes"]] == ["base", "per_row", "grouped_hybrid"]
        assert row["modes"][1]["max_rel_diff"] == 0.0  # the reference path itself
        assert row["modes"][2]["max_rel_diff"] < 1e-5
        assert row["adapter_bytes"] > 0
    assert drawn["distinct"] <= 3 and not drawn["cycled"]
    assert cycled["distinct"] == 6 and cycled["cycled"]  # every adapter in the batch
    saved = json.loads((tmp_path / "profile_decode_lora.json").read_text())
    assert len(saved["rows"]) == 2
    assert "6 x 6c (4,8)" in (tmp_path / "profile_decode_lora.md").read_text()


def test_count_nodes_reads_a_graph_dump():
    script = load_script("profile_decode_lora")
    dot = "\n".join([
        'digraph dot {', 'subgraph cluster_1 {', 'label="graph_1" graph[style="dashed"];',
        '"graph_1_node_0"[style="solid" shape="rectangle" label="0\\nKERNEL\\n_lora_shrink_kernel"];',
        '"graph_1_node_1"[style="solid" shape="rectangle" label="1\\nMEMSET\\n"];',
        '"graph_1_node_2"[style="solid" shape="rectangle" label="2\\nKERNEL\\n_rope_kv_kernel"];',
        '"graph_1_node_3"[style="solid" shape="record" label="{', 'MEMCPY', '| {ID | 3}}"];',
        '"graph_1_node_4"[style="solid" label="4"];',
        '"graph_1_node_0" -> "graph_1_node_1";', '"graph_1_node_1" -> "graph_1_node_2";', '}', '}'])
    assert script.count_nodes(dot) == {"KERNEL": 2, "MEMSET": 1, "MEMCPY": 1, "other": 1}


def test_profile_decode_lora_few_rows_modes_tiny_cpu(tmp_path, monkeypatch):
    """The modes of the few-rows blocks, the blocks before them and SwiGLU computing down's
    shrink agree with the per-row path on a row alone and 4 rows on their own adapters."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    script = load_script("profile_decode_lora")
    report = script.main(["--device", "cpu", "--dtype", "float32", "--tiny", "--cases", "1x1,4x4c",
                          "--rank-sets", "64,4,32,8", "--modes", "per_row,old,engine,ahead,few_r32,bound32", "--layers", "1",
                          "--out", str(tmp_path)])
    for row in report["rows"]:
        diffs = {m["mode"]: m["max_rel_diff"] for m in row["modes"]}
        assert diffs["per_row"] == 0.0 and max(diffs.values()) < 1e-5, diffs


def test_best_mode_takes_the_least_total_time_of_modes_run_everywhere():
    """``--best-knobs``' pick: the least captured-layer time summed over the cases, not "base",
    not a mode that failed, differs from the per-row outputs or is missing from a case."""
    script = load_script("profile_decode_lora")

    def m(mode, us, diff=0.0, **kw):
        return {"mode": mode, "graph_us": us, "max_rel_diff": diff, **kw}

    rows = [{"modes": [m("base", 1.0), m("engine", 10.0), m("gs_r64", 8.0), m("gs_r32", 5.0, diff=0.5),
                       m("gsplit4", 7.0), m("ew8", 1.0)]},
            {"modes": [m("base", 1.0), m("engine", 10.0), m("gs_r64", 9.0), m("gs_r32", 5.0, diff=0.5),
                       m("gsplit4", 11.0), {"mode": "g128", "error": "boom"}]}]
    assert script.best_mode(rows) == "gs_r64"  # 17 against engine's 20 and gsplit4's 18; ew8 not in case 2
    rows[1]["modes"][2]["graph_us"] = 12.0
    assert script.best_mode(rows) == "gsplit4"
    assert script.best_mode([{"modes": [m("base", 1.0)]}]) is None
