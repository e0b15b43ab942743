"""CUDA graphs of the training step (training/cuda_graphs.py, kernels/static_routing.py).

On the CPU: the shape keys (buckets, reuse, bounds), the static buffers, the fixed-shape launch
tables (same kernel results as the eager tables, dropout included), the fixed-shape step run
without capture against the eager step over several optimizer steps, and what falls back and
why. On a GPU (skipped here): captured and replayed steps against eager steps.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from lightning_lorafusion.data.microbatch import IGNORE_INDEX
from lightning_lorafusion.data.packing import PackingConfig, SampleLookup, pack_microbatch
from lightning_lorafusion.data.synthetic import synthetic_token_samples
from lightning_lorafusion.data.tokenization import shifted_labels
from lightning_lorafusion.kernels.dropout import _C_OFFSET, _MASK32, dropout_offset, microbatch_hash
from lightning_lorafusion.kernels.dropout_triton import offset_hash
from lightning_lorafusion.kernels.fused_lora import fused_lora_projections
from lightning_lorafusion.kernels.routing_table import build_launch_table
from lightning_lorafusion.kernels.static_routing import StaticLaunchTables, max_tiles
from lightning_lorafusion.model.adapter_bank import AdapterBank
from lightning_lorafusion.model.decoder import DecoderConfig, DecoderOptions, forward_loss_sums
from lightning_lorafusion.model.random_model import random_base_params
from lightning_lorafusion.parallel.stage import adapter_loss
from lightning_lorafusion.planner import plan_microbatches
from lightning_lorafusion.specs import AdapterSpec, ConfigError
from lightning_lorafusion.training.cuda_graphs import (
    GraphKey,
    StaticInputs,
    TrainingGraphs,
    cuda_graphs_refusal,
    graph_key,
    label_rows_step,
)
from lightning_lorafusion.training.graph_cover import covers

CUDA = torch.cuda.is_available()
# the kernel-level checks run on the GPU where there is one (fp32), else in the Triton interpreter
DEVICE = torch.device("cuda" if CUDA else "cpu")


@dataclasses.dataclass(frozen=True)
class _Sample:
    input_ids: tuple
    labels: tuple


def tiny_config(layers: int = 2) -> DecoderConfig:
    return DecoderConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=layers,
                         num_heads=4, num_kv_heads=2, head_dim=8)


def tiny_specs(dropout: float = 0.1) -> list[AdapterSpec]:
    """Heterogeneous ranks and targets; adapter 2 adapts only the MLP."""
    return [
        AdapterSpec(name="a", rank=4, alpha=8, dropout=dropout, seed=11, lr=1e-2, dataset={"kind": "synthetic"}),
        AdapterSpec(name="b", rank=8, alpha=8, dropout=dropout, seed=12, lr=1e-2,
                    target_modules=("q_proj", "v_proj", "o_proj", "down_proj"), dataset={"kind": "synthetic"}),
        AdapterSpec(name="c", rank=2, alpha=4, dropout=0.0, seed=13, lr=1e-2,
                    target_modules=("gate_proj", "up_proj", "down_proj"), dataset={"kind": "synthetic"}),
    ]


def microbatches(config: DecoderConfig, *, capacity: int = 128, samples: int = 6, pad_multiple: int = 16,
                 max_length: int = 60, global_batch: int = 3, seed: int = 0):
    """Planner-packed microbatches of synthetic samples for 3 adapters (host tensors)."""
    datasets = []
    for a, dist in enumerate(("xsum", "cnn_dailymail", "wikisum")):
        pairs = synthetic_token_samples(dist, samples, vocab_size=config.vocab_size, seed=seed + a,
                                        max_length=max_length)
        datasets.append([_Sample(tuple(x), shifted_labels(x, [t != IGNORE_INDEX for t in y])) for x, y in pairs])
    batches = [[list(range(g, min(g + global_batch, len(d)))) for g in range(0, len(d), global_batch)]
               for d in datasets]
    lookup = SampleLookup(datasets, batches)
    plan = plan_microbatches(lookup.lengths(), capacity=capacity, pad_multiple=pad_multiple, method="greedy")
    steps = plan.step_adapters()
    cfg = PackingConfig(capacity=capacity, pad_multiple=pad_multiple)
    dens = lookup.denominators()
    return [pack_microbatch(p, lookup, config=cfg, num_adapters=len(datasets), denominators=dens,
                            step_adapters=steps.get(i, ()), index=1000 + i)
            for i, p in enumerate(plan.microbatches) if not p.is_noop]


# ------------------------------------------------------------------------------ keys


def test_dropout_offset_folds_the_microbatch_into_the_seed():
    """What lets a graph captured at microbatch 0 draw microbatch i's masks from its tables."""
    for mb in (0, 1, 7, 1000, 2**33 + 5):
        for layer in (0, 3, 79):
            for slot in range(4):
                eager = offset_hash(dropout_offset(mb, layer, slot))
                assert eager == microbatch_hash(mb) ^ offset_hash(dropout_offset(0, layer, slot))
    assert microbatch_hash(0) == 0
    assert offset_hash(dropout_offset(0, 5, 2)) == ((5 * 4 + 2) * _C_OFFSET) & _MASK32
    # distinct offsets across microbatches, layers and slots
    assert len({dropout_offset(m, l, s) for m in range(64) for l in range(16) for s in range(4)}) == 64 * 16 * 4


