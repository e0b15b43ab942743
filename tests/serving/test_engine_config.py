"""EngineConfig holds what a user sets; the execution modes nest in ``tuning`` (EngineTuning), and
a mode passed where it used to be (a keyword, a YAML key, a command-line flag) names its new place."""

from __future__ import annotations

import pytest

from lightning_lorafusion.serving import EngineConfig
from lightning_lorafusion.serving.config import MOVED_TO_TUNING, EngineTuning
from lightning_lorafusion.specs import ConfigError


def test_moved_keys_name_their_new_place():
    assert set(MOVED_TO_TUNING) == {"decode_backend", "prefill_attention", "mixed_graphs", "async_decode", "nf4_gemm"}
    for name in MOVED_TO_TUNING:
        with pytest.raises(ConfigError, match=rf"EngineConfig\.{name} moved to EngineConfig\.tuning\.{name}") as e:
            EngineConfig(**{name: "auto"})
        assert "\n" not in str(e.value)


def test_tuning_nests_and_is_checked():
    assert EngineConfig().tuning == EngineTuning()
    assert EngineConfig(tuning={"mixed_graphs": "eager"}).tuning == EngineTuning(mixed_graphs="eager")
    with pytest.raises(ConfigError, match="EngineConfig.tuning must be an EngineTuning"):
        EngineConfig(tuning="eager")
    with pytest.raises(ConfigError, match="EngineTuning.decode_backend='cuda'"):
        EngineTuning(decode_backend="cuda")


def test_serve_yaml_and_flags_nest_tuning(tmp_path):
    from lightning_lorafusion.serving.serve_cli import build_parser, parse_args

    new = tmp_path / "new.yaml"
    new.write_text("base_model: x\nengine:\n  page_size: 8\n  tuning:\n    mixed_graphs: eager\n")
    parser = build_parser()
    engine = parser.instantiate(parse_args(parser, ["--config", str(new)])).engine
    assert engine.page_size == 8 and engine.tuning == EngineTuning(mixed_graphs="eager")
    parser = build_parser()
    engine = parser.instantiate(parse_args(parser, ["--base_model", "x", "--engine.tuning.async_decode", "off"])).engine
    assert engine.tuning.async_decode == "off"

    old = tmp_path / "old.yaml"
    old.write_text("base_model: x\nengine:\n  page_size: 8\n  mixed_graphs: eager\n")
    with pytest.raises(ConfigError, match=r"EngineConfig\.mixed_graphs moved to EngineConfig\.tuning\.mixed_graphs"):
        parse_args(build_parser(), ["--config", str(old)])
    with pytest.raises(ConfigError, match=r"--engine\.tuning\.async_decode"):
        parse_args(build_parser(), ["--base_model", "x", "--engine.async_decode", "on"])
    with pytest.raises(SystemExit):  # any other error: as before, usage and exit 2
        parse_args(build_parser(), ["--base_model", "x", "--bogus", "1"])
