"""scripts/profile_steps.py: a profiler trace cut into engine-step windows at the marker kernels,
and each step kind's device span, kernel-busy time and costliest kernels."""

import pytest

from _script_loader import load_script


def kernel(name, ts, dur, stream=7, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_union_counts_overlaps_once():
    script = load_script("profile_steps")
    assert script.union_us([(0, 10), (5, 12), (20, 25), (24, 30), (40, 41)]) == 12 + 10 + 1
    assert script.union_us([]) == 0


def test_windows_and_summary_split_busy_from_idle():
    script = load_script("profile_steps")
    m = script.MARKER
    events = [
        kernel("before_any_marker", 0, 5),
        kernel(m, 10, 1),
        kernel("gemm", 12, 20), kernel("lora_shrink", 40, 10),  # step 0: span 12..50 = 38, busy 30
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 15, "dur": 3},  # host events are ignored
        kernel(m, 60, 1),
        kernel("gemm", 62, 20), kernel("copy", 70, 4, stream=9, cat="gpu_memcpy"),  # step 1: span 62..82, busy 20
        kernel(f"at::cuda::(anonymous namespace)::{m}(long)", 100, 1),  # a call that launched nothing
        kernel(m, 200, 1),
        kernel("gemm", 201, 10), kernel("attn", 211, 5),  # step 3: span 15, busy 15
        kernel(m, 300, 1),  # the closing marker
        kernel("after_the_profiled_steps", 301, 50),
    ]
    windows = script.call_windows(events)
    assert [[e["name"] for e in w] for w in windows] == [["gemm", "lora_shrink"], ["gemm", "copy"], [], ["gemm", "attn"]]
    rows = script.summarize(windows, ["mixed t8192 lora graph", "decode b8 lora graph", None,
                                      "decode b8 lora graph"])
    by = {r["kind"]: r for r in rows}
    mixed, dec = by["mixed t8192 lora graph"], by["decode b8 lora graph"]
    assert mixed["steps"] == 1 and mixed["span_ms"] == pytest.approx(0.038) and mixed["busy_ms"] == pytest.approx(0.030)
    assert mixed["idle_ms"] == pytest.approx(0.008) and mixed["busy_fraction"] == pytest.approx(30 / 38)
    assert [t["name"] for t in mixed["top"]] == ["gemm", "lora_shrink"]
    assert dec["steps"] == 2 and dec["span_ms"] == pytest.approx(0.020 + 0.015)
    assert dec["busy_ms"] == pytest.approx(0.020 + 0.015)
    gemm = next(t for t in dec["top"] if t["name"] == "gemm")
    assert gemm["per_step"] == 1 and gemm["ms_per_step"] == pytest.approx(0.015)
    assert rows[0]["kind"] == "mixed t8192 lora graph"  # the kind with the most device time first
    text = script.table(rows)
    assert "mixed t8192 lora graph" in text and "79%" in text


def test_no_marker_no_windows():
    script = load_script("profile_steps")
    assert script.call_windows([kernel("gemm", 0, 5)]) == []
    assert script.call_windows([kernel(script.MARKER, 0, 1), kernel("gemm", 2, 5)]) == []  # never closed


def test_idle_gaps_name_their_neighbours():
    script = load_script("profile_steps")
    events = [kernel("a", 0, 10), kernel("copy", 5, 30, stream=9), kernel("b", 100, 5), kernel("c", 110, 5)]
    assert script.idle_gaps(events) == [("copy", "b", 65.0)]  # 105 -> 110 is under the 20 us floor
    rows = script.summarize([events], ["mixed t512 lora graph"])
    assert rows[0]["idle_gaps"] == [{"after": "copy", "before": "b", "per_step": 1.0, "ms_per_step": 0.065}]


def test_compute_only_leaves_copies_out():
    """A step whose kernels wait for a page-in copy: the copy is busy time, not compute, and
    the first kernel starts after it."""
    script = load_script("profile_steps")
    events = [kernel(script.MARKER, 0, 1), kernel("page-in", 10, 30, stream=13, cat="gpu_memcpy"),
              kernel("gemm", 40, 20), kernel("copy", 45, 5, stream=13, cat="gpu_memcpy"), kernel(script.MARKER, 100, 1)]
    (row,) = script.summarize(script.call_windows(events), ["mixed t512 lora graph"])
    assert row["busy_ms"] == pytest.approx(0.050) and row["compute_ms"] == pytest.approx(0.020)
    assert row["lead_ms_per_step"] == pytest.approx(0.030)
    assert "| 0.02 | 0.03 |" in script.table([row])


