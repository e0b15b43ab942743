"""`fit` under MultiAdapterPipelineStrategy (2 stages, gloo, spawned processes) trains every
adapter to the same weights as the one-process run, and exports whole PEFT adapters (data-parallel
replicas: test_dp_fit.py)."""

import lightning as L
import torch
from safetensors.torch import load_file

from lightning_lorafusion.parallel.strategy import MultiAdapterPipelineStrategy
from lightning_lorafusion.training.datamodule import MultiAdapterDataModule
from lightning_lorafusion.training.module import LoRAFusionModule
from test_equivalence import fit_joint, tiny_specs


def _pipeline_fit(model_dir, specs, out_dir, devices=2, pipeline_size=2, callbacks=(), ckpt_path=None,
                  action_trace=None):
    module = LoRAFusionModule(base_model=model_dir, adapters=specs, backend="torch", grad_clip=0.0,
                              export_dir=str(out_dir))
    dm = MultiAdapterDataModule(capacity=128, pad_multiple=8, max_length=48, planner={"window": 2})
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, max_epochs=2, logger=False,
        enable_checkpointing=bool(callbacks), callbacks=list(callbacks),
        enable_progress_bar=False, enable_model_summary=False,
        strategy=MultiAdapterPipelineStrategy(pipeline_size=pipeline_size, start_method="spawn",
                                              process_group_backend="gloo", action_trace=action_trace),
    )
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    return trainer


def test_two_stage_pipeline_fit_matches_one_process(tiny_model_dir, tmp_path):
    specs = tiny_specs()  # dropout 0: masks depend on packing, which the pipeline plan changes
    trace = tmp_path / "actions"
    trainer = _pipeline_fit(tiny_model_dir, specs, tmp_path / "pp", action_trace=str(trace))
    metrics = trainer.callback_metrics  # rank 0's, sent back by the spawn launcher
    for key in ("pipeline/bubble_ratio", "pipeline/simulated_bubble_ratio", "pipeline/bubble_ratio_stage1"):
        assert 0.0 <= float(metrics[key]) < 1.0, key
    _check_action_trace(trace)
    single, _, _ = fit_joint(tiny_model_dir, specs, max_epochs=2)
    single.export_adapters(str(tmp_path / "one"))
    for spec in specs:
        got = load_file(tmp_path / "pp" / spec.name / "adapter_model.safetensors")
        want = load_file(tmp_path / "one" / spec.name / "adapter_model.safetensors")
        assert got.keys() == want.keys() and len(want) > 0
        for key in want:
            # The 2-stage plan packs differently (bubble-lemma spacing), so gradients are summed
            # in another order; after 8+ AdamW steps fp32 rounding reaches ~1e-6 absolute.
            torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-5, msg=lambda m, k=key, n=spec.name: f"{n}: {k}\n{m}")


def _check_action_trace(trace):
    """Each rank wrote one line per epoch whose measured and simulated actions match one for one."""
    import json

    for rank in (0, 1):
        lines = [json.loads(t) for t in (trace / f"actions_rank{rank}.jsonl").read_text().splitlines()]
        assert [line["epoch"] for line in lines] == [0, 1] and {line["stage"] for line in lines} == {rank}
        for line in lines:
            measured = sorted((k, int(i)) for k, i, *_ in line["events"] if k in ("F", "B", "S"))
            simulated = sorted((k, int(i)) for k, i, *_ in line["simulated"])
            assert measured == simulated and len(line["microbatches"]) > 0
            # every good step's host seconds in its five phases
            assert len(line["step_phases"]) == sum(k == "S" for k, *_ in line["events"])
            assert all(len(p) == 5 and min(p) >= 0 for p in line["step_phases"])
            assert all(t0 <= t1 <= line["wall"] + 1e-6 for *_, t0, t1 in line["events"])
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[2] / "scripts" / "pipeline_action_times.py"
    spec = importlib.util.spec_from_file_location("pipeline_action_times", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    summary = tool.summarize(tool.load_trace(str(trace)))
    assert summary["epoch"] == 1 and [st["stage"] for st in summary["stages"]] == [0, 1]
    assert len(summary["microbatches"]) == len(lines[-1]["microbatches"])
    assert "| stage |" in tool.report(summary) and len(summary["stages"][0]["step_phase_ms"]) == 5


def test_pipeline_fit_resumes_from_epoch_checkpoint(tiny_model_dir, tmp_path):
    """Resume a 2-stage run from its epoch-0 checkpoint (one file per stage): the adapters end
    as in the uninterrupted run."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    specs = tiny_specs()
    ckpt_dir = tmp_path / "ckpt"
    cb = [ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, filename="{epoch}")]
    _pipeline_fit(tiny_model_dir, specs, tmp_path / "straight", callbacks=cb)
    assert (ckpt_dir / "epoch=0.ckpt").exists() and (ckpt_dir / "epoch=0.ckpt.stage1").exists()
    # each stage file holds its own layers' adapters only (the 2-layer model: layer s on stage s)
    for stage, name in enumerate(("epoch=0.ckpt", "epoch=0.ckpt.stage1")):
        state = torch.load(ckpt_dir / name, weights_only=False)["state_dict"]
        layers = {int(k.split(".")[3]) for k in state if k.startswith("bank.adapters.")}
        assert layers == {stage}, (name, layers)
    _pipeline_fit(tiny_model_dir, specs, tmp_path / "resumed", ckpt_path=str(ckpt_dir / "epoch=0.ckpt"))
    for spec in specs:
        got = load_file(tmp_path / "resumed" / spec.name / "adapter_model.safetensors")
        want = load_file(tmp_path / "straight" / spec.name / "adapter_model.safetensors")
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=key, n=spec.name: f"{n}: {k}\n{m}")
