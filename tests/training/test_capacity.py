"""data.capacity=auto: the profiler's choice rule, and fit with it equals fit at the chosen capacity."""

import glob
import os

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_lorafusion.specs import ConfigError
from lightning_lorafusion.training.capacity import (
    CapacityProbe,
    choose_capacity,
    format_probes,
    probe_capacities,
)
from lightning_lorafusion.training.datamodule import MultiAdapterDataModule
from lightning_lorafusion.training.module import LoRAFusionModule
from test_equivalence import fit_joint, tiny_specs


class _FakeClock:
    """Advances only when a fake step runs: step time is a chosen function of the capacity."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _fake_run(seconds_of, oom_from=None, fill_of=lambda c: 0.9):
    clock = _FakeClock()
    calls = []

    def prepare(capacity):
        return fill_of(capacity), [capacity, capacity]  # "microbatches" are just their capacity

    def step(capacity):
        calls.append(capacity)
        if oom_from is not None and capacity >= oom_from:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        clock.now += seconds_of(capacity)

    return prepare, step, clock, calls


def test_probe_picks_most_real_tokens_per_second_and_stops_at_first_oom():
    # throughput grows with capacity until 2048, then flattens; 8192 runs out of memory
    seconds = {512: 0.010, 1024: 0.012, 2048: 0.020, 4096: 0.041, 8192: 0.08, 16384: 0.16}
    prepare, step, clock, calls = _fake_run(seconds.__getitem__, oom_from=8192)
    probes = probe_capacities(list(seconds), prepare, step, torch.device("cpu"), clock=clock)
    assert [p.capacity for p in probes] == sorted(seconds)
    assert [p.usable for p in probes] == [True, True, True, True, False, False]
    assert probes[4].rejected == "out of memory"
    assert probes[5].rejected.startswith("not tried")
    assert 16384 not in calls  # larger candidates are not run after an out-of-memory
    by_cap = {p.capacity: p for p in probes}
    assert by_cap[1024].seconds == pytest.approx(0.012)
    assert by_cap[1024].real_tokens_per_s == pytest.approx(0.9 * 1024 / 0.012)
    assert choose_capacity(probes).capacity == 2048  # 92.2k vs 1024's 76.8k and 4096's 89.9k real tok/s
    assert "chosen" in format_probes(probes, choose_capacity(probes))


def test_fill_can_outweigh_raw_speed():
    # 4096 runs slots faster, but the samples pack into it badly
    prepare, step, clock, _ = _fake_run(lambda c: c / 100_000, fill_of=lambda c: 0.95 if c == 2048 else 0.6)
    probes = probe_capacities([2048, 4096], prepare, step, torch.device("cpu"), clock=clock)
    assert choose_capacity(probes).capacity == 2048


def test_no_usable_candidate_is_a_config_error_and_other_errors_propagate():
    prepare, step, clock, _ = _fake_run(lambda c: 0.01, oom_from=0)
    probes = probe_capacities([1024, 2048], prepare, step, torch.device("cpu"), clock=clock)
    with pytest.raises(ConfigError, match="no candidate capacity fits"):
        choose_capacity(probes)

    def broken(capacity):
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        probe_capacities([1024], prepare, broken, torch.device("cpu"), clock=clock)
    tie = [CapacityProbe(1024, 1.0, 0.01), CapacityProbe(2048, 1.0, 0.02)]
    assert choose_capacity(tie).capacity == 1024


def _fit_auto(model_dir, specs, candidates, ckpt_path=None, **trainer_kwargs):
    module = LoRAFusionModule(base_model=model_dir, adapters=specs, backend="torch", grad_clip=0.0,
                              export_on_fit_end=False)
    dm = MultiAdapterDataModule(capacity="auto", capacity_candidates=candidates, pad_multiple=8,
                                max_length=48, prefetch=2, planner={"method": "greedy", "window": 2})
    kwargs = dict(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False)
    kwargs.update(trainer_kwargs)
    trainer = L.Trainer(**kwargs)
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    return module, dm


def test_fit_with_auto_capacity_equals_fit_at_the_chosen_capacity(tiny_model_dir):
    specs = tiny_specs()
    auto, dm = _fit_auto(tiny_model_dir, specs, [32, 64, 128, 256])
    chosen = dm.packing.capacity
    assert not dm.capacity_pending
    assert chosen in (64, 128, 256)  # 32 is below the longest padded sample (48)
    assert auto.steps_taken == [3, 3, 2]
    fixed, _, _ = fit_joint(tiny_model_dir, specs, capacity=chosen)
    want = dict(fixed.bank.named_parameters())
    # the profiling passes leave no gradients behind: training matches a fixed-capacity run
    for name, p in auto.bank.named_parameters():
        torch.testing.assert_close(p, want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_auto_capacity_rejects_candidates_below_the_longest_sample(tiny_model_dir):
    with pytest.raises(ConfigError, match="below the longest sample"):
        _fit_auto(tiny_model_dir, tiny_specs(), [16, 32])


def test_auto_capacity_config_errors():
    with pytest.raises(ConfigError, match="'auto'"):
        MultiAdapterDataModule(capacity="big")
    with pytest.raises(ConfigError, match="multiples of data.pad_multiple"):
        MultiAdapterDataModule(capacity="auto", capacity_candidates=[100], pad_multiple=16)


def test_resume_keeps_the_profiled_capacity_without_profiling_again(tiny_model_dir, tmp_path, monkeypatch):
    specs = tiny_specs()
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    full, dm = _fit_auto(tiny_model_dir, specs, [64, 128], max_epochs=2, callbacks=[ckpt],
                         enable_checkpointing=True)
    chosen = dm.packing.capacity
    path = sorted(glob.glob(os.path.join(tmp_path, "step=*.ckpt")), key=os.path.getmtime)[0]
    assert torch.load(path, weights_only=False)["MultiAdapterDataModule"]["capacity"] == chosen

    def no_profiling(self, module):
        raise AssertionError("a resumed run must reuse the checkpoint's capacity")

    monkeypatch.setattr(MultiAdapterDataModule, "_profile_capacity", no_profiling)
    resumed, dm2 = _fit_auto(tiny_model_dir, specs, [64, 128], max_epochs=2, ckpt_path=path)
    assert dm2.packing.capacity == chosen
    assert resumed.steps_taken == full.steps_taken
    want = dict(full.bank.named_parameters())
    for name, p in resumed.bank.named_parameters():
        torch.testing.assert_close(p, want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_profile_capacity_script_runs_on_cpu(tmp_path):
    """scripts/profile_capacity.py (the device benchmark) on the tiny shape: it measures every
    candidate that fits the samples and writes its choice."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [sys.executable, os.path.join(root, "scripts", "profile_capacity.py"), "--shape", "tiny", "--layers", "1",
           "--device", "cpu", "--backend", "torch", "--samples", "4", "--candidates", "1024,2048,4096",
           "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root,
                         env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr[-2000:]
    (result,) = [json.load(open(tmp_path / f)) for f in os.listdir(tmp_path)]
    measured = [r for r in result["rows"] if r["seconds"] is not None]
    assert measured and all(r["real_tokens_per_s"] >= 0 for r in measured)
    best = max(measured, key=lambda r: r["real_tokens_per_s"])
    assert result["chosen"] == best["capacity"]