def test_graph_key_bounds_buckets_and_reuse():
    config = tiny_config()
    mbs = microbatches(config, capacity=128, samples=12)
    keys = [graph_key(mb) for mb in mbs]
    step = label_rows_step(128)
    assert step == 128 and label_rows_step(8192) == 128 and label_rows_step(16384) == 256 and label_rows_step(64) == 64
    for mb, key in zip(mbs, keys):
        assert key.capacity == mb.capacity == 128
        assert mb.max_seqlen <= key.max_seqlen <= 128 and key.max_seqlen & (key.max_seqlen - 1) == 0
        blocks = mb.cu_seqlens.shape[0] - 1
        assert blocks <= key.num_blocks <= 128 and key.num_blocks >= 8
        assert mb.num_label_rows <= key.label_rows <= 128 and key.label_rows % step == 0
    # buckets: far fewer keys than microbatches, and microbatches with different layouts share one
    assert len(set(keys)) < len(mbs)
    shared = [mb for mb, k in zip(mbs, keys) if k == keys[0]]
    assert len({mb.segments for mb in shared} | {mb.samples for mb in shared}) > 1 or len(shared) == 1
    # the key never reads the device: a meta-device microbatch gives the same key
    assert graph_key(mbs[0].to("meta")) == keys[0]
    bare = dataclasses.replace(mbs[0], label_rows=None)
    with pytest.raises(ValueError, match="max_seqlen/label_rows"):
        graph_key(bare)
    # a microbatch without labels still has a (non-empty) head bucket
    empty = dataclasses.replace(mbs[0], label_rows=torch.zeros(0, dtype=torch.int64))
    assert graph_key(empty).label_rows == step


def test_static_inputs_pad_with_empty_blocks_and_label_free_rows():
    config = tiny_config()
    mb = microbatches(config, capacity=128)[0]
    key = graph_key(mb)
    inputs = StaticInputs(128, 3, torch.device("cpu"))
    dens = mb.loss_denominators.clone()
    dens[1] = 0
    inputs.load(mb, dens)
    n = mb.cu_seqlens.shape[0]
    cu = inputs.cu_seqlens[: key.num_blocks + 1]
    assert torch.equal(cu[:n], mb.cu_seqlens) and (cu[n:] == 128).all()
    rows = inputs.label_rows[: key.label_rows]
    assert torch.equal(rows[: mb.num_label_rows], mb.label_rows) and (rows[mb.num_label_rows:] == 127).all()
    assert int(mb.labels[127]) == IGNORE_INDEX  # the padding row has no label, by the label contract
    for t in ("input_ids", "labels", "position_ids"):
        assert torch.equal(getattr(inputs, t), getattr(mb, t))
    owner = torch.full((128,), 3)
    for s, e, a in mb.segments:
        owner[s:e] = a
    assert torch.equal(inputs.row_owner, owner)
    assert torch.equal(inputs.denominators, dens)
    # a second microbatch reuses the same storage (a graph reads fixed addresses)
    ptrs = [t.data_ptr() for t in (inputs.input_ids, inputs.cu_seqlens, inputs.label_rows)]
    inputs.load(microbatches(config, capacity=128)[1], dens)
    assert ptrs == [t.data_ptr() for t in (inputs.input_ids, inputs.cu_seqlens, inputs.label_rows)]
    with pytest.raises(ValueError, match="capacity"):
        StaticInputs(64, 3, torch.device("cpu")).load(mb, dens)


# -------------------------------------------------------------------- launch tables


def _projection_case(seed=0, m=128, k=32, n=(24, 16)):
    g = torch.Generator().manual_seed(seed)
    ranks = [(4, 4), (8, 0), (0, 2)]  # adapter x projection; adapter 2 only on the second

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE)

    x = randn(m, k)
    weights = [randn(ni, k) * 0.2 for ni in n]
    a = [[randn(r[i], k) * 0.2 if r[i] else None for r in ranks] for i in range(2)]
    b = [[randn(ni, r[i]) * 0.2 if r[i] else None for r in ranks] for i, ni in enumerate(n)]
    return x, weights, a, b


def _run_projections(x, weights, a, b, routing, offset):
    from lightning_lorafusion.kernels.reference import LoraModuleWeights

    x = x.clone().requires_grad_(True)
    a = [[t.clone().requires_grad_(True) if t is not None else None for t in per] for per in a]
    b = [[t.clone().requires_grad_(True) if t is not None else None for t in per] for per in b]
    loras = [LoraModuleWeights(a=tuple(a[i]), b=tuple(b[i])) for i in range(2)]
    ys = fused_lora_projections(x, weights, [None, None], loras, routing, dropout_offset=offset)
    g = torch.Generator().manual_seed(9)
    sum((y * torch.randn(y.shape, generator=g).to(y.device)).sum() for y in ys).backward()
    grads = [x.grad] + [t.grad if t is not None else None for per in a + b for t in per]
    return ys, grads


