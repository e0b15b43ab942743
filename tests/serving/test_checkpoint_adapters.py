"""Adapters served straight from a training checkpoint equal the PEFT directories exported from it."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from lightning_lorafusion.model.adapter_bank import AdapterBank
from lightning_lorafusion.model.hf_loading import load_base_model
from lightning_lorafusion.model.peft_io import export_peft_adapter
from lightning_lorafusion.serving import Engine, EngineConfig, GenerationRequest, SamplingParams
from lightning_lorafusion.serving.generate_cli import run
from lightning_lorafusion.specs import AdapterSpec, ConfigError

SPECS = [AdapterSpec(name="x", rank=4, alpha=8.0, dataset={"kind": "synthetic"}),
         AdapterSpec(name="y", rank=2, alpha=2.0, target_modules=("q_proj", "v_proj", "down_proj"),
                     dataset={"kind": "synthetic"})]
SP = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 17, 30], [11, 4, 30, 22, 8, 19, 40]]


def _randomize(bank: AdapterBank, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in bank.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.fixture
def run_dir(model_dir, tmp_path):
    """A checkpoint in ``fit``'s format (bank state keys, specs in hyper_parameters, best-val
    weights of adapter x in ``lorafusion``) and what ``export_adapters`` writes from it."""
    config = load_base_model(str(model_dir), dtype=torch.float32)[0]
    bank = AdapterBank(SPECS, config, dtype=torch.float32)
    _randomize(bank, 1)
    best_x = {n: p.detach().clone() for n, p in bank.named_parameters() if n.startswith("adapters.0.")}
    export_peft_adapter(bank, 0, tmp_path / "adapters" / "x")  # x was validated: its best weights
    _randomize(bank, 2)  # the weights at the checkpoint (after the best validation, for x)
    export_peft_adapter(bank, 0, tmp_path / "adapters" / "x" / "last")
    export_peft_adapter(bank, 1, tmp_path / "adapters" / "y")
    ckpt = {"state_dict": {f"bank.{k}": v for k, v in bank.state_dict().items()},
            "hyper_parameters": {"base_model": str(model_dir), "adapters": [
                {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(s).items()}
                for s in SPECS]},
            "lorafusion": {"adapter_names": ["x", "y"], "best_weights": {0: best_x}}}
    torch.save(ckpt, tmp_path / "run.ckpt")
    return tmp_path


def _generate(engine, cases):
    reqs = [GenerationRequest(prompt_token_ids=p, adapter=a, sampling=SP) for p, a in cases]
    return [r.token_ids for r in engine.generate(reqs)]


def test_checkpoint_adapters_equal_exported_peft_dirs(make_engine, run_dir):
    cases = [(p, a) for p in PROMPTS for a in ("x", "y", None)]
    peft = make_engine(False, num_pages=96, page_size=4)
    peft.add_adapter("x", str(run_dir / "adapters" / "x"))
    peft.add_adapter("y", str(run_dir / "adapters" / "y"))
    from_ckpt = make_engine(False, num_pages=96, page_size=4)
    infos = from_ckpt.add_adapters_from_checkpoint(str(run_dir / "run.ckpt"))
    assert [(i.name, i.rank, i.alpha) for i in infos] == [("x", 4, 8.0), ("y", 2, 2.0)]
    assert _generate(from_ckpt, cases) == _generate(peft, cases)
    # weights="last": the bank's weights at the checkpoint, i.e. x/last
    last = make_engine(False, num_pages=96, page_size=4)
    last.add_adapters_from_checkpoint(str(run_dir / "run.ckpt"), ["x"], weights="last")
    peft.add_adapter("x_last", str(run_dir / "adapters" / "x" / "last"))
    assert (_generate(last, [(p, "x") for p in PROMPTS]) == _generate(peft, [(p, "x_last") for p in PROMPTS])
            != _generate(peft, [(p, "x") for p in PROMPTS]))


def test_checkpoint_errors_name_the_adapter(make_engine, run_dir, tmp_path):
    engine = make_engine(False, num_pages=96, page_size=4)
    with pytest.raises(ConfigError, match="no adapter 'z'"):
        engine.add_adapters_from_checkpoint(str(run_dir / "run.ckpt"), ["z"])
    with pytest.raises(ConfigError, match="does not exist"):
        engine.add_adapters_from_checkpoint(str(tmp_path / "missing.ckpt"))
    ckpt = torch.load(run_dir / "run.ckpt", weights_only=True)
    ckpt["lorafusion"]["best_weights"] = {}
    key = "bank.adapters.1.0.q_proj.lora_A"  # y trained on a base with another hidden size
    ckpt["state_dict"][key] = torch.zeros(2, 48)
    torch.save(ckpt, tmp_path / "other.ckpt")
    with pytest.raises(ConfigError, match="adapter 'y'.*layer 0 q_proj"):
        engine.add_adapters_from_checkpoint(str(tmp_path / "other.ckpt"))
    assert engine.adapters() == []  # x was checked too, and nothing registered


def test_generate_cli_accepts_a_checkpoint(model_dir, run_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "w5 w9 w17", "adapter": "y", "id": 1, "max_new_tokens": 4}) + "\n")
    outs = []
    for adapters in ([str(run_dir / "run.ckpt")], [f"y={run_dir / 'adapters' / 'y'}"]):
        out = tmp_path / "out.jsonl"
        assert run(["--base_model", str(model_dir), "--adapters", *adapters, "--prompts", str(prompts),
                    "--out", str(out), "--device", "cpu"]) == 0
        outs.append(json.loads(out.read_text())["tokens"])
    assert outs[0] == outs[1] and len(outs[0]) > 0
