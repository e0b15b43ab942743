"""Page-ins by layer (``EngineTuning.page_in_wait="layer"``): an adapter's copy in slices of
layers (``page_in_layers.layer_chunks``), a step's waits for them layer by layer
(``LayerWaits``), and, through the engine with the copies' events simulated on the CPU (where
the real copy is synchronous), that a layer's LoRA never reads a pool element whose copy is not
ordered before it, while the first layer does not wait for the later layers' slices."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from lightning_lorafusion.model.decoder import DecoderConfig
from lightning_lorafusion.serving import GenerationRequest, SamplingParams
from lightning_lorafusion.serving import paged_forward
from lightning_lorafusion.serving.adapters import host_adapter_from_factors
from lightning_lorafusion.serving.config import ConfigError, EngineTuning
from lightning_lorafusion.serving.mixed_graphs import MixedPieces
from lightning_lorafusion.serving.page_in_layers import (LayerWaits, copy_waves, layer_chunks, page_in_groups,
                                                         step_layer_waits)
from lightning_lorafusion.specs import LoraLayout

CFG = DecoderConfig.from_hf(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=5,
                                        num_attention_heads=4, num_key_value_heads=2))


def _adapter(targets=("q_proj", "v_proj", "down_proj"), layers=None, rank=4):
    g = torch.Generator().manual_seed(0)
    used = range(CFG.num_layers) if layers is None else layers
    factors = {(layer, m): (torch.randn(rank, CFG.module_dims(m)[0], generator=g),
                            torch.randn(CFG.module_dims(m)[1], rank, generator=g))
               for layer in used for m in targets}
    layout = LoraLayout(rank=rank, alpha=8.0, target_modules=tuple(targets),
                        layers_to_transform=None if layers is None else tuple(layers))
    return host_adapter_from_factors("a", factors, rank=rank, alpha=8.0, config=CFG, dtype=torch.float32, pin=False,
                                     layout=layout)


@pytest.mark.parametrize("layers", [None, (1, 3)])  # (1, 3): shared zero slots for the other layers
@pytest.mark.parametrize("groups", [1, 2, 5, 9])
def test_layer_chunks_cover_the_buffer_and_hold_each_layer_by_its_first_layer(layers, groups):
    adapter = _adapter(layers=layers)
    chunks = layer_chunks(adapter, CFG.num_layers, groups)
    assert chunks[0][:2] == (0, 0) and chunks[-1][2] == adapter.numel
    assert all(a[2] == b[1] and a[0] < b[0] for a, b in zip(chunks, chunks[1:]))  # in order, no gap
    # (layers without weights of their own, sharing the zero slots, get no slice)
    want = {1: 1, 2: 2}.get(groups, CFG.num_layers if layers is None else 3)
    assert len(chunks) == want
    ranks = dict(zip(("q_proj", "v_proj", "down_proj"), (4, 4, 4)))
    for (layer, module), s in adapter.slots.items():
        copied_by = max(e for f, _, e in chunks if f <= layer)  # what is ordered before layer's kernels
        assert s.b + ranks[module] * s.out_features <= copied_by, (layer, module)
    if groups >= CFG.num_layers and layers is None:  # one slice per layer, each holding its layer
        assert [f for f, _, _ in chunks] == list(range(CFG.num_layers))


def test_copy_waves_are_layer_major_and_slices_stay_in_order():
    """Wave g: slice g of every adapter that has one, so every adapter's first layers are copied
    before any adapter's later ones; each adapter's slices keep their order."""
    a, b = _adapter(), _adapter(layers=(1, 3))
    plans = [layer_chunks(a, CFG.num_layers, 5), layer_chunks(b, CFG.num_layers, 5), [(0, 0, 10)]]
    waves = copy_waves(plans)
    assert len(waves) == 5 and waves[0] == [(0, plans[0][0]), (1, plans[1][0]), (2, (0, 0, 10))]
    assert [i for i, _ in waves[3]] == [0] and waves[4] == [(0, plans[0][4])]
    for i, plan in enumerate(plans):
        assert [c for rd in waves for j, c in rd if j == i] == plan
    firsts = [max(c[0] for _, c in rd) for rd in waves]
    assert firsts == sorted(firsts)
    assert copy_waves([]) == []


def test_page_in_groups_follow_the_mode():
    assert page_in_groups(32, "layer") == 8 and page_in_groups(5, "layer") == 5 and page_in_groups(32, "step") == 1
    with pytest.raises(ValueError, match="page_in_wait='slice'"):
        page_in_groups(32, "slice")


class FakeEvent:
    def __init__(self, name):
        self.name = name


def test_layer_waits_order_each_slice_before_its_first_layer():
    waited = []
    e = {k: FakeEvent(k) for k in ("a0", "a2", "b0", "b1", "b4")}
    waits = LayerWaits([(0, e["a0"]), (2, e["a2"]), (0, e["b0"]), (1, e["b1"]), (4, e["b4"])],
                       lambda ev: waited.append(ev.name))
    waits.before(0)
    assert waited == ["a0", "b0"]
    waits.before(0)
    waits.before(3)
    assert waited == ["a0", "b0", "b1", "a2"] and waits
    waits.rest()
    assert waited[-1] == "b4" and not waits


class _Resident:
    def __init__(self, ready, layer_ready):
        self.ready, self.layer_ready = ready, layer_ready


def test_a_step_takes_over_its_adapters_pending_slices():
    whole, s0, s1 = FakeEvent("whole"), FakeEvent("s0"), FakeEvent("s1")
    sliced, copied, landed = _Resident(s1, [(0, s0), (3, s1)]), _Resident(whole, None), _Resident(None, None)
    waited = []
    waits = step_layer_waits([sliced, copied, landed], lambda ev: waited.append(ev.name))
    assert all(r.ready is None and r.layer_ready is None for r in (sliced, copied, landed))
    waits.before(2)
    assert sorted(waited) == ["s0", "whole"]
    waits.before(3)
    assert waited[-1] == "s1"
    assert step_layer_waits([landed], waited.append) is None


def test_page_in_wait_is_checked():
    assert EngineTuning().page_in_wait == "layer"
    with pytest.raises(ConfigError, match="page_in_wait='all'"):
        EngineTuning(page_in_wait="all")


class CopyLog:
    """Simulated page-in copies on the CPU: each slice's event covers its adapter's elements from
    its first one to the slice's end (the copy stream runs in order); the compute stream's waits
    are recorded, and every prefill LoRA call checks the pool elements it reads."""

    def __init__(self, pool):
        self.pool, self.waited, self.issued, self.layer = pool, [], [], None
        self.first_layer_pending = []  # per LoRA call of layer 0: slices of later layers not yet waited

    def copy_in(self, r, start, n, sliced=False):
        self.pool.storage[r.offset:r.offset + r.adapter.numel].copy_(r.adapter.flat)
        slices = []
        for first, _a, b in layer_chunks(r.adapter, self.pool.num_layers, self.pool.page_in_groups):
            ev = FakeEvent((r.offset, r.offset + b))
            self.issued.append((first, ev))
            slices.append((first, ev))
        r.ready = slices[-1][1]
        r.layer_ready = slices if len(slices) > 1 else None

    def covered(self, lo, hi):
        return any(a <= lo and hi <= b for a, b in (ev.name for ev in self.waited))

    def check(self, x, lora, outs):
        k = x.shape[1]
        a_off, b_off, ranks = (t.tolist() for t in (lora.a_offsets, lora.b_offsets, lora.ranks))
        for g, y in enumerate(outs):
            for _, _, ad in lora.segments:
                r = ranks[g][ad]
                if r:
                    assert self.covered(a_off[g][ad], a_off[g][ad] + r * k), "A read before its copy is ordered"
                    assert self.covered(b_off[g][ad], b_off[g][ad] + r * y.shape[1]), "B read before its copy"
        if self.layer == 0:
            waited = set(map(id, self.waited))
            self.first_layer_pending.append(sum(1 for f, ev in self.issued if f > 0 and id(ev) not in waited))


def _run(engine, log) -> dict[str, list[int]]:
    tokens = {}
    arrive_at = {0: [("all4", 9), (None, 5)], 2: [("attn2", 13)], 3: [("mlp8", 7), ("all4", 4)]}
    for step in range(30):
        for j, (adapter, n) in enumerate(arrive_at.get(step, [])):
            engine.submit(GenerationRequest(prompt_token_ids=[(step * 5 + 3 * i + j) % 60 + 1 for i in range(n)],
                                            adapter=adapter, request_id=f"s{step}-{j}",
                                            sampling=SamplingParams(max_new_tokens=3, temperature=0.0,
                                                                    ignore_eos=True)))
        for ev in engine.step():
            if ev.token_id is not None:
                tokens.setdefault(ev.request_id, []).append(ev.token_id)
    return tokens


@pytest.mark.parametrize("pieces", ["off", "eager"])
def test_each_layer_reads_only_slices_ordered_before_it(make_engine, monkeypatch, pieces):
    """Engine steps with fresh page-ins, eager and as mixed-step pieces: every prefill LoRA read
    lies in copies the compute stream was ordered after; with "layer" the first layer runs with
    later layers' slices still pending (with "step" none is); the tokens agree."""
    runs, pending = {}, {}
    real_layer, real_lora = paged_forward.decoder_layer, paged_forward.segment_lora_add
    real_piece = MixedPieces.piece
    for mode in ("layer", "step"):
        engine = make_engine(num_pages=128, page_size=4, page_in_wait=mode, mixed_graphs=pieces, async_decode="off",
                             prefix_caching=False, prefetch_depth=0)
        log = CopyLog(engine.pool)
        monkeypatch.setattr(engine.pool, "_copy_in", log.copy_in)
        monkeypatch.setattr(engine.pool, "order_after", log.waited.append)

        def layer_hook(m, layer, *args, _log=log):
            _log.layer = layer
            return real_layer(m, layer, *args)

        def lora_hook(x, lora, outs, _log=log, **kw):
            _log.check(x, lora, outs)
            return real_lora(x, lora, outs, **kw)

        monkeypatch.setattr(paged_forward, "decoder_layer", layer_hook)
        monkeypatch.setattr(paged_forward, "segment_lora_add", lora_hook)
        if pieces == "eager":
            def piece_hook(self, i, _log=log):
                _log.layer = i
                return real_piece(self, i)
            monkeypatch.setattr(MixedPieces, "piece", piece_hook)
        runs[mode] = _run(engine, log)
        pending[mode] = log.first_layer_pending
        assert engine.pool.page_ins >= 3 and log.issued
    assert runs["layer"] == runs["step"] and len(runs["layer"]) == 5
    assert any(pending["layer"]) and not any(pending["step"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy stream and its events need a GPU")
def test_real_page_in_slices_change_no_token_gpu(make_engine, monkeypatch):
    """On CUDA: the copies run in slices on the copy stream and steps wait for them by layer
    (as captured mixed-step pieces); greedy tokens equal with the whole copy waited before the step."""
    from lightning_lorafusion.serving import runner as runner_mod

    runs, taken = {}, []
    real = runner_mod.step_layer_waits

    def spy(residents, wait):
        waits = real(residents, wait)
        taken.append(waits is not None)
        return waits

    monkeypatch.setattr(runner_mod, "step_layer_waits", spy)
    for mode in ("layer", "step"):
        engine = make_engine(num_pages=256, page_size=4, page_in_wait=mode, backend="triton", async_decode="off",
                             prefix_caching=False, prefetch_depth=0)
        runs[mode] = _run(engine, None)
    assert runs["layer"] == runs["step"] and len(runs["layer"]) == 5
    assert any(taken)