@pytest.mark.parametrize("segments", [((0, 40, 0), (48, 100, 2)), ((0, 128, 1),), ((16, 80, 0), (80, 128, 1))])
def test_static_tables_give_the_eager_kernel_results(segments):
    """Fixed-shape tables (every adapter active, padded tiles, the microbatch index in the seed
    column) against the eager tables of the same microbatch: same outputs and gradients, with
    dropout, at a microbatch index != 0. Absent adapters get zero gradients, not None."""
    x, weights, a, b = _projection_case()
    base = AdapterBank(tiny_specs(dropout=0.2), tiny_config()).routing((), 0, 128)
    index, layer_slot = 1234, (1, 2)
    eager_routing = dataclasses.replace(base, segments=segments, microbatch_index=index, launch_cache={})
    ys_e, grads_e = _run_projections(x, weights, a, b, eager_routing, dropout_offset(index, *layer_slot))
    tables = StaticLaunchTables(base, DEVICE)
    tables.fill(segments, index)  # before any table exists: tables made later get these contents
    static_routing = dataclasses.replace(base, launch_cache=tables.cache)
    ys_s, grads_s = _run_projections(x, weights, a, b, static_routing, dropout_offset(0, *layer_slot))
    assert tables.num_tables == 1
    for ye, ys in zip(ys_e, ys_s):
        torch.testing.assert_close(ys, ye, rtol=1e-5, atol=1e-5)
    present = {ad for _, _, ad in segments}
    for i, (ge, gs) in enumerate(zip(grads_e, grads_s)):
        if i == 0:
            torch.testing.assert_close(gs, ge, rtol=1e-5, atol=1e-5)
            continue
        adapter = (i - 1) % 3
        if gs is None:  # no factor there
            continue
        if adapter in present:
            torch.testing.assert_close(gs, ge, rtol=1e-5, atol=1e-5)
        else:
            assert ge is None and torch.count_nonzero(gs) == 0
    # the table keeps its tensors (a graph reads them) and its bounds across refills
    (table,) = tables.tables()
    ptrs = [table.tiles.data_ptr(), table.adapter_int.data_ptr(), table.block_tiles.data_ptr()]
    assert table.num_tiles == max_tiles(128, table.block_m, 3)
    assert table.active == (0, 1, 2) and table.s_numel == 128 * table.max_total_rank
    tables.fill(((0, 128, 2),), 7)
    assert ptrs == [table.tiles.data_ptr(), table.adapter_int.data_ptr(), table.block_tiles.data_ptr()]
    eager = build_launch_table(dataclasses.replace(base, segments=((0, 128, 2),), launch_cache={}),
                               ((4, 8, 0), (4, 0, 2)), table.block_m, torch.device("cpu"))
    assert torch.equal(table.tiles[: eager.num_tiles].cpu(), eager.tiles)
    assert (table.tiles[eager.num_tiles:] == 0).all()  # padding tiles are empty


def test_static_tables_refuse_new_tables_while_frozen():
    from lightning_lorafusion.kernels.static_routing import StaticTableError

    base = AdapterBank(tiny_specs(), tiny_config()).routing((), 0, 128)
    tables = StaticLaunchTables(base, torch.device("cpu"))
    tables.freeze()
    with pytest.raises(StaticTableError, match="during capture"):
        tables.cache.get(("cpu", 32, ((4, 8, 0),)))
    tables.freeze(False)
    with pytest.raises(StaticTableError, match="key"):
        tables.cache.get(("cpu", 32))
    with pytest.raises(StaticTableError, match="one rank per adapter"):
        tables.cache.get(("cpu", 32, ((4, 8),)))


# ------------------------------------------------------------------- the whole step


def _setup(config, specs, seed=0, device=DEVICE):
    params = random_base_params(config, seed=seed, std=0.2, device=device)
    bank = AdapterBank(specs, config, dtype=torch.float32, device=device)
    with torch.no_grad():  # B = 0 at init would hide most of the LoRA path: start elsewhere
        g = torch.Generator().manual_seed(seed + 1)
        for p in bank.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(device) * 0.05)
    opts = [torch.optim.AdamW(bank.parameters_of(a), lr=s.lr) for a, s in enumerate(specs)]
    return params, bank, opts


def _eager_step(params, bank, config, mb, checkpoint_layers):
    from lightning_lorafusion.model.decoder import decoder_layers, embed, head_loss_sums

    routing = bank.routing(mb.segments, mb.index, mb.capacity)
    h = embed(params, mb.input_ids)
    h = decoder_layers(params, bank.view(), h, mb.position_ids, mb.cu_seqlens, routing, config=config,
                       microbatch_index=mb.index, backend="triton", max_seqlen=mb.max_seqlen,
                       checkpoint_layers=checkpoint_layers)
    sums = head_loss_sums(params, h, mb.labels, mb.segments, bank.num_adapters, config=config, chunk_size=32,
                          label_rows=mb.label_rows)
    adapter_loss(sums, mb.loss_denominators).backward()
    return sums.detach()


def _train(step, bank, opts, mbs):
    losses = []
    for mb in mbs:
        losses.append(step(mb))
        for a in mb.step_adapters:
            opts[a].step()
            opts[a].zero_grad(set_to_none=True)
    return torch.stack(losses)


