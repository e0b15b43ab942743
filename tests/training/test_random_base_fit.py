"""`fit` on a ``random:`` base (weights drawn on each stage's device, that stage's layers only):
a 4-stage pipeline in bf16-true holds only its own layers per rank and trains, with the run
summary written; the flushed 1F1B schedule over a random base trains exactly like one process."""

import json
import os

import lightning as L
import torch
from safetensors.torch import load_file

from lightning_lorafusion.parallel.partition import partition_decoder
from lightning_lorafusion.parallel.strategy import MultiAdapterPipelineStrategy
from lightning_lorafusion.training.callbacks import RunSummary
from lightning_lorafusion.training.datamodule import MultiAdapterDataModule
from lightning_lorafusion.training.module import LoRAFusionModule
from test_dp_fit import _assert_same_adapters
from test_equivalence import fit_joint, tiny_specs


def _random_base(tmp_path, layers: int = 4) -> str:
    """``random:<dir>``: a ``layers``-layer Llama config.json and nothing else (no weights, no tokenizer)."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512).save_pretrained(tmp_path / "cfg")
    return f"random:{tmp_path / 'cfg'}"


class RecordBase(L.Callback):
    """Each rank writes which frozen base tensors it holds (and where) once training starts."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_start(self, trainer, pl_module) -> None:
        held = {n[len("base__"):]: [tuple(b.shape), str(b.dtype), str(b.device)]
                for n, b in pl_module.named_buffers() if n.startswith("base__")}
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"stage": trainer.strategy.stage_index, "held": held,
                       "label_fraction": trainer.strategy._label_fraction}, f)


def _fit(base, specs, out_dir, *, devices, pipeline_size, schedule="no_flush", precision="32-true",
         dtype="float32", callbacks=(), stage_layers=None, activation_checkpointing=False):
    module = LoRAFusionModule(base_model=base, adapters=specs, backend="torch", grad_clip=0.0, dtype=dtype,
                              export_dir=str(out_dir), activation_checkpointing=activation_checkpointing)
    dm = MultiAdapterDataModule(capacity=128, pad_multiple=8, max_length=48, planner={"window": 2})
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, max_epochs=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, precision=precision, callbacks=list(callbacks),
        strategy=MultiAdapterPipelineStrategy(pipeline_size=pipeline_size, schedule=schedule,
                                              start_method="spawn", process_group_backend="gloo",
                                              stage_layers=stage_layers),
    )
    trainer.fit(module, datamodule=dm)
    return module, trainer


def test_four_stage_random_base_holds_only_its_layers_and_trains_in_bf16(tmp_path):
    base = _random_base(tmp_path)
    specs = tiny_specs(dropout=0.1)
    summary = tmp_path / "summary.json"
    module, _ = _fit(base, specs, tmp_path / "adapters", devices=4, pipeline_size=4, precision="bf16-true",
                     dtype="bfloat16", callbacks=[RecordBase(str(tmp_path)), RunSummary(path=str(summary))])
    stages = partition_decoder(module.config, 4)
    for rank in range(4):
        record = json.load(open(tmp_path / f"rank{rank}.json"))
        held = record["held"]
        assert record["stage"] == rank
        layers = {int(name.split("__")[1]) for name in held if name.startswith("layers__")}
        assert layers == set(stages[rank]), (rank, layers)
        assert ("embed" in held) == (rank == 0) and ("lm_head" in held) == (rank == 3)
        assert all(dtype == "torch.bfloat16" for _, dtype, _ in held.values())
    for spec in specs:  # trained: every exported lora_B moved off its zero init, and is finite
        weights = load_file(tmp_path / "adapters" / spec.name / "adapter_model.safetensors")
        b_factors = [w for k, w in weights.items() if "lora_B" in k]
        assert b_factors and all(torch.isfinite(w).all() and w.abs().sum() > 0 for w in b_factors)
    run = json.load(open(summary))
    assert (run["gpus"], run["pipeline_size"], run["schedule"]) == (4, 4, "no_flush")
    assert [e["epoch"] for e in run["epochs"]] == [0, 1]
    for epoch in run["epochs"]:
        assert epoch["real_tokens"] == run["epochs"][0]["real_tokens"] > 0 and epoch["wall_s"] >= 0
        assert 0 <= epoch["bubble_ratio"] < 1 and 0 <= epoch["simulated_bubble_ratio"] < 1
        assert len(epoch["stage_bubble_ratios"]) == 4 and len(epoch["peak_allocated_gib"]) == 4
        assert epoch["microbatches"] > 0 and epoch["useful_flops"] > 0