def test_categories_name_each_layer_product_and_the_lm_head():
    """Kernels by category: a layer's four frozen products by their order (a split-K reduce
    joins its GEMM), the LM head after the last norm, attention, epilogues, sampling, copies;
    the per-kind table sets each kind's floor and GPU ms beside them."""
    script = load_script("profile_steps")
    layer = ["_add_rms_norm_kernel", "nvjet_tst_64x8_qkv", "_rope_kv_kernel", "_paged_decode_kernel",
             "_combine_splits_kernel", "nvjet_tst_64x8_o", "_add_rms_norm_kernel", "nvjet_tst_128x8_gu",
             "_swiglu_kernel", "sm90_xmma_gemm_down", "splitKreduce_kernel"]
    events, t = [kernel("indexSelectLargeIndex", 0, 1)], 2
    for _ in range(2):
        for name in layer:
            events.append(kernel(name, t, 3))
            t += 4
    for name in ("_add_rms_norm_kernel", "nvjet_lm_head", "elementwise_kernel", "reduce_kernel<ArgMaxOps>"):
        events.append(kernel(name, t, 5))
        t += 6
    events.append(kernel("Memcpy DtoH", t, 2, cat="gpu_memcpy"))
    cats = script.label_products(events)
    assert cats[2] == "gemm qkv" and cats[6] == "gemm o" and cats[8] == "gemm gate_up"
    assert cats[10] == cats[11] == "gemm down"  # the reduce with its GEMM
    assert cats[4] == cats[5] == "attention decode" and cats[3] == cats[9] == "rope / swiglu"
    assert script.kernel_category(kernel("_combine_items_kernel", 0, 1)) == "attention decode"  # balanced items
    assert cats[-5:] == ["norm", "lm head", "elementwise", "sampling", "copies"]
    rows = script.summarize([events], ["decode b2 base graph"])
    by = rows[0]["categories"]
    assert by["gemm down"]["per_step"] == 4 and by["gemm down"]["ms_per_step"] == pytest.approx(12 / 1e3)
    assert by["lm head"]["ms_per_step"] == pytest.approx(5 / 1e3)
    text = script.category_table(rows, [{"kind": "decode b2 base graph", "steps": 1, "tokens": 2, "floor_s": 0.005,
                                         "gpu_s": 0.006}])
    assert "| decode b2 base graph | 1 | 2 | 5.00 | 6.00 |" in text and "lm head" in text.splitlines()[0]
    # products that are not 4 per layer stay unnamed
    odd = [kernel("_add_rms_norm_kernel", 0, 1), kernel("gemm_a", 2, 1), kernel("_add_rms_norm_kernel", 4, 1),
           kernel("gemm_b", 6, 1)]
    assert script.label_products(odd) == ["norm", "gemm", "norm", "lm head"]


def test_lora_traffic_counts_each_adapter_once_and_per_row_or_group_fetches():
    from types import SimpleNamespace

    from lightning_lorafusion.serving.floor import LedgerAdapter, StepRecord

    script = load_script("profile_steps")
    shape = SimpleNamespace(num_layers=2, module_dims={"q_proj": (8, 4), "down_proj": (16, 8)})
    ledger = SimpleNamespace(adapter_elem_bytes=2, adapters={
        1: LedgerAdapter("a", (("q_proj", 4),)), 2: LedgerAdapter("b", (("q_proj", 2), ("down_proj", 2)))})
    # adapter 1: A = 2 layers * 2 B * 4 * 8 = 128 B, Bt = 2 * 2 * 4 * 4 = 64 B;
    # adapter 2: A = 2 * 2 * (2 * 8 + 2 * 16) = 192 B, Bt = 2 * 2 * (2 * 4 + 2 * 8) = 96 B
    decode = StepRecord(prefill=(), decode_rows=20, decode_kv_tokens=0, sampled_rows=20,
                        adapters=((1, 17), (2, 3)), decode_adapters=((1, 17), (2, 3)))
    mixed = StepRecord(prefill=((70, 0),), decode_rows=3, decode_kv_tokens=0, sampled_rows=4,
                       adapters=((1, 3), (2, 70)), decode_adapters=((1, 3),))
    kinds = ["decode b32 lora graph", "mixed t512 lora graph", None]
    out = script.lora_traffic(kinds, [decode, mixed, None], ledger, shape, max_rows=16, grouped_min_rows=16,
                              group_rows=16, block_m=64)
    d, m = out["decode b32 lora graph"], out["mixed t512 lora graph"]
    assert d["steps"] == 1 and d["adapters"] == 2 and d["decode_rows"] == 20 and d["prefill_tokens"] == 0
    assert d["a_must"] == 128 + 192 and d["b_must"] == 64 + 96
    # 32 rows >= 16: grouped shrink, 17 rows of adapter 1 in two groups, adapter 2's 3 in one
    assert d["a_decode"] == 2 * 128 + 1 * 192 and d["b_decode"] == 17 * 64 + 3 * 96
    # the mixed step's gather covers min(16, 512) = 16 rows: grouped; adapter 2's 70 prefill rows: 2 tiles
    assert m["prefill_tokens"] == 70 and m["a_decode"] == 128 and m["b_decode"] == 3 * 64
    assert m["a_prefill"] == 2 * 192 and m["b_prefill"] == 2 * 96
    per_row = script.lora_traffic(kinds[:1], [decode], ledger, shape, max_rows=16, grouped_min_rows=64,
                                  group_rows=16, block_m=64)
    assert per_row["decode b32 lora graph"]["a_decode"] == 17 * 128 + 3 * 192