@pytest.mark.parametrize("checkpoint_layers", [False, True])
def test_fixed_shape_step_equals_the_eager_step(checkpoint_layers):
    """The function a graph captures, run without capture (Triton interpreter, fp32), against
    the eager step: same per-adapter loss sums at every microbatch and the same weights after
    several optimizer steps, dropout on. fp32 tolerance: the two differ only in how dA/dB
    partial sums are split (summation order) and in padding rows that carry no loss."""
    config, specs = tiny_config(), tiny_specs()
    mbs = [mb.to(DEVICE) for mb in microbatches(config, capacity=64, samples=4, max_length=14, global_batch=2)]
    assert sum(len(mb.step_adapters) for mb in mbs) >= 3 and any(len(mb.adapters()) < 3 for mb in mbs)
    assert len({graph_key(mb) for mb in mbs}) < len(mbs)  # keys shared
    params, bank_e, opts_e = _setup(config, specs)
    losses_e = _train(lambda mb: _eager_step(params, bank_e, config, mb, checkpoint_layers), bank_e, opts_e, mbs)
    params, bank_s, opts_s = _setup(config, specs)
    graphs = TrainingGraphs(params=params, bank=bank_s, config=config, checkpoint_layers=checkpoint_layers,
                            chunk_size=32, capture=False)
    losses_s = _train(lambda mb: graphs.step(mb, mb.loss_denominators), bank_s, opts_s, mbs)
    assert not graphs.refusals
    torch.testing.assert_close(losses_s, losses_e, rtol=1e-5, atol=1e-6)
    for (name, pe), ps in zip(bank_e.named_parameters(), bank_s.parameters()):
        torch.testing.assert_close(ps, pe, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_fixed_shape_step_holds_the_modules_lm_head_loss():
    """With ``lm_head_loss="fused"`` the fixed-shape step forms the LM head's input gradient in
    the forward (fused linear cross-entropy): the same loss sums and adapter gradients as the
    checkpointed step on the same microbatch (fp32: summation order only)."""
    config, specs = tiny_config(), tiny_specs()
    mb = microbatches(config, capacity=64, samples=4, max_length=14, global_batch=2)[0].to(DEVICE)
    got = {}
    for head in ("checkpointed", "fused"):
        params, bank, _ = _setup(config, specs)
        graphs = TrainingGraphs(params=params, bank=bank, config=config, chunk_size=32, capture=False,
                                lm_head_loss=head)
        assert graphs.lm_head_loss == head
        sums = graphs.step(mb, mb.loss_denominators)
        got[head] = (sums, [p.grad.clone() for p in bank.parameters()])
    torch.testing.assert_close(got["fused"][0], got["checkpointed"][0], rtol=1e-5, atol=1e-6)
    assert any(g.abs().max() > 0 for g in got["checkpointed"][1])
    for gf, gc in zip(got["fused"][1], got["checkpointed"][1]):
        torch.testing.assert_close(gf, gc, rtol=1e-4, atol=1e-6)


def _dora_setup(config, specs, seed=0):
    """``_setup`` with the DoRA adapters bound to the base (``||W||^2`` kept), their perturbed
    magnitudes kept: ``g = m / ||W + s B A||`` is not 1, so the rescale shows."""
    params, bank, opts = _setup(config, specs, seed=seed)
    bank.init_dora(params, reset=())
    return params, bank, opts


def test_fixed_shape_step_with_dora_adapters_equals_the_eager_step():
    """DoRA adapters beside a plain LoRA adapter (with dropout) on shared projections: the
    fixed-shape step, which reads each row's adapter from the static ``row_owner`` and
    recomputes the DoRA norms from the current weights, gives the eager step's loss sums and,
    after several optimizer steps over microbatches of different row layouts (a DoRA adapter
    absent from some), the same factors and magnitudes. Tolerances as in the LoRA-only test."""
    config = tiny_config()
    specs = tiny_specs()
    specs = [specs[0], dataclasses.replace(specs[1], dropout=0.0, dora=True), dataclasses.replace(specs[2], dora=True)]
    mbs = [mb.to(DEVICE) for mb in microbatches(config, capacity=64, samples=4, max_length=14, global_batch=2)]
    layouts = {tuple(mb.segments) for mb in mbs}
    assert len(layouts) == len(mbs) and any(1 not in mb.adapters() or 2 not in mb.adapters() for mb in mbs)
    params, bank_e, opts_e = _dora_setup(config, specs)
    losses_e = _train(lambda mb: _eager_step(params, bank_e, config, mb, False), bank_e, opts_e, mbs)
    params, bank_s, opts_s = _dora_setup(config, specs)
    graphs = TrainingGraphs(params=params, bank=bank_s, config=config, chunk_size=32, capture=False)
    losses_s = _train(lambda mb: graphs.step(mb, mb.loss_denominators), bank_s, opts_s, mbs)
    assert not graphs.refusals
    torch.testing.assert_close(losses_s, losses_e, rtol=1e-5, atol=1e-6)
    names = [name for name, _ in bank_e.named_parameters()]
    assert sum("lora_magnitude" in n for n in names) > 0
    for name, pe, ps in zip(names, bank_e.parameters(), bank_s.parameters()):
        torch.testing.assert_close(ps, pe, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    start = _dora_setup(config, specs)[1]  # the magnitudes moved: their gradients were not zero
    moved = [n for (n, p0), p in zip(start.named_parameters(), bank_s.parameters())
             if "lora_magnitude" in n and not torch.equal(p0, p)]
    assert moved


def test_a_fixed_shape_step_refuses_dora_with_dropout():
    config = tiny_config()
    specs = [dataclasses.replace(s, dora=True) if i == 0 else s for i, s in enumerate(tiny_specs())]
    params, bank, _ = _dora_setup(config, specs)
    graphs = TrainingGraphs(params=params, bank=bank, config=config, chunk_size=32, capture=False)
    mb = microbatches(config, capacity=64, samples=4, max_length=14, global_batch=2)[0].to(DEVICE)
    with pytest.raises(ValueError, match="DoRA with dropout"):
        graphs.step(mb, mb.loss_denominators)


def test_grads_are_rebound_to_the_static_tensors():
    config, specs = tiny_config(), tiny_specs()
    params, bank, _ = _setup(config, specs, device="cpu")
    graphs = TrainingGraphs(params=params, bank=bank, config=config, capture=False)
    graphs._bind_grads()
    p0, p1, p2 = list(bank.parameters())[:3]
    static = [p.grad for p in (p0, p1, p2)]
    with torch.no_grad():
        for g in static:
            g.fill_(3.0)
    p0.grad = None  # zero_grad(set_to_none=True)
    p1.grad = torch.full_like(p1, 5.0)  # a restored checkpoint
    graphs._bind_grads()
    assert [p.grad for p in (p0, p1, p2)] == static or all(
        p.grad is g for p, g in zip((p0, p1, p2), static))
    assert (p0.grad == 0).all() and (p1.grad == 5).all() and (p2.grad == 3).all()


# ---------------------------------------------------------------------- fallbacks


def test_what_cannot_be_a_graph_and_why():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert "not on a CUDA GPU" in cuda_graphs_refusal(device=cpu, backend="triton", pipeline=False)
    assert "backend='torch'" in cuda_graphs_refusal(device=gpu, backend="torch", pipeline=False)
    # every pipeline stage may have graphs (the last fused, the earlier ones split per slot)
    assert cuda_graphs_refusal(device=gpu, backend="triton", pipeline=True) is None
    assert "ddp" in cuda_graphs_refusal(device=gpu, backend="triton", pipeline=False, world_size=2)
    assert "DoRA" in cuda_graphs_refusal(device=gpu, backend="triton", pipeline=False, dora_dropout="d")
    # only a DoRA adapter with dropout keeps graphs off, and the reason names it
    assert "'legal' is DoRA with dropout" in cuda_graphs_refusal(device=gpu, backend="triton", pipeline=False,
                                                                 dora_dropout="legal")
    assert cuda_graphs_refusal(device=gpu, backend="triton", pipeline=False) is None
    # a microbatch without host metadata takes the eager step, with the reason kept
    config = tiny_config()
    params, bank, _ = _setup(config, tiny_specs(), device="cpu")
    graphs = TrainingGraphs(params=params, bank=bank, config=config, capture=False)
    mb = dataclasses.replace(microbatches(config)[0], max_seqlen=None)
    assert graphs.step(mb, mb.loss_denominators) is None
    assert "max_seqlen" in graphs.refusals["metadata"]
    assert all(p.grad is None for p in bank.parameters())  # nothing ran


def test_module_cuda_graphs_option(tiny_model_dir):
    """`model.cuda_graphs`: a bad value is a ConfigError; 'on' where graphs cannot run (the CPU)
    stops fit with the reason; 'auto' on the CPU trains eagerly."""
    from test_equivalence import fit_joint, tiny_specs as fit_specs

    from lightning_lorafusion.training.module import LoRAFusionModule

    with pytest.raises(ConfigError, match="cuda_graphs"):
        LoRAFusionModule(base_model=tiny_model_dir, adapters=fit_specs(), cuda_graphs="yes")
    assert LoRAFusionModule(base_model=tiny_model_dir, adapters=fit_specs()).cuda_graphs == "auto"  # default
    for yaml_bool, mode in ((False, "off"), (True, "on")):  # a bare YAML off/on arrives as a boolean
        assert LoRAFusionModule(base_model=tiny_model_dir, adapters=fit_specs(), cuda_graphs=yaml_bool).cuda_graphs == mode
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="cuda_graph_precapture"):
            LoRAFusionModule(base_model=tiny_model_dir, adapters=fit_specs(), cuda_graph_precapture=bad)
    assert LoRAFusionModule(base_model=tiny_model_dir, adapters=fit_specs()).cuda_graph_precapture == 4
    with pytest.raises(ConfigError, match="not on a CUDA GPU"):
        fit_joint(tiny_model_dir, fit_specs(), module_kwargs={"cuda_graphs": "on"})
    module, _, _ = fit_joint(tiny_model_dir, fit_specs(), module_kwargs={"cuda_graphs": "auto"})
    assert module._graphs is None and module.steps_taken == [3, 3, 2]


# ------------------------------------------------------------------------- on a GPU


def _gpu_case(*, layers=3):
    """6 microbatches of 512 tokens, 2 of the 3 adapters in each, 12 adapter steps, 2 keys."""
    config = DecoderConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=layers,
                           num_heads=4, num_kv_heads=2, head_dim=32)
    specs = tiny_specs(dropout=0.1)
    mbs = [mb.to("cuda") for mb in microbatches(config, capacity=512, samples=8, max_length=100,
                                                  pad_multiple=128, global_batch=2)]
    return config, specs, mbs