def test_flushed_schedule_on_a_random_base_matches_one_process(tmp_path):
    base = _random_base(tmp_path)
    specs = tiny_specs()  # dropout 0: masks depend on packing, which the pipeline plan changes
    _fit(base, specs, tmp_path / "flushed", devices=2, pipeline_size=2, schedule="flushed_1f1b")
    single, _, _ = fit_joint(base, specs, max_epochs=2)  # the same seeded weights, all on one process
    single.export_adapters(str(tmp_path / "one"))
    _assert_same_adapters(tmp_path / "flushed", tmp_path / "one", specs, rtol=1e-4, atol=1e-5)


def test_stage_layers_split_holds_its_layers_and_the_summary_records_it(tmp_path):
    """``stage_layers: [3, 1]``: stage 0 holds layers 0-2, stage 1 layer 3 with the head; the run
    summary records the split and the simulator's per-stage bubble ratios next to the measured."""
    base = _random_base(tmp_path)
    summary = tmp_path / "summary.json"
    _fit(base, tiny_specs(), tmp_path / "adapters", devices=2, pipeline_size=2, stage_layers=[3, 1],
         callbacks=[RecordBase(str(tmp_path)), RunSummary(path=str(summary))])
    for rank, want in enumerate(({0, 1, 2}, {3})):
        held = json.load(open(tmp_path / f"rank{rank}.json"))["held"]
        assert {int(name.split("__")[1]) for name in held if name.startswith("layers__")} == want
    run = json.load(open(summary))
    assert run["stage_layers"] == [3, 1] and run["max_epochs"] == 2
    for epoch in run["epochs"]:
        assert len(epoch["simulated_stage_bubble_ratios"]) == 2 == len(epoch["stage_bubble_ratios"])
        assert all(0 <= r < 1 for r in epoch["simulated_stage_bubble_ratios"])
        # 3 layers against 1 layer + head: the simulator sees stage 1 waiting on stage 0
        assert epoch["simulated_stage_bubble_ratios"][1] > epoch["simulated_stage_bubble_ratios"][0]


def test_default_split_takes_the_label_share_of_the_data_on_every_rank(tmp_path):
    base = _random_base(tmp_path)
    summary = tmp_path / "summary.json"
    _fit(base, tiny_specs(), tmp_path / "adapters", devices=2, pipeline_size=2,
         callbacks=[RecordBase(str(tmp_path)), RunSummary(path=str(summary))])
    fractions = [json.load(open(tmp_path / f"rank{r}.json"))["label_fraction"] for r in range(2)]
    assert fractions[0] == fractions[1] and 0 < fractions[0] < 1
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base[len("random:"):])
    run = json.load(open(summary))
    # the time model's split at the data's label share (on this tiny shape the head's logits
    # traffic outweighs a layer's work: the last stage gets fewer layers)
    assert run["stage_layers"] == [len(r) for r in partition_decoder(config, 2, label_fraction=fractions[0])]


def test_default_split_moves_layers_off_the_stage_that_recomputes(tmp_path):
    """``activation_checkpointing: 4`` on 8 layers recomputes layers 0-3, all on stage 0 of an even
    split: each costs one forward more, so the default split gives stage 0 fewer layers (what the
    time model says for this config) and the run trains."""
    base = _random_base(tmp_path, layers=8)
    summary = tmp_path / "summary.json"
    _fit(base, tiny_specs(), tmp_path / "adapters", devices=2, pipeline_size=2, activation_checkpointing=4,
         callbacks=[RecordBase(str(tmp_path)), RunSummary(path=str(summary))])
    fraction = json.load(open(tmp_path / "rank0.json"))["label_fraction"]
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base[len("random:"):])
    want = [len(r) for r in partition_decoder(config, 2, label_fraction=fraction, checkpoint_layers=4)]
    plain = [len(r) for r in partition_decoder(config, 2, label_fraction=fraction)]
    assert want[0] < plain[0]  # the recompute moved a layer off stage 0
    run = json.load(open(summary))
    assert run["stage_layers"] == want
    assert all(0 <= r < 1 for epoch in run["epochs"] for r in epoch["simulated_stage_bubble_ratios"])