def test_lora_kernel_table_sets_each_kernel_beside_the_base_alone():
    script = load_script("profile_steps")
    lora = [{"kind": "decode b8 lora graph", "steps": 3, "span_ms_per_step": 9.0, "all_kernels": {
        "_lora_shrink_kernel": {"per_step": 128, "ms_per_step": 1.0},
        "_swiglu_kernel": {"per_step": 32, "ms_per_step": 0.5}, "gemm_x": {"per_step": 4, "ms_per_step": 2.0},
        "gemm_y": {"per_step": 4, "ms_per_step": 0.3}}}]
    base = [{"kind": "decode b8 base graph", "steps": 3, "span_ms_per_step": 7.0, "all_kernels": {
        "_swiglu_kernel": {"per_step": 32, "ms_per_step": 0.2}, "gemm_x": {"per_step": 4, "ms_per_step": 2.0},
        "gemm_y": {"per_step": 4, "ms_per_step": 0.25}}}]
    traffic = {"decode b8 lora graph": {"steps": 3, "adapters": 4.0, "decode_rows": 6.0, "prefill_tokens": 0.0,
                                        "a_must": 2e6, "b_must": 1e6, "a_decode": 3e6, "b_decode": 2e6,
                                        "a_prefill": 0.0, "b_prefill": 0.0}}
    text = script.lora_kernel_table(lora, base, traffic, bandwidth=3e12)
    lines = text.splitlines()
    assert "+2.00" in lines[0] and "these kernels add 1.35" in lines[0]
    assert "must move A 2 + Bt 1 MB, 0.00 ms" in lines[1] and "decode shrink A 3" in lines[1]
    shrink = next(ln for ln in lines if "_lora_shrink_kernel" in ln)
    assert shrink.split()[-4:] == ["128", "1.000", "0.000", "+1.000"]
    assert any("_swiglu_kernel" in ln and ln.endswith("+0.300") for ln in lines)
    assert any("gemm_y" in ln for ln in lines) and not any("gemm_x" in ln for ln in lines)  # +0.05 shown, 0 not


def test_part_table_sums_categories_against_each_part_floor():
    """The parts the floor prices on their own: a kind's products summed over its four named
    products, norms and epilogues as elementwise, each beside its floor and the share reached."""
    script = load_script("profile_steps")
    events = [kernel("_add_rms_norm_kernel", 0, 1000), kernel("nvjet_qkv", 1000, 2000),
              kernel("_rope_kv_rows_kernel", 3000, 500), kernel("_paged_prefill_kernel", 3500, 1500),
              kernel("nvjet_o", 5000, 1000), kernel("_add_rms_norm_kernel", 6000, 500),
              kernel("nvjet_gu", 6500, 4000), kernel("_swiglu_kernel", 10500, 500), kernel("nvjet_down", 11000, 2000),
              kernel("Memcpy DtoD", 13000, 300, cat="gpu_memcpy"), kernel("_add_rms_norm_kernel", 14000, 500)]
    rows = script.summarize([events], ["mixed t512 base graph"])
    parts = {"products": 0.0045, "lm_head": 0.0, "attention_decode": 0.0, "attention_prefill": 0.0003,
             "elementwise": 0.0015, "lora": 0.0}
    text = script.part_table(rows, [{"kind": "mixed t512 base graph", "steps": 1, "tokens": 400, "floor_s": 0.006,
                                     "gpu_s": 0.016, "part_floor_s": parts}])
    line = text.splitlines()[2]
    # products 2 + 1 + 4 + 2 ms against 4.5; prefill attention 1.5 against 0.3; norms and
    # epilogues 1 + 0.5 + 0.5 + 0.5 + 0.5 against 1.5; one copy; idle 13.3 to 14 ms in the span
    assert line.startswith("| mixed t512 base graph | 1 | 400 | 16.00 | 6.00 | 9.00 (4.50, 50%) | - | - | "
                           "1.50 (0.30, 20%) | 3.00 (1.50, 50%) | - | 0.30 |")
    assert line.endswith("| 0.70 |")