def _gpu_dora_specs():
    """``tiny_specs`` with adapters b and c DoRA (no dropout) beside LoRA adapter a (dropout)."""
    a, b, c = tiny_specs(dropout=0.1)
    return [a, dataclasses.replace(b, dropout=0.0, dora=True), dataclasses.replace(c, dora=True)]


def _gpu_setup(config, specs, base_precision="bf16"):
    params = random_base_params(config, device="cuda", dtype=torch.bfloat16, seed=0, std=0.05)
    if base_precision == "fp8":
        from lightning_lorafusion.model.hf_loading import quantize_base_fp8

        params = quantize_base_fp8(params, embedding=True)
    elif base_precision == "nf4":
        from lightning_lorafusion.model.hf_loading import quantize_base_nf4

        params = quantize_base_nf4(params)
    bank = AdapterBank(specs, config, dtype=torch.float32, device="cuda")
    with torch.no_grad():
        g = torch.Generator(device="cuda").manual_seed(1)
        for p in bank.parameters():
            p.add_(torch.randn(p.shape, generator=g, device="cuda") * 0.02)
    bank.init_dora(params, reset=())  # DoRA adapters: their perturbed magnitudes kept (g is not 1)
    opts = [torch.optim.AdamW(bank.parameters_of(a), lr=s.lr) for a, s in enumerate(specs)]
    return params, bank, opts


def _fp8_tensor_cores() -> bool:
    if not CUDA:
        return False
    from lightning_lorafusion.kernels.fp8_linear import fp8_supported

    return fp8_supported(torch.device("cuda"))


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("checkpoint_layers,base_precision,dora,mlp_recompute,norms,lm_head_loss", [
    (False, "bf16", False, "none", False, "checkpointed"), (True, "bf16", False, "none", False, "checkpointed"),
    (False, "fp8", False, "none", False, "checkpointed"), (False, "bf16", True, "none", False, "checkpointed"),
    (False, "bf16", False, "gate_up", False, "checkpointed"), (2, "bf16", False, "activation", False, "checkpointed"),
    (False, "bf16", False, "activation", True, "checkpointed"), (False, "nf4", False, "activation", True, "checkpointed"),
    (False, "bf16", False, "none", False, "fused"),
    (False, "nf4", False, "activation", {"mlp_recompute_layers": 1, "norm_recompute_layers": 2}, "checkpointed"),
    (False, "nf4", False, "gate_up", True, "checkpointed")])
