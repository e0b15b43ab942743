"""`fit` with data-parallel replicas (MultiAdapterPipelineStrategy, gloo): every replica trains on
its share of each global batch and the adapters end as in the one-process run.

- PP=1 x DP=2 (spawned processes; the DP-only layout for bases that fit one GPU), and its
  resume from an epoch checkpoint;
- PP=2 x DP=2 launched as two simulated nodes of two processes through Lightning's
  environment variables (NODE_RANK, MASTER_ADDR, MASTER_PORT).
"""

import json
import os
import socket
import subprocess
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file

from lightning_lorafusion.parallel.strategy import MultiAdapterPipelineStrategy
from lightning_lorafusion.training.datamodule import MultiAdapterDataModule
from lightning_lorafusion.training.module import LoRAFusionModule
from test_equivalence import fit_joint, tiny_specs


def _dp_fit(model_dir, specs, out_dir, *, callbacks=(), ckpt_path=None, max_epochs=2):
    module = LoRAFusionModule(base_model=model_dir, adapters=specs, backend="torch", grad_clip=0.0,
                              export_dir=str(out_dir))
    dm = MultiAdapterDataModule(capacity=128, pad_multiple=8, max_length=48, planner={"window": 2})
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_epochs=max_epochs, logger=False, num_sanity_val_steps=0,
        enable_checkpointing=bool(callbacks), callbacks=list(callbacks),
        enable_progress_bar=False, enable_model_summary=False,
        strategy=MultiAdapterPipelineStrategy(pipeline_size=1, start_method="spawn",
                                              process_group_backend="gloo"),
    )
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    return trainer


def _assert_same_adapters(got_dir, want_dir, specs, *, rtol, atol, sub=""):
    for spec in specs:
        got = load_file(got_dir / spec.name / sub / "adapter_model.safetensors")
        want = load_file(want_dir / spec.name / sub / "adapter_model.safetensors")
        assert got.keys() == want.keys() and len(want) > 0
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=rtol, atol=atol,
                                       msg=lambda m, k=key, n=spec.name: f"{n}: {k}\n{m}")


def _one_process(model_dir, specs, out_dir):
    module, _, trainer = fit_joint(model_dir, specs, max_epochs=2)
    module.export_adapters(str(out_dir))
    return trainer


def test_data_parallel_fit_matches_one_process_and_resumes(tiny_model_dir, tmp_path):
    """PP=1 x DP=2: two replicas, each with half of every global batch (some shares empty: the
    7-sample adapter's last batch has one sample), gradients summed at each adapter's step."""
    specs = tiny_specs()  # dropout 0: masks depend on packing, which differs per replica
    ckpt_dir = tmp_path / "ckpt"
    trainer = _dp_fit(tiny_model_dir, specs, tmp_path / "dp",
                      callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, filename="{epoch}")])
    single = _one_process(tiny_model_dir, specs, tmp_path / "one")
    # The replicas pack differently and their gradients are summed in another order; after 8+
    # AdamW steps fp32 rounding reaches ~1e-6 absolute (as in the pipeline test).
    _assert_same_adapters(tmp_path / "dp", tmp_path / "one", specs, rtol=1e-4, atol=1e-5)
    # the logged global-batch loss is the sum of the replicas' shares: the one-process loss
    for spec in specs:
        torch.testing.assert_close(float(trainer.callback_metrics[f"loss/{spec.name}"]),
                                   float(single.callback_metrics[f"loss/{spec.name}"]), rtol=1e-5, atol=1e-6)
    # resume from the epoch-0 checkpoint (replica 0 wrote it; both replicas read it)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["epoch=0.ckpt", "epoch=1.ckpt"]
    _dp_fit(tiny_model_dir, specs, tmp_path / "resumed", ckpt_path=str(ckpt_dir / "epoch=0.ckpt"))
    _assert_same_adapters(tmp_path / "resumed", tmp_path / "dp", specs, rtol=1e-5, atol=1e-6)


def test_data_parallel_validation_and_early_stopping_match_one_process(tiny_model_dir, tmp_path):
    """Each replica validates its share of the packed val microbatches; the summed losses, the
    early-stopping decision (b stops after the second validation and leaves the third epoch's
    plan) and the best/last exports equal the one-process run's."""
    from test_validation import fit_val, val_specs

    specs = val_specs(dropout=0.0, b={"early_stopping": {"patience": 1, "min_delta": 10.0}})
    trainer = _dp_fit(tiny_model_dir, specs, tmp_path / "dp", max_epochs=3)
    single, _, one = fit_val(tiny_model_dir, specs, max_epochs=3, export_dir=str(tmp_path / "one"))
    assert [p.status for p in single.progress] == ["training", "early_stopped", "training"]
    for spec in specs:
        torch.testing.assert_close(float(trainer.callback_metrics[f"val/loss/{spec.name}"]),
                                   float(one.callback_metrics[f"val/loss/{spec.name}"]), rtol=1e-5, atol=1e-6)
        state = json.loads((tmp_path / "dp" / spec.name / "trainer_state.json").read_text())
        want = json.loads((tmp_path / "one" / spec.name / "trainer_state.json").read_text())
        assert (state["reason"], state["step"], state["steps_taken"]) == (want["reason"], want["step"], want["steps_taken"])
    _assert_same_adapters(tmp_path / "dp", tmp_path / "one", specs, rtol=1e-4, atol=1e-5)
    _assert_same_adapters(tmp_path / "dp", tmp_path / "one", [s for s in specs], rtol=1e-4, atol=1e-5, sub="last")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_pipeline_times_data_parallel_fit_matches_one_process(tiny_model_dir, tmp_path):
    """2 nodes x 2 processes = PP=2 x DP=2 through `fit`, launched the Lightning way."""
    script = os.path.join(os.path.dirname(__file__), "two_node_fit.py")
    port = _free_port()
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("PYTEST", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_", "SLURM", "GROUP_RANK"))}
    nodes = [
        subprocess.Popen(
            [sys.executable, script, tiny_model_dir, str(tmp_path / "pp2dp2")],
            env={**base, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(n)},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for n in range(2)
    ]
    logs = [p.communicate(timeout=900)[0] for p in nodes]
    assert all(p.returncode == 0 for p in nodes), "\n".join(logs)
    specs = tiny_specs()
    _one_process(tiny_model_dir, specs, tmp_path / "one")
    _assert_same_adapters(tmp_path / "pp2dp2", tmp_path / "one", specs, rtol=1e-4, atol=1e-5)
