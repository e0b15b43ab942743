"""Elementwise fusion (torch.compile of norm/RoPE/SwiGLU groups) changes nothing but speed.

CI traces the fused groups with the ``aot_eager`` compiler (graph capture and the AOTAutograd
backward, no code generation, which would take minutes on 2 cores); the inductor path runs on
the GPU in scripts/bench_e2e.py and scripts/bench_convergence.py."""

import pytest
import torch

from _tiny_hf import tiny_hf_model
from lightning_lorafusion.model import decoder as D
from lightning_lorafusion.model.adapter_bank import AdapterBank
from lightning_lorafusion.kernels import fp8_linear as F8
from lightning_lorafusion.model.hf_loading import params_from_hf_model, quantize_base_fp8
from lightning_lorafusion.specs import AdapterSpec


def _loss_and_grads(config, params, bank, ids, labels, pos, cu, options):
    routing = bank.routing([(0, 12, 0), (12, 20, 1)], 5, 20)
    sums = D.forward_loss_sums(params, bank.view(), ids, labels, pos, cu, routing, config=config, options=options)
    grads = torch.autograd.grad(sums.sum(), list(bank.parameters()))
    return sums.detach(), grads


def test_fused_layers_equal_eager_layers():
    model = tiny_hf_model("qwen2", num_hidden_layers=2)  # qkv bias too
    config, params = params_from_hf_model(model)
    specs = [AdapterSpec(name="a", rank=4, alpha=8, dropout=0.1, seed=1),
             AdapterSpec(name="b", rank=2, alpha=2, seed=2, target_modules=("q_proj", "down_proj"))]
    bank = AdapterBank(specs, config)
    with torch.no_grad():  # non-zero B so LoRA terms reach every fused group
        for p in bank.parameters():
            p.normal_(0.0, 0.1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (20,), generator=g)
    labels = torch.randint(0, config.vocab_size, (20,), generator=g)
    cu = torch.tensor([0, 7, 12, 20], dtype=torch.int32)
    pos = torch.cat([torch.arange(7), torch.arange(5), torch.arange(8)])

    off = D.DecoderOptions(elementwise_fusion="off")
    ref_sums, ref_grads = _loss_and_grads(config, params, bank, ids, labels, pos, cu, off)
    on = D.DecoderOptions(elementwise_fusion="on", fusion_compiler="aot_eager")
    assert D._fuse("torch", ids, on)
    sums, grads = _loss_and_grads(config, params, bank, ids, labels, pos, cu, on)
    assert any(fn is D._swiglu for fn, _ in D._COMPILED)  # the compiled groups really ran
    torch.testing.assert_close(sums, ref_sums, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert all(w.abs().sum() > 0 for w in ref_grads)


def test_fusion_mode_rules():
    x = torch.zeros(2)
    auto = D.DecoderOptions()
    assert auto.elementwise_fusion == "auto"  # the default
    assert not D._fuse("triton", x, auto)  # CPU tensor: eager
    assert not D._fuse("torch", x, auto)
    assert not D._fuse("triton", x, D.DecoderOptions(elementwise_fusion="off"))
    with pytest.raises(ValueError, match="'auto', 'on', 'off'"):
        D.DecoderOptions(elementwise_fusion="always")


def test_fusion_mode_is_not_read_from_the_environment(monkeypatch):
    # the decoder's options are arguments: an environment variable changes nothing
    monkeypatch.setenv("LORAFUSION_FUSE_ELEMENTWISE", "on")
    assert D.DecoderOptions().elementwise_fusion == "auto"
    assert not D._fuse("torch", torch.zeros(2), D.DecoderOptions())


@pytest.mark.parametrize("checkpoint", [False, True], ids=["saved", "recomputed"])
def test_decoder_with_fused_fp8_swiglu_equals_the_unfused_one(monkeypatch, checkpoint):
    """FP8 base: SwiGLU quantizing h for down and the gate/up gradient for dX
    (``fp8_linear.Fp8SwiGLU``) against the decoder without it, every layer taking both offers.
    CPU (emulated FP8, fused kernels in the interpreter, fp32): loss and gradients bit for bit
    (the emulated SwiGLU is the eager ops and the spec's quantization). GPU (real FP8, bf16):
    its Triton SwiGLU rounds like inductor's up to bf16 ulps, so close, not equal. Recomputed
    (activation checkpointing): the recomputed forward makes and takes its own input offers
    (twice per layer in all), the backward's gradient offers still reach the gate/up products."""
    cuda = torch.cuda.is_available()
    # every projection width a multiple of 16 (FP8 products), head_dim 16
    model = tiny_hf_model("llama", num_hidden_layers=2, hidden_size=64, intermediate_size=96)
    if cuda:
        model = model.to("cuda", torch.bfloat16)
    config, params = params_from_hf_model(model)
    params = quantize_base_fp8(params, embedding=True)
    specs = [AdapterSpec(name="a", rank=4, alpha=8, dropout=0.1, seed=1),
             AdapterSpec(name="b", rank=2, alpha=2, seed=2, target_modules=("gate_proj", "down_proj"))]
    bank = AdapterBank(specs, config, device=model.device, dtype=torch.float32)
    with torch.no_grad():
        for p in bank.parameters():
            p.normal_(0.0, 0.1)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (32,), generator=gen).to(model.device)
    labels = torch.randint(0, config.vocab_size, (32,), generator=gen).to(model.device)
    cu = torch.tensor([0, 7, 12, 32], dtype=torch.int32, device=model.device)
    pos = torch.cat([torch.arange(7), torch.arange(5), torch.arange(20)]).to(model.device)
    taken = {"input": 0, "grad": 0}
    take_in, take_grad = F8.QuantizedOperands.take_input, F8.QuantizedOperands.take_grad

    def count(kind, fn):
        def wrapped(*args):
            out = fn(*args)
            taken[kind] += out is not None
            return out
        return wrapped

    monkeypatch.setattr(F8.QuantizedOperands, "take_input", count("input", take_in))
    monkeypatch.setattr(F8.QuantizedOperands, "take_grad", count("grad", take_grad))
    fused = D.fp8_swiglu

    def run(on):
        # the unfused decoder: the same layers with the SwiGLU the decoder runs without an FP8 MLP
        # (compiled on CUDA, where elementwise fusion is on: one rounding to bf16, as the fused one)
        plain = D._compiled(D._swiglu, D.DEFAULT_OPTIONS.fusion_compiler) if cuda else D._swiglu
        unfused = lambda g, u, gate, up, operands: plain(g, u)  # noqa: E731
        monkeypatch.setattr(D, "fp8_swiglu", fused if on else unfused)
        routing = bank.routing([(0, 12, 0), (12, 32, 1)], 5, 32)
        h = D.embed(params, ids)
        h = D.decoder_layers(params, bank.view(), h, pos, cu, routing, config=config, backend="triton",
                             checkpoint_layers=checkpoint)  # (the interpreter on CPU)
        sums = D.head_loss_sums(params, h, labels, routing.segments, routing.num_adapters, config=config)
        return sums.detach(), torch.autograd.grad(sums.sum(), list(bank.parameters()))

    off_sums, off_grads = run(False)
    assert taken == {"input": 0, "grad": 0}
    on_sums, on_grads = run(True)
    assert taken == {"input": config.num_layers * (2 if checkpoint else 1), "grad": config.num_layers}
    if not cuda:
        assert torch.equal(on_sums, off_sums)
        for a, b in zip(on_grads, off_grads):
            assert torch.equal(a, b)
        return
    torch.testing.assert_close(on_sums, off_sums, rtol=1e-2, atol=1e-2)
    for a, b in zip(on_grads, off_grads):
        assert (a - b).norm() <= 3e-2 * b.norm()