def test_auto_capacity_under_data_parallel_replicas(tiny_model_dir, tmp_path):
    """PP=1 x DP=2 (spawned gloo processes): both replicas profile, take rank 0's capacity and
    train the same plan shape; the adapters equal the one-process run (packing changes nothing
    the adapters learn, so any chosen capacity gives the same weights)."""
    from lightning_lorafusion.parallel.strategy import MultiAdapterPipelineStrategy
    from test_dp_fit import _assert_same_adapters

    specs = tiny_specs()
    module = LoRAFusionModule(base_model=tiny_model_dir, adapters=specs, backend="torch", grad_clip=0.0,
                              export_dir=str(tmp_path / "dp"))
    dm = MultiAdapterDataModule(capacity="auto", capacity_candidates=[64, 128], pad_multiple=8, max_length=48,
                                planner={"window": 2})
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        strategy=MultiAdapterPipelineStrategy(pipeline_size=1, start_method="spawn", process_group_backend="gloo"),
    )
    trainer.fit(module, datamodule=dm)
    single, _, _ = fit_joint(tiny_model_dir, specs, max_epochs=1)
    single.export_adapters(str(tmp_path / "one"))
    _assert_same_adapters(tmp_path / "dp", tmp_path / "one", specs, rtol=1e-4, atol=1e-5)


def test_auto_capacity_is_refused_with_pipeline_stages():
    from types import SimpleNamespace

    from lightning_lorafusion.parallel.data_parallel import ParallelLayout
    from lightning_lorafusion.parallel.strategy import MultiAdapterPipelineStrategy

    strategy = MultiAdapterPipelineStrategy(pipeline_size=2, process_group_backend="gloo")
    strategy.layout = ParallelLayout(pipeline_size=2, data_parallel_size=1)  # as setup_environment sets it
    dm = MultiAdapterDataModule(capacity="auto", pad_multiple=8)
    dm.trainer = SimpleNamespace(strategy=strategy)
    with pytest.raises(ConfigError, match="pipeline_size=2"):
        dm._adopt_pipeline_layout()


def test_auto_capacity_profiles_the_familys_own_model(tmp_path):
    """The profiler times the module's own forward + backward, so a family's shapes and pieces
    (here Gemma 2: 1 + w norms, soft-caps, a sliding window shorter than the samples) are what
    it measures; the chosen capacity then trains every adapter."""
    from test_families_fit import _tiny_gemma2_dir

    base = _tiny_gemma2_dir(tmp_path / "gemma2")
    module, dm = _fit_auto(str(base), tiny_specs(), [64, 128])
    assert module.config.model_type == "gemma2" and module.config.family.attn_logit_softcap == 5.0
    assert not dm.capacity_pending and dm.packing.capacity in (64, 128)
    assert all(steps > 0 for steps in module.steps_taken)
