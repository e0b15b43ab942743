"""scripts/bench_decode_step.py on the CPU: a tiny engine per variant, every variant's tokens
equal the decode LoRA's of before, the knobs put back."""

from _script_loader import load_script


def test_bench_decode_step_tiny_cpu(tmp_path):
    script = load_script("bench_decode_step")
    from lightning_lorafusion.kernels import lora_gather

    before = (lora_gather.FEW_ROWS, lora_gather.AHEAD_MAX_ROWS)
    report = script.main(["--device", "cpu", "--dtype", "float32", "--shape", "tiny", "--layers", "1",
                          "--adapters", "2", "--rows", "1,2", "--steps", "1",
                          "--variants", "base,lora,lora_old,lora_ahead", "--out", str(tmp_path)])
    assert (lora_gather.FEW_ROWS, lora_gather.AHEAD_MAX_ROWS) == before
    assert {(r["variant"], r["rows"]) for r in report["rows"]} == {
        (v, n) for v in ("base", "lora", "lora_old", "lora_ahead") for n in (1, 2)}
    assert all(r["step_ms"] > 0 for r in report["rows"])
    for variant in ("lora", "lora_ahead"):
        same, total = map(int, report["same_tokens_as_lora_old"][variant].split(",")[0].split("/"))
        assert total > 0 and same == total
    assert (tmp_path / "bench_decode_step.json").exists()