def test_replayed_graphs_train_like_eager_steps(checkpoint_layers, base_precision, dora, mlp_recompute, norms,
                                                lm_head_loss):
    """Captured + replayed training steps against eager steps from the same start, bf16,
    dropout 0.1, two epochs over the microbatches (so keys are replayed with new contents and
    adapters step several times). Tolerance: the two runs share every kernel except the
    dA/dB partial-sum split (fp32 summation order) and the attention launch's max_seqlen
    bucket, so losses agree to bf16 rounding (rtol 1e-2 on per-adapter sums); AdamW can flip
    the sign of near-zero gradients, so each weight may differ by up to 2 lr per step, and the
    updates as a whole (w - w0) must agree to 5% in norm. With the FP8 base both runs use the
    same e4m3 weights and per-row activation scales, so the same bounds hold. With DoRA
    adapters the graphs rescale rows by their owner read on the device (the same products).
    With ``mlp_recompute`` both runs rebuild the MLP tensors in backward (inside the graph), with
    ``norms`` (``norm_recompute``) the norm outputs too (``norms`` a dict: only the first layers
    rebuild, by ``mlp_recompute_layers`` / ``norm_recompute_layers``, so the captured step mixes
    per-layer modes); an NF4 base dequantizes in both. With
    the fused LM-head loss the graphs form the head's input gradient in the forward (the eager
    steps recompute checkpointed chunks): the same products in another order."""
    if base_precision == "fp8" and not _fp8_tensor_cores():
        pytest.skip("the FP8 base needs FP8 tensor cores (compute capability 8.9+)")
    torch.manual_seed(0)
    config, specs, mbs = _gpu_case()
    specs = _gpu_dora_specs() if dora else specs
    params, bank_e, opts_e = _gpu_setup(config, specs, base_precision)
    start = [p.detach().clone() for p in bank_e.parameters()]

    def eager(mb):
        routing = bank_e.routing(mb.segments, mb.index, mb.capacity)
        sums = forward_loss_sums(params, bank_e.view(), mb.input_ids, mb.labels, mb.position_ids, mb.cu_seqlens,
                                 routing, config=config, backend="triton", max_seqlen=mb.max_seqlen,
                                 label_rows=mb.label_rows, options=options)
        adapter_loss(sums, mb.loss_denominators).backward()
        return sums.detach()

    options = DecoderOptions(mlp_recompute=mlp_recompute, norm_recompute=bool(norms),
                             **(norms if isinstance(norms, dict) else {}))
    epochs = mbs + [dataclasses.replace(mb, index=mb.index + 100) for mb in mbs]
    losses_e = _train(eager, bank_e, opts_e, epochs)
    params, bank_g, opts_g = _gpu_setup(config, specs, base_precision)
    graphs = TrainingGraphs(params=params, bank=bank_g, config=config, checkpoint_layers=checkpoint_layers,
                            options=options, lm_head_loss=lm_head_loss)

    def replayed(mb):
        if graph_key(mb) not in graphs._graphs:
            return graphs.step(mb, mb.loss_denominators)
        torch.cuda.set_sync_debug_mode("error")  # a replayed step reads nothing back
        try:
            return graphs.step(mb, mb.loss_denominators)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    losses_g = _train(replayed, bank_g, opts_g, epochs)
    torch.cuda.synchronize()
    assert not graphs.refusals, graphs.refusals
    assert graphs.captures >= 1 and graphs.replays >= len(mbs)
    rel = ((losses_g - losses_e).abs() / losses_e.abs().clamp_min(1e-6)).max().item()
    print(f"\ngraphs vs eager (checkpoint_layers={checkpoint_layers}, {base_precision}, dora={dora}, "
          f"mlp_recompute={mlp_recompute}): {graphs.captures} graphs, "
          f"{graphs.replays} replays, worst relative loss-sum gap {rel:.2e}")
    torch.testing.assert_close(losses_g, losses_e, rtol=1e-2, atol=1e-3)
    steps = sum(len(mb.step_adapters) for mb in epochs)
    for (name, pe), pg, p0, spec_lr in zip(bank_e.named_parameters(), bank_g.parameters(), start,
                                           [specs[int(n.split(".")[1])].lr for n, _ in bank_e.named_parameters()]):
        assert (pg - pe).abs().max() <= 2 * spec_lr * steps, name
    upd_e = torch.cat([(pe - p0).flatten() for pe, p0 in zip(bank_e.parameters(), start)])
    upd_g = torch.cat([(pg - p0).flatten() for pg, p0 in zip(bank_g.parameters(), start)])
    assert upd_e.norm() > 0
    print(f"update gap |dg - de| / |de| = {((upd_g - upd_e).norm() / upd_e.norm()).item():.2e}, "
          f"worst weight gap {(upd_g - upd_e).abs().max().item():.2e}")
    assert (upd_g - upd_e).norm() <= 0.05 * upd_e.norm()


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA GPU")
def test_precaptured_graphs_replay_every_step_and_train_like_eager_steps():
    """Graphs captured before the epoch (``precapture``, idle warm-ups): the gradients held
    before them are unchanged bit for bit, every step of the epoch replays a graph (no capture
    mid-epoch, no eager step, no host sync), and losses and updates match eager steps within the
    bounds of ``test_replayed_graphs_train_like_eager_steps``."""
    torch.manual_seed(0)
    config, specs, mbs = _gpu_case()
    params, bank_e, opts_e = _gpu_setup(config, specs)
    start = [p.detach().clone() for p in bank_e.parameters()]

    def eager(mb):
        routing = bank_e.routing(mb.segments, mb.index, mb.capacity)
        sums = forward_loss_sums(params, bank_e.view(), mb.input_ids, mb.labels, mb.position_ids, mb.cu_seqlens,
                                 routing, config=config, backend="triton", max_seqlen=mb.max_seqlen,
                                 label_rows=mb.label_rows)
        adapter_loss(sums, mb.loss_denominators).backward()
        return sums.detach()

    losses_e = _train(eager, bank_e, opts_e, mbs)
    params, bank_g, opts_g = _gpu_setup(config, specs)
    g = torch.Generator(device="cuda").manual_seed(7)
    for p in bank_g.parameters():
        p.grad = torch.randn(p.shape, generator=g, device="cuda")
    held = [p.grad.clone() for p in bank_g.parameters()]
    graphs = TrainingGraphs(params=params, bank=bank_g, config=config)
    done = graphs.precapture(Counter(graph_key(mb) for mb in mbs), torch.device("cuda"))
    torch.cuda.synchronize()
    assert done and graphs.captures == len(done) and not graphs.refusals, graphs.refusals
    for p, h in zip(bank_g.parameters(), held):
        assert torch.equal(p.grad, h)
        p.grad = None

    def replayed(mb):
        torch.cuda.set_sync_debug_mode("error")  # every step replays: nothing read back
        try:
            return graphs.step(mb, mb.loss_denominators)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    losses_g = _train(replayed, bank_g, opts_g, mbs)
    torch.cuda.synchronize()
    assert graphs.captures == len(done) and graphs.replays == len(mbs) and not graphs.refusals
    torch.testing.assert_close(losses_g, losses_e, rtol=1e-2, atol=1e-3)
    upd_e = torch.cat([(pe - p0).flatten() for pe, p0 in zip(bank_e.parameters(), start)])
    upd_g = torch.cat([(pg - p0).flatten() for pg, p0 in zip(bank_g.parameters(), start)])
    assert upd_e.norm() > 0 and (upd_g - upd_e).norm() <= 0.05 * upd_e.norm()


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("capacity,pad_multiple", [(128, 128), (256, 16)])
def test_fit_with_cuda_graphs_on_matches_off(tiny_model_dir, capacity, pad_multiple):
    """Through the Trainer on one GPU (bf16-true, fused kernels, dropout 0.1): cuda_graphs on
    replays graphs and ends with the weights of cuda_graphs off (bf16: 0.05 absolute on
    weights of magnitude ~0.1-1 after a few AdamW steps at lr <= 1e-2). At capacity 256 with
    segments padded to 16 the microbatches are packed at several capacity levels (96, 144 and
    256 on the CPU's lengths): each level gets graphs of its own."""
    import lightning as L
    from test_equivalence import tiny_specs as fit_specs

    from lightning_lorafusion.training.datamodule import MultiAdapterDataModule
    from lightning_lorafusion.training.module import LoRAFusionModule

    runs = {}
    for mode in ("off", "on"):
        module = LoRAFusionModule(base_model=tiny_model_dir, adapters=fit_specs(dropout=0.1), backend="triton",
                                  dtype="bfloat16", grad_clip=0.0, export_on_fit_end=False, cuda_graphs=mode)
        dm = MultiAdapterDataModule(capacity=capacity, pad_multiple=pad_multiple, max_length=48, prefetch=2,
                                    planner={"method": "greedy", "window": 2})
        trainer = L.Trainer(accelerator="gpu", devices=1, max_epochs=2, precision="bf16-true", logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, datamodule=dm)
        runs[mode] = module
    graphs = runs["on"]._graphs
    assert graphs is not None and graphs.replays > 0 and not graphs.refusals, graphs and graphs.refusals
    levels = dm._capacity_levels
    assert {key.capacity for key in graphs._graphs} == set(levels)
    assert len(levels) == 1 if capacity == pad_multiple else len(levels) > 1, levels
    assert runs["off"]._graphs is None and runs["on"].steps_taken == runs["off"].steps_taken
    init = dict(AdapterBank(fit_specs(), runs["off"].config).named_parameters())
    off = {n: p.float() for n, p in runs["off"].bank.named_parameters()}
    on = {n: p.float() for n, p in runs["on"].bank.named_parameters()}
    upd_off = torch.cat([(off[n] - init[n].to(off[n].device)).flatten() for n in off])
    upd_on = torch.cat([(on[n] - init[n].to(on[n].device)).flatten() for n in off])
    ratio = ((upd_on - upd_off).norm() / upd_off.norm()).item()
    print(f"\nfit on vs off: {graphs.captures} graphs, {graphs.replays} replays, update gap {ratio:.2e}, "
          f"worst weight gap {(upd_on - upd_off).abs().max().item():.2e}")
    # bf16 weights and AdamW in bf16 (bf16-true): a broken replay (stale inputs, wrong masks,
    # lost gradients) moves the updates by O(100%); rounding by a few %
    assert upd_off.norm() > 0 and ratio <= 0.25
    for (name, p_off), p_on in zip(runs["off"].bank.named_parameters(), runs["on"].bank.parameters()):
        torch.testing.assert_close(p_on, p_off, rtol=0, atol=0.05, msg=lambda m, n=name: f"{n}: {m}")


