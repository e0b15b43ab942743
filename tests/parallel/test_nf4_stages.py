"""Pipeline stages over an NF4 base (QLoRA): the decoder cut into stages (``DecoderStage``, what
the pipeline's executor runs on each rank) gives the one-process losses and adapter gradients
over the same 4-bit weights (CPU, torch reference; tests/parallel/test_strategy.py runs the
executor itself over a 16-bit and an FP8 base)."""

from __future__ import annotations

import torch

from lightning_lorafusion.kernels.nf4 import is_nf4
from lightning_lorafusion.model import decoder as dec
from lightning_lorafusion.model.hf_loading import quantize_base_nf4
from lightning_lorafusion.model.random_model import random_base_params
from lightning_lorafusion.parallel.stage import DecoderStage, adapter_loss

from . import pipeline_case as case


def test_stages_over_an_nf4_base_train_like_one_process():
    # the pipeline case's model at whole NF4 blocks (every projection a multiple of 64 values)
    config = dec.DecoderConfig(vocab_size=61, hidden_size=64, intermediate_size=192, num_layers=4, num_heads=4,
                               num_kv_heads=2, head_dim=16)
    params = quantize_base_nf4(random_base_params(config, device="cpu", dtype=torch.float32, std=0.2))
    assert is_nf4(params["layers"][0]["q_proj"]) and is_nf4(params["layers"][3]["down_proj"])
    _, per_replica = case.samples_and_plan(2)
    mbs = per_replica[0]
    banks = [case.make_bank(config) for _ in range(2)]
    first, last = (DecoderStage(params=params, bank=banks[1], config=config, layers=r, is_first=r.start == 0,
                                is_last=r.stop == 4, microbatches=mbs.__getitem__) for r in (range(0, 3), range(3, 4)))
    assert len(mbs) > 1 and any(len(mb.adapters()) > 1 for mb in mbs.values())
    for i, mb in mbs.items():
        routing = banks[0].routing(mb.segments, mb.index, mb.capacity)
        sums = dec.forward_loss_sums(params, banks[0].view(), mb.input_ids, mb.labels, mb.position_ids, mb.cu_seqlens,
                                     routing, config=config)
        want = adapter_loss(sums, mb.loss_denominators)
        want.backward()
        h = first.forward(None, i)
        x = h.detach().requires_grad_(True)
        loss = last.forward(x, i)
        loss.backward()
        h.backward(x.grad)
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-7)
    for (name, p), q in zip(banks[0].named_parameters(), banks[1].parameters()):
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
