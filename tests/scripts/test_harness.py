"""scripts/harness.py: the pieces every benchmark shares."""

import argparse
import json
import math

import pytest
from _script_loader import load_script

harness = load_script("harness")


def test_timer_and_timed_ms_measure_on_the_cpu():
    with harness.timer("cpu") as t:
        sum(range(1000))
    assert math.isfinite(t.seconds) and t.seconds >= 0
    calls = []
    out = harness.timed_ms(lambda: calls.append(1), "cpu", warmup=2, reps=3)
    assert len(calls) == 5 and out["reps"] == 3 and 0 <= out["min_ms"] <= out["median_ms"]


def test_percentile_is_nearest_rank():
    assert harness.percentile([], 50) is None
    assert harness.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert harness.percentile(list(range(1, 101)), 99) == 99 and harness.percentile([5.0], 99) == 5.0


def test_comma_list_checks_every_value():
    parse = harness.comma_list(("on", "off"))
    assert parse("on,off") == ["on", "off"]
    with pytest.raises(argparse.ArgumentTypeError, match="'on,maybe': a comma list of on, off"):
        parse("on,maybe")
    assert harness.comma_list(cast=int)("1,16") == [1, 16]


def test_dtype_of_names_the_flag():
    assert harness.dtype_of("float32") is harness.torch.float32
    with pytest.raises(SystemExit, match="--dtype 'fp99' is not a torch dtype"):
        harness.dtype_of("fp99")


def test_report_records_results_and_errors_and_saves_each_time(tmp_path):
    report = harness.Report("cpu", argparse.Namespace(shape="tiny"), out=str(tmp_path), file_name="r.json",
                            log=lambda msg: None, slim=lambda r: {k: v for k, v in r.items() if k != "big"})
    assert report.measure("ok", lambda: {"tokens": 3}) == {"tokens": 3}
    assert report.measure("broken", lambda: 1 / 0) is None
    report.measure("big", lambda: [0] * 10)
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["ok"] == {"tokens": 3} and saved["errors"] == {"broken": "ZeroDivisionError: division by zero"}
    assert "big" not in saved and "big" in report
    assert saved["device_name"] == "cpu" and saved["args"] == {"shape": "tiny"} and saved["torch"]


def test_write_json_without_a_directory_writes_nothing(tmp_path):
    assert harness.write_json(None, "x.json", {}) is None
    path = harness.write_json(tmp_path / "sub", "x.json", {"a": float("nan"), "b": {1, 2}})
    assert path.exists() and json.loads(path.read_text().replace("NaN", "null"))["a"] is None