def test_warm_up_pool_routing_calls_balance(monkeypatch):
    """``allocating_from(pool)`` begins routing this thread's allocations to the graphs' pool and
    ends and releases it on the way out; ``outside_pool`` inside it ends + releases, then begins again
    (each begin holds one reference to the pool, each release drops one); no pool: no calls."""
    from lightning_lorafusion.training import graph_pool as cg

    calls = []
    for name in ("_cuda_beginAllocateCurrentThreadToPool", "_cuda_endAllocateToPool", "_cuda_releasePool"):
        monkeypatch.setattr(torch._C, name, lambda index, pool, name=name: calls.append((name[6:11], index, pool)),
                            raising=False)
    dev = torch.device("cuda", 3)
    with cg.allocating_from(None, dev), cg.outside_pool(None, dev):
        pass
    assert calls == []
    with cg.allocating_from((7, 1), dev):
        with cg.outside_pool((7, 1), dev):
            calls.append("table")
    assert calls == [("begin", 3, (7, 1)), ("endAl", 3, (7, 1)), ("relea", 3, (7, 1)), "table",
                     ("begin", 3, (7, 1)), ("endAl", 3, (7, 1)), ("relea", 3, (7, 1))]
    refs = sum(1 if c[0] == "begin" else -1 if c[0] == "relea" else 0 for c in calls if c != "table")
    assert refs == 0


