"""scripts/bench_tenants.py ``--old attention-items`` on CPU (tiny shape, fp32): the old runs take
the decode attention's per-row splits, the new ones the balanced work items, and the mode is set
back after the runs."""

from _script_loader import load_script


def test_old_attention_items_switches_the_split_mode(tmp_path, monkeypatch):
    from lightning_lorafusion.kernels import paged_attention

    bench = load_script("bench_tenants")
    seen = []
    real = bench.TenantsBench.phase

    def phase(self, run, arrivals, trace):
        seen.append((run, paged_attention.DECODE_SPLITS))
        return real(self, run, arrivals, trace)

    monkeypatch.setattr(bench.TenantsBench, "phase", phase)
    mode = paged_attention.DECODE_SPLITS
    report = bench.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--requests", "4",
                         "--adapters", "2", "--ranks", "4", "--prompt-median", "8", "--prompt-max", "16",
                         "--output-median", "2", "--output-max", "3", "--arrivals", "burst", "--warm-up", "off",
                         "--runs", "base", "--variants", "new,old", "--old", "attention-items",
                         "--phase-max-s", "3600", "--out", str(tmp_path)])
    assert report["errors"] == {}
    assert seen == [("base-new", mode), ("base-old", "per-row")]
    assert paged_attention.DECODE_SPLITS == mode  # set back after the runs
    runs = {r["run"]: r for r in report["runs"]}
    assert runs["base-new"]["generated_tokens"] == runs["base-old"]["generated_tokens"]
