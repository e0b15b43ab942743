"""The input embedding table in pinned host memory (model/host_embedding.py): what it refuses on
any machine, and on a CUDA GPU the gather's rows and a captured graph reading them in place."""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.model.decoder import embed
from lightning_lorafusion.model.host_embedding import _HostArray, embedding_on_host, host_mapped


def test_the_interface_describes_the_host_bytes():
    host = torch.arange(12, dtype=torch.int16).reshape(3, 4)
    iface = _HostArray(host, "<i2").__cuda_array_interface__
    assert iface["shape"] == (3, 4) and iface["typestr"] == "<i2" and iface["data"] == (host.data_ptr(), False)


def test_refusals():
    table = torch.randn(16, 8)
    with pytest.raises(ValueError, match="CUDA device"):
        host_mapped(table, "cpu")
    with pytest.raises(ValueError, match="supports"):
        host_mapped(table.to(torch.float64), "cuda")
    with pytest.raises(ValueError, match="tied"):
        embedding_on_host({"embed": table, "lm_head": table})
    with pytest.raises(ValueError, match="on cpu"):
        embedding_on_host({"embed": table, "lm_head": torch.randn(16, 8)})
    with pytest.raises(ValueError, match="FP8"):
        embedding_on_host({"embed": {"weight_fp8": table}, "lm_head": table})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host-mapped memory is read by a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gather_from_host_memory_equals_the_device_table(dtype):
    table = torch.randn(1000, 64, device="cuda").to(dtype)
    params = {"embed": table, "lm_head": torch.randn(1000, 64, device="cuda").to(dtype)}
    moved = embedding_on_host(params)
    assert moved["lm_head"] is params["lm_head"] and moved["embed"].is_cuda
    ids = torch.randint(0, 1000, (333,), device="cuda")
    before = torch.cuda.memory_allocated()
    torch.testing.assert_close(embed(moved, ids), embed(params, ids), rtol=0, atol=0)
    # the view holds no device memory of its own
    assert torch.cuda.memory_allocated() - before < table.numel() * table.element_size()
    static_ids = ids.clone()
    out = torch.empty(333, 64, device="cuda", dtype=dtype)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out.copy_(embed(moved, static_ids))  # warm-up
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out.copy_(embed(moved, static_ids))
    static_ids.copy_(torch.randint(0, 1000, (333,), device="cuda"))
    graph.replay()
    torch.testing.assert_close(out, table[static_ids], rtol=0, atol=0)
