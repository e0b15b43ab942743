"""MultiAdapterPipelineStrategy under a real Lightning Trainer: launch, layout, training."""

from __future__ import annotations

import os
import tempfile

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_lorafusion.parallel.stage import DecoderStage
from lightning_lorafusion.parallel.strategy import MultiAdapterPipelineStrategy

from . import pipeline_case as case


class PipelineCaseModule(L.LightningModule):
    """The tiny three-adapter case behind the interface the strategy expects."""

    def __init__(self, out_dir: str, num_stages: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.out_dir = out_dir
        self.decoder_config = case.tiny_config()
        self.params = case.base_params(self.decoder_config)
        self.bank = case.make_bank(self.decoder_config)
        self.plan, self.per_replica = case.samples_and_plan(num_stages)

    def configure_optimizers(self):
        return case.optimizers(self.bank)

    def train_dataloader(self):
        return DataLoader([0], batch_size=1)  # one planned window

    def pipeline_stage(self, stage_index, layers, is_first, is_last):
        self.layers = layers
        lookup = self.per_replica[self.trainer.strategy.replica]
        return DecoderStage(params=self.params, bank=self.bank, config=self.decoder_config,
                            layers=layers, is_first=is_first, is_last=is_last,
                            microbatches=lookup.__getitem__)

    def adapter_parameters(self, adapter, layers):
        return [p for layer in layers for p in self.bank.adapters[adapter][layer].parameters()]

    def step_adapter(self, adapter, batch):
        opt = self.optimizers()[adapter]
        opt.step()
        opt.zero_grad(set_to_none=True)

    def training_step(self, batch, batch_idx):
        self.trainer.strategy.run_pipeline(
            self.plan, activation_shape=(case.CAPACITY, self.decoder_config.hidden_size),
            dtype=torch.float32,
        )

    def on_train_end(self):
        torch.save({"state": self.bank.state_dict(), "layers": list(self.layers),
                    "stage": self.trainer.strategy.stage_index},
                   os.path.join(self.out_dir, f"rank{self.global_rank}.pt"))


def test_strategy_trains_a_two_stage_pipeline_like_one_process():
    with tempfile.TemporaryDirectory() as tmp:
        module = PipelineCaseModule(tmp, num_stages=2)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
            strategy=MultiAdapterPipelineStrategy(pipeline_size=2, start_method="spawn",
                                                  process_group_backend="gloo"),
        )
        trainer.fit(module)
        results = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]
    plan, per_replica = case.samples_and_plan(2)
    reference = case.reference_training(plan, per_replica).state_dict()
    assert [r["stage"] for r in results] == [0, 1]
    assert sorted(i for r in results for i in r["layers"]) == list(range(4))
    for r in results:
        for key in reference:
            if int(key.split(".")[2]) in r["layers"]:
                torch.testing.assert_close(r["state"][key], reference[key], rtol=1e-5, atol=1e-6, msg=key)


def test_strategy_refuses_bad_sizes():
    with pytest.raises(ValueError, match="pipeline_size"):
        MultiAdapterPipelineStrategy(pipeline_size=0)
    with pytest.raises(ValueError, match="data_parallel_size"):
        MultiAdapterPipelineStrategy(pipeline_size=2, data_parallel_size=0)