def test_ceiling_keeps_products_as_measured_and_every_other_part_at_its_floor():
    """A run's ceiling: per kind, the products and LM head as profiled plus the other parts'
    floors, weighted by the kind's steps in the whole run; a kind without a profile is left out."""
    script = load_script("profile_steps")
    decode = [kernel("nvjet_qkv", 0, 2000), kernel("_paged_decode_kernel", 2000, 3000), kernel("nvjet_o", 5000, 1000),
              kernel("nvjet_gu", 6000, 3000), kernel("_swiglu_kernel", 9000, 500), kernel("nvjet_down", 9500, 2000),
              kernel("nvjet_lm", 11500, 500)]
    rows = script.summarize([decode], ["decode b64 base graph"])
    parts = {"products": 0.006, "lm_head": 0.0004, "attention_decode": 0.001, "attention_prefill": 0.0,
             "elementwise": 0.0002, "lora": 0.0005}
    kinds = [{"kind": "decode b64 base graph", "steps": 4, "tokens": 256, "floor_s": 0.028, "gpu_s": 0.048,
              "part_floor_s": {p: 4 * v for p, v in parts.items()}},
             {"kind": "mixed t512 base graph", "steps": 1, "tokens": 400, "floor_s": 0.006, "gpu_s": 0.016,
              "part_floor_s": parts},
             {"kind": "all", "steps": 5, "floor_s": 0.034, "gpu_s": 0.064}]
    c = script.ceiling(rows, kinds)
    (row,) = c["kinds"]
    products = 2.0 + 1.0 + 3.0 + 2.0 + 0.5  # the layer's four products and the LM head as profiled, ms per step
    assert row["products_ms"] == pytest.approx(products)
    assert row["others_floor_ms"] == pytest.approx(1.0 + 0.2 + 0.5)  # attention, elementwise, adapters at floor
    assert c["ceiling_s"] == pytest.approx(4 * (products + 1.7) / 1e3)
    assert c["floor_s"] == pytest.approx(0.028) and c["left_out_s"] == pytest.approx(0.006)
    assert c["fraction_max"] == pytest.approx(0.028 / c["ceiling_s"])
    assert c["fraction_now"] == pytest.approx(0.028 / 0.048)
    text = script.ceiling_table(c).splitlines()
    assert text[2].startswith("| decode b64 base graph | 4 | 7.00 | 12.00 (58%) |")
    assert text[-1].startswith("| run | 4 | 28 | 48 (58.3%) |")


def test_prefill_lora_kernels_count_as_lora_and_kept_steps_load_back(tmp_path):
    """The prefill LoRA's split-K shrink and live expand are the adapters' kernels; a profile's
    kept steps load back into windows that summarize as the profile did."""
    import gzip
    import json

    script = load_script("profile_steps")
    for name in ("_splitk_shrink_kernel", "_live_expand_kernel", "_tile_expand_kernel", "_lora_grouped_shrink_kernel"):
        assert script.kernel_category({"cat": "kernel", "name": name}) == "lora"
    assert script.kernel_category({"cat": "kernel", "name": "nvjet_sm90_tst_192x192"}) == "gemm"
    events = [kernel("nvjet_qkv", 0, 2000), kernel("_splitk_shrink_kernel", 2000, 300),
              kernel("Memcpy HtoD (Pinned -> Device)", 2300, 400, stream=9, cat="gpu_memcpy"),
              kernel("_live_expand_kernel", 2700, 500)]
    path = tmp_path / "steps.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump([{"kind": "mixed t512 lora graph", "events": [
            {"name": e["name"], "ts": e["ts"], "dur": e["dur"], "stream": e["args"]["stream"]} for e in events]}], f)
    windows, kinds = script.load_steps(str(path))
    assert kinds == ["mixed t512 lora graph"]
    again, first = script.summarize(windows, kinds), script.summarize([events], kinds)
    assert again[0]["categories"] == first[0]["categories"]
    assert again[0]["categories"]["lora"]["ms_per_step"] == pytest.approx(0.8)
    assert again[0]["categories"]["copies"]["ms_per_step"] == pytest.approx(0.4)