def test_a_covering_graph_runs_smaller_keys_exactly_and_own_captures_come_later():
    """A key without its own graph replays the cheapest captured key whose buckets are all at
    least as large: same losses and weights as eager steps. Only after ``capture_after``
    covered uses does the key run under itself (gets its own capture)."""
    config, specs = tiny_config(1), tiny_specs()
    mbs = [mb.to(DEVICE) for mb in microbatches(config, capacity=256, samples=4, max_length=100, global_batch=2)]
    keys = [graph_key(mb) for mb in mbs]
    big = max(range(len(mbs)), key=lambda i: (keys[i].label_rows, keys[i].max_seqlen, keys[i].num_blocks))
    smaller = [i for i in range(len(mbs)) if keys[i] != keys[big]]
    mbs = [mbs[i] for i in [big] + smaller[:2]]  # three microbatches keep the interpreter quick
    covered = [k for k in (graph_key(mb) for mb in mbs[1:]) if k != graph_key(mbs[0])]
    assert covered, "the case needs microbatches with a smaller key than the first"
    params, bank_e, opts_e = _setup(config, specs)
    losses_e = _train(lambda mb: _eager_step(params, bank_e, config, mb, False), bank_e, opts_e, mbs)
    params, bank_s, opts_s = _setup(config, specs)
    graphs = TrainingGraphs(params=params, bank=bank_s, config=config, chunk_size=32, capture=False,
                            capture_after=100)
    losses_s = _train(lambda mb: graphs.step(mb, mb.loss_denominators), bank_s, opts_s, mbs)
    assert graphs.covered_steps == len(covered) and graphs._static_keys == {graph_key(mbs[0])}
    torch.testing.assert_close(losses_s, losses_e, rtol=1e-5, atol=1e-6)
    for (name, pe), ps in zip(bank_e.named_parameters(), bank_s.parameters()):
        torch.testing.assert_close(ps, pe, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_choose_prefers_the_cheapest_cover_then_captures_a_recurring_key():
    config, specs = tiny_config(), tiny_specs()
    params, bank, _ = _setup(config, specs)
    graphs = TrainingGraphs(params=params, bank=bank, config=config, capture=False, capture_after=2)
    K = GraphKey
    graphs._static_keys |= {K(64, 64, 16, 64), K(64, 32, 8, 64), K(64, 64, 8, 128), K(32, 64, 64, 64)}
    small = K(64, 16, 8, 64)
    assert graphs._choose(small) == K(64, 32, 8, 64)  # cheapest of the two covers; other capacity never
    assert graphs._choose(small) == K(64, 32, 8, 64)
    assert graphs._choose(small) == small  # third use: its own
    assert graphs._choose(K(64, 128, 8, 64)) == K(64, 128, 8, 64)  # nothing covers it
    assert graphs._choose(K(64, 32, 8, 64)) == K(64, 32, 8, 64)  # held already
    assert graphs.covered_steps == 2


def test_precaptured_graphs_change_no_gradient_and_cover_the_epoch():
    """Graphs captured before an epoch: their warm-up steps run idle microbatches (no gradient
    changes, bit for bit); every planned microbatch then runs under a precaptured key, none gets
    a capture of its own mid-epoch (even with ``capture_after=0``), and training matches eager
    steps. A key nobody planned still gets its own capture after ``capture_after`` covered uses."""
    config, specs = tiny_config(1), tiny_specs()
    mbs = [mb.to(DEVICE) for mb in microbatches(config, capacity=256, samples=4, max_length=100, global_batch=2)]
    mbs = mbs[:3]
    planned = Counter(graph_key(mb) for mb in mbs)
    params, bank_e, opts_e = _setup(config, specs)
    losses_e = _train(lambda mb: _eager_step(params, bank_e, config, mb, False), bank_e, opts_e, mbs)
    params, bank_s, opts_s = _setup(config, specs)
    g = torch.Generator().manual_seed(5)
    for p in bank_s.parameters():  # gradients left from before: a warm-up must add nothing
        p.grad = torch.randn(p.shape, generator=g).to(DEVICE)
    before = [p.grad.clone() for p in bank_s.parameters()]
    graphs = TrainingGraphs(params=params, bank=bank_s, config=config, chunk_size=32, capture=False,
                            capture_after=0, max_precapture=1)
    done = graphs.precapture(planned, DEVICE)
    assert len(done) == 1 and all(covers(done[0], k) for k in planned)
    assert graphs._static_keys == set(done) and graphs.planned == frozenset(planned)
    for p, b in zip(bank_s.parameters(), before):
        assert torch.equal(p.grad, b)
    for p in bank_s.parameters():
        p.grad = None
    losses_s = _train(lambda mb: graphs.step(mb, mb.loss_denominators), bank_s, opts_s, mbs)
    assert graphs._static_keys == set(done)  # no capture of its own mid-epoch
    assert graphs.covered_steps == sum(n for k, n in planned.items() if k != done[0]) > 0
    torch.testing.assert_close(losses_s, losses_e, rtol=1e-5, atol=1e-6)
    for (name, pe), ps in zip(bank_e.named_parameters(), bank_s.parameters()):
        torch.testing.assert_close(ps, pe, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    # the next epoch's keys replace the planned set; keys held already need no new graph
    assert graphs.precapture(planned, DEVICE) == [] and graphs.planned == frozenset(planned)
    # a key outside the plan keeps the old rule: its own capture after capture_after (0) covered uses
    other = next(k for k in planned if k != done[0])
    assert graphs._choose(other) == done[0]
    assert graphs.precapture({}, DEVICE) == [] and graphs._choose(other) == other