def test_auto_backend_is_resolved_before_the_layers_see_it(monkeypatch):
    """Callers pass ``backend="auto"`` (the module's default, which pipeline stages forward as it
    is): the layers must receive the resolved name, since the elementwise fusion and the FP8 MLP
    are chosen by comparing it with "triton". On a CPU tensor "auto" is the torch reference; a
    CUDA device resolves to "triton"."""
    model = tiny_hf_model("llama", num_hidden_layers=2)
    config, params = params_from_hf_model(model)
    seen = []
    monkeypatch.setattr(D, "decoder_layer", lambda *a, backend, **k: seen.append(backend) or a[2])
    h = torch.zeros(5, config.hidden_size)
    D.decoder_layers(params, {}, h, torch.arange(5), torch.tensor([0, 5], dtype=torch.int32), None,
                     config=config, backend="auto")
    assert seen == ["torch", "torch"]
    cuda = torch.device("cuda")  # a device name only: no GPU needed
    assert D.resolve_backend("auto", cuda) == "triton"
    assert D.resolve_backend("torch", cuda) == "torch" and D.resolve_backend("triton", h.device) == "triton"


def test_a_fused_group_compiles_past_dynamos_default_limit_of_eight_shapes():
    """With static shapes each capacity compiles a fused group again; under ``fullgraph=True``
    dynamo's default limit (8 variants) would fail the ninth shape (a run at three capacity
    levels, its capacity probe, a second fit in the process). ``_compiled`` raises the limit."""
    from lightning_lorafusion.model import decoder

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * 2.0 + 1.0

    before = torch._dynamo.config.recompile_limit
    try:
        torch._dynamo.config.recompile_limit = 8
        fn = decoder._compiled(scaled, "eager")
        assert torch._dynamo.config.recompile_limit == decoder.RECOMPILE_LIMIT
        for n in range(1, 13):  # twelve shapes
            x = torch.arange(n, dtype=torch.float32)
            torch.testing.assert_close(fn(x), x * 2.0 + 1.0)
    finally:
        torch._dynamo.config.recompile_limit = before
        decoder._COMPILED.pop((scaled, "eager"), None)
