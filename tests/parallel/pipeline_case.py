"""A tiny multi-adapter training case shared by the distributed tests and their reference.

Everything is rebuilt from seeds in every process: the frozen base, the adapter bank, the
samples, the plan and the packed microbatches, so ranks agree without exchanging anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import os

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_lorafusion.data.microbatch import IGNORE_INDEX, Microbatch
from lightning_lorafusion.data.packing import PackingConfig, SampleLookup, pack_microbatch
from lightning_lorafusion.model import decoder as dec
from lightning_lorafusion.model.adapter_bank import AdapterBank
from lightning_lorafusion.planner import Plan, plan_microbatches
from lightning_lorafusion.specs import AdapterSpec

CAPACITY = 64
PAD_MULTIPLE = 4
LR = 0.5


@dataclass
class Sample:
    input_ids: list[int]
    labels: list[int]


def tiny_config() -> dec.DecoderConfig:
    return dec.DecoderConfig(
        vocab_size=61, hidden_size=24, intermediate_size=40, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=6,
    )


def base_params(config: dec.DecoderConfig, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    h, q, kv, i = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.intermediate_size
    layers = []
    for _ in range(config.num_layers):
        layers.append({
            "attn_norm": 1 + rand(h, scale=0.05),
            "q_proj": {"weight": rand(q, h)}, "k_proj": {"weight": rand(kv, h)},
            "v_proj": {"weight": rand(kv, h)}, "o_proj": {"weight": rand(h, q)},
            "mlp_norm": 1 + rand(h, scale=0.05),
            "gate_proj": {"weight": rand(i, h)}, "up_proj": {"weight": rand(i, h)},
            "down_proj": {"weight": rand(h, i)},
        })
    return {"embed": rand(config.vocab_size, h, scale=1.0), "layers": layers,
            "norm": 1 + rand(h, scale=0.05), "lm_head": rand(config.vocab_size, h)}


def case_params(config: dec.DecoderConfig, fp8: bool = False) -> dict:
    """``base_params``; ``fp8``: its projections and embedding table quantized (the emulated FP8
    products on CPU, what ``model.base_precision: fp8`` runs on a GPU). FP8 training is not
    stable under last-bit changes: a product summed in another order (another intra-op thread
    count) can move a value across an e4m3 rounding boundary (up to 2^-4 of it), and the case's
    0.5 learning rate carries that on (1 vs 4 threads: 4.4 % of the update apart, against 7e-7
    for the 16-bit base). FP8 runs of the case therefore use one intra-op thread everywhere."""
    params = base_params(config)
    if fp8:
        from lightning_lorafusion.model.hf_loading import quantize_base_fp8

        params = quantize_base_fp8(params, embedding=True)
    return params


def adapter_specs() -> list[AdapterSpec]:
    return [
        AdapterSpec(name="summ", rank=4, alpha=8.0, seed=1),
        AdapterSpec(name="chat", rank=2, alpha=2.0, dropout=0.1, seed=2,
                    target_modules=("q_proj", "v_proj", "down_proj")),
        AdapterSpec(name="code", rank=3, alpha=6.0, seed=3, target_modules=("o_proj", "up_proj")),
    ]


def make_bank(config: dec.DecoderConfig) -> AdapterBank:
    bank = AdapterBank(adapter_specs(), config)
    # PEFT initialises B to zero; start from non-zero B so every factor gets a gradient at once.
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in sorted(bank.named_parameters()):
            if name.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return bank


def samples_and_plan(num_stages: int, *, replicas: int = 1, num_batches: int = 3,
                     batch_size: int = 3, seed: int = 0):
    """The plan and, per data-parallel replica, its packed microbatches ``{plan index: Microbatch}``.

    Replicas share sample lengths (hence one plan with one step order) but draw their own
    tokens and prompt lengths; loss denominators count the whole global batch over replicas.
    """
    g = torch.Generator().manual_seed(seed)
    n_adapters = len(adapter_specs())
    lengths = [[[int(torch.randint(6, 22, (1,), generator=g)) for _ in range(batch_size)]
                for _ in range(num_batches)] for _ in range(n_adapters)]
    plan = plan_microbatches(lengths, capacity=CAPACITY, pad_multiple=PAD_MULTIPLE,
                             num_stages=num_stages, method="greedy")
    lookups = []
    for r in range(replicas):
        gr = torch.Generator().manual_seed(1000 * (seed + 1) + r)
        datasets, batches = [], []
        for a in range(n_adapters):
            ds = []
            for j in range(num_batches):
                for n in lengths[a][j]:
                    prompt = int(torch.randint(1, n - 2, (1,), generator=gr))
                    ids = torch.randint(0, 61, (n,), generator=gr).tolist()
                    ds.append(Sample(ids, [IGNORE_INDEX] * prompt + ids[prompt + 1:] + [IGNORE_INDEX]))
            datasets.append(ds)
            batches.append([list(range(j * batch_size, (j + 1) * batch_size)) for j in range(num_batches)])
        lookups.append(SampleLookup(datasets, batches))
    denominators = {(a, j): sum(lk.label_tokens(a, j) for lk in lookups)
                    for a in range(n_adapters) for j in range(num_batches)}
    step_at = plan.step_adapters()
    packing = PackingConfig(capacity=CAPACITY, pad_multiple=PAD_MULTIPLE)
    per_replica = [
        {i: pack_microbatch(mb, lk, config=packing, num_adapters=n_adapters, denominators=denominators,
                            step_adapters=step_at.get(i, ()), index=i)
         for i, mb in enumerate(plan.microbatches) if not mb.is_noop}
        for lk in lookups
    ]
    return plan, per_replica


def optimizers(bank: AdapterBank) -> list[torch.optim.Optimizer]:
    return [torch.optim.SGD(bank.parameters_of(a), lr=LR) for a in range(bank.num_adapters)]


def reference_training(plan: Plan, per_replica: list[dict[int, Microbatch]], fp8: bool = False) -> AdapterBank:
    """Single process, whole model, microbatches in plan order (every replica's), step at each
    step point."""
    config = tiny_config()
    params = case_params(config, fp8)
    bank = make_bank(config)
    opts = optimizers(bank)
    from lightning_lorafusion.parallel.stage import adapter_loss

    steps_after: dict[int, list[int]] = {}
    for (a, j), i in plan.step_points.items():
        steps_after.setdefault(i, []).append(a)
    for i in range(len(plan.microbatches)):
        for microbatches in per_replica:
            if i not in microbatches:
                continue
            mb = microbatches[i]
            routing = bank.routing(mb.segments, mb.index, mb.capacity)
            sums = dec.forward_loss_sums(params, bank.view(), mb.input_ids, mb.labels, mb.position_ids,
                                         mb.cu_seqlens, routing, config=config)
            adapter_loss(sums, mb.loss_denominators).backward()
        for a in sorted(steps_after.get(i, [])):
            opts[a].step()
            opts[a].zero_grad(set_to_none=True)
    return bank


class PipelineCaseModule(L.LightningModule):
    """The tiny three-adapter case behind the interface the strategy expects."""

    def __init__(self, out_dir: str, num_stages: int, replicas: int = 1, fp8: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.out_dir = out_dir
        self.decoder_config = tiny_config()
        self.params = case_params(self.decoder_config, fp8)
        self.fp8 = fp8
        self.bank = make_bank(self.decoder_config)
        self.plan, self.per_replica = samples_and_plan(num_stages, replicas=replicas)

    def configure_optimizers(self):
        return optimizers(self.bank)

    def train_dataloader(self):
        return DataLoader([0], batch_size=1)  # one planned window

    def pipeline_stage(self, stage_index, layers, is_first, is_last):
        if self.fp8:  # one intra-op thread, as the reference uses (see case_params)
            torch.set_num_threads(1)
        self.layers = layers
        lookup = self.per_replica[self.trainer.strategy.replica]
        from lightning_lorafusion.parallel.stage import DecoderStage

        self.loss_sums = {}
        return DecoderStage(params=self.params, bank=self.bank, config=self.decoder_config,
                            layers=layers, is_first=is_first, is_last=is_last,
                            microbatches=lookup.__getitem__, on_loss_sums=self.loss_sums.__setitem__)

    def adapter_parameters(self, adapter, layers):
        return [p for layer in layers for p in self.bank.adapters[adapter][layer].parameters()]

    def step_adapter(self, adapter, batch):
        opt = self.optimizers()[adapter]
        opt.step()
        opt.zero_grad(set_to_none=True)

    def training_step(self, batch, batch_idx):
        strategy = self.trainer.strategy
        strategy.run_pipeline(self.plan, activation_shape=(CAPACITY, self.decoder_config.hidden_size),
                              dtype=torch.float32)
        assert 0.0 <= strategy.last_bubble_ratio < 1.0
        assert len(strategy.last_stage_bubble_ratios) == strategy.layout.pipeline_size
        if strategy.stage_index == strategy.layout.pipeline_size - 1:
            # the last stage saw every real microbatch's per-adapter loss sums
            assert sorted(self.loss_sums) == sorted(self.per_replica[strategy.replica])
            assert all(v.shape == (self.bank.num_adapters,) and torch.isfinite(v).all()
                       for v in self.loss_sums.values())

    def on_train_end(self):
        strategy = self.trainer.strategy
        self.trainer.save_checkpoint(os.path.join(self.out_dir, "last.ckpt"))
        owned = set(self.layers)
        merged = strategy.gather_stage_states(self.bank.state_dict(),
                                              lambda key: int(key.split(".")[2]) in owned)
        if merged is not None:
            torch.save(merged, os.path.join(self.out_dir, "gathered.pt"))
        torch.save({"state": self.bank.state_dict(), "layers": list(self.layers),
                    "stage": self.trainer.strategy.stage_index},
                   os.path.join(self.out_dir, f"rank{self.global_rank}.pt"))
