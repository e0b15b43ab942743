"""The step's prefill LoRA tables (``step_batch.prefill_lora_tables``) against what the pool and the
adapters say, and the LoRA they drive (the default Triton form, in the interpreter) against the
adapters' own factors."""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from lightning_lorafusion.kernels.lora_segments import segment_lora_add, segment_tiles
from lightning_lorafusion.model.decoder import DecoderConfig
from lightning_lorafusion.serving.adapters import host_adapter_from_factors
from lightning_lorafusion.serving.pool import UnifiedPool
from lightning_lorafusion.serving.step_batch import MODULE_INDEX, prefill_lora_tables


def _setup():
    cfg = DecoderConfig.from_hf(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2))
    g = torch.Generator().manual_seed(0)
    specs = (("a", 4, ("q_proj", "v_proj")), ("b", 8, ("q_proj", "k_proj", "v_proj", "gate_proj")))
    adapters, factors = [], []
    for name, r, targets in specs:
        f = {}
        for layer in range(cfg.num_layers):
            for m in targets:
                k, n = cfg.module_dims(m)
                f[(layer, m)] = (torch.randn(r, k, generator=g), torch.randn(n, r, generator=g))
        factors.append(f)
        adapters.append(host_adapter_from_factors(name, f, rank=r, alpha=2.0 * r + 1, config=cfg,
                                                  dtype=torch.float32, pin=False))
    pool = UnifiedPool(num_pages=64, page_size=4, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                       head_dim=cfg.head_dim, dtype=torch.float32, device="cpu")
    residents = [pool.page_in(a) for a in adapters]
    return cfg, pool, residents, factors


def test_tables_name_each_adapters_factors_where_the_pool_holds_them():
    cfg, pool, residents, _ = _setup()
    segments = [(0, 5, 1), (5, 40, 0), (40, 41, 1)]
    pre = prefill_lora_tables(segments, residents, 16, torch.device("cpu"))
    assert pre.tiles.t().tolist() == [list(t) for t in segment_tiles(segments, 16)]
    assert pre.segments == tuple(segments) and pre.block_m == 16 and pre.block_r == 16
    for a, r in enumerate(residents):
        assert torch.equal(pre.offsets[..., a], r.adapter.relative_offsets + r.offset)
        assert torch.equal(pre.ranks[:, a], r.adapter.module_ranks)
        assert pre.scales[a].item() == r.adapter.scale
    assert pre.modules == {"q_proj", "k_proj", "v_proj", "gate_proj"}
    assert pre.ranks[MODULE_INDEX["k_proj"], 0] == 0 and pre.ranks[MODULE_INDEX["k_proj"], 1] == 8


def test_the_tables_drive_each_segments_own_adapter():
    """q/k/v of layer 1 through the tables and the default Triton form: each segment's rows get
    scale * x A^T B^T of its own adapter (the factors as given), k untouched for adapter "a"."""
    cfg, pool, residents, factors = _setup()
    segments = [(0, 5, 1), (5, 23, 0), (23, 30, 1)]
    pre = prefill_lora_tables(segments, residents, 16, torch.device("cpu"))
    names = ("q_proj", "k_proj", "v_proj")
    x = torch.randn(30, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    sizes = [cfg.module_dims(m)[1] for m in names]
    y = torch.zeros(30, sum(sizes))
    segment_lora_add(x, pre.group(pool.storage, 1, names), list(y.split(sizes, dim=1)), backend="triton")
    want = torch.zeros_like(y)
    for p, (m, w) in enumerate(zip(names, want.split(sizes, dim=1))):
        for start, end, a in segments:
            pair = factors[a].get((1, m))
            if pair is not None:
                w[start:end] = residents[a].adapter.scale * (x[start:end] @ pair[0].T @ pair[1].T)
    assert torch.allclose(y, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(y[5:23, sizes[0]:sizes[0] + sizes[1]], torch.zeros(18, sizes[1]))
