"""How far do the recomputation options' losses and LoRA gradients land from the keeping step's?

Per base (bf16, NF4) and elementwise fusion (``auto``: compiled norms and activation on a GPU;
``off``: eager; ``split``: compiled, the MLP's residual add outside its norm; ``unrounded``:
eager, the residual add + norm normalising the unrounded sum, a CPU stand-in for what the fused
compiled group may do), one training step of every (``mlp_recompute``, ``norm_recompute``)
setting over the same packed microbatch (two adapters) against the keeping step (``none``, no
rebuilt norms) of the same base and fusion: the loss gap and, over every adapter tensor, the
largest ``|a - b| / max|b|`` and ``||a - b|| / ||b||``, the tensor where it is largest, and the
elements the former elementwise bar of the GPU memory test (rtol 2e-2, atol 2e-3 max|b|)
rejects. A row "X vs Y" compares the keeping steps of two fusions: two correct steps that round
differently. With ``--fp32-reference`` each bf16 row also gives its ``||a - b|| / ||b||``
against the keeping step in fp32: how far a correct bf16 step lands. Recomputation runs the same
functions on the same inputs, so with eager elementwise work every gap is 0; where a rebuilt
norm output differs from the forward's in the last bit, "gate_up" reruns gate/up on it and
every gradient before that MLP moves by bf16 rounding. Prints a table; JSON to ``--out``::

    python scripts/check_recompute_gradients.py --fusions auto,split,off --fp32-reference --out results/recompute
    python scripts/check_recompute_gradients.py --device cpu --bases bf16 --layers 2 --tokens 512 --hidden 256 \
        --intermediate 1024 --heads 4 --kv-heads 2 --vocab 512 --dropout 0 --fusions off,unrounded --fp32-reference
"""

from __future__ import annotations

import argparse
import contextlib

from harness import Report, add_output_args, comma_list, default_device, logger

import torch  # noqa: E402  (after harness, which puts the repository on sys.path)

from lightning_lorafusion.model.adapter_bank import AdapterBank  # noqa: E402
from lightning_lorafusion.model.decoder import DecoderConfig, DecoderOptions, forward_loss_sums  # noqa: E402
from lightning_lorafusion.model.hf_loading import quantize_base_nf4  # noqa: E402
from lightning_lorafusion.model.random_model import random_base_params  # noqa: E402
from lightning_lorafusion.specs import AdapterSpec  # noqa: E402

log = logger("recompute")
SETTINGS = [(m, n) for n in (False, True) for m in ("none", "activation", "gate_up")]  # (mlp_recompute, norms)
PLAIN = ("none", False)


def test_bar_failures(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements outside the GPU memory test's bar: rtol 2e-2, atol max(1e-4, 2e-3 max|b|)."""
    atol = max(1e-4, 2e-3 * float(b.abs().max()))
    return int(((a - b).abs() > atol + 2e-2 * b.abs()).sum())


def gaps(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict:
    """The largest scaled gaps of ``grads`` from ``ref`` over the adapter tensors."""
    rel_max = {n: float((g - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-30)) for n, g in grads.items()}
    rel_norm = {n: float((g - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)) for n, g in grads.items()}
    worst = max(rel_norm, key=rel_norm.get)
    return {"rel_max": max(rel_max.values()), "rel_norm": rel_norm[worst], "worst": worst,
            "bar_failures": sum(test_bar_failures(g, ref[n]) for n, g in grads.items()),
            "exact": all(torch.equal(g, ref[n]) for n, g in grads.items())}


def build(a: argparse.Namespace, device: str, dtype: torch.dtype, base: str):
    config = DecoderConfig(model_type="llama", num_layers=a.layers, vocab_size=a.vocab, hidden_size=a.hidden,
                           intermediate_size=a.intermediate, num_heads=a.heads, num_kv_heads=a.kv_heads,
                           head_dim=a.hidden // a.heads)
    params = random_base_params(config, device=device, dtype=dtype)
    params = quantize_base_nf4(params) if base == "nf4" else params
    specs = [AdapterSpec(name=f"a{i}", rank=16, alpha=32, lr=1e-3, global_batch_size=1, seed=i, dropout=a.dropout,
                         dataset={"kind": "synthetic", "distribution": "xsum", "num_samples": 2, "seed": i})
             for i in range(2)]
    bank = AdapterBank(specs, config, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in bank.parameters():  # B away from zero, so every LoRA term is live
            p.add_(torch.randn(p.shape, device=device, generator=gen).to(dtype) * 0.02)
    return config, params, bank


def step(config, params, bank, setting, fusion: str, backend: str, tokens: int, wrong_rebuild: bool = False):
    """One step's per-adapter losses and LoRA gradients (fp32 copies)."""
    device = next(bank.parameters()).device
    for p in bank.parameters():
        p.grad = None
    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (tokens,), device=device, generator=gen)
    labels = torch.randint(0, config.vocab_size, (tokens,), device=device, generator=gen)
    quarter = tokens // 4
    routing = bank.routing([(0, 2 * quarter, 0), (2 * quarter, tokens, 1)], 0, tokens)
    cu = torch.tensor([0, quarter, 2 * quarter, tokens], dtype=torch.int32, device=device)
    pos = torch.cat([torch.arange(quarter), torch.arange(quarter), torch.arange(tokens - 2 * quarter)]).to(device)
    options = DecoderOptions(elementwise_fusion={"split": "on", "unrounded": "off"}.get(fusion, fusion),
                             mlp_recompute=setting[0], norm_recompute=setting[1])
    with add_norm_variant(fusion), (rows_off_by_one() if wrong_rebuild else contextlib.nullcontext()):
        loss = forward_loss_sums(params, bank.view(), ids, labels, pos, cu, routing, config=config, backend=backend,
                                 options=options)
        (loss / tokens).sum().backward()
    return loss.detach().float(), {n: p.grad.float().clone() for n, p in bank.named_parameters()}


@contextlib.contextmanager
def rows_off_by_one():
    """Within, a deliberately wrong rebuild: the rebuilt norm output is read one row off (what a
    rebuild token pointing at the wrong tensor or view would give), to show a real error's size."""
    from lightning_lorafusion.model import decoder as dec
    from lightning_lorafusion.model.rebuilt_copies import rebuilt_in_backward

    rebuilt_norm = dec._rebuilt_norm

    def wrong(enabled, x, norm, h, weight, eps):
        if not enabled:
            return contextlib.nullcontext()
        return rebuilt_in_backward(x, lambda source: norm(source, weight, eps).roll(1, 0).contiguous(), h)

    dec._rebuilt_norm = wrong
    try:
        yield
    finally:
        dec._rebuilt_norm = rebuilt_norm


def unrounded_add_rms_norm(h: torch.Tensor, o: torch.Tensor, weight: torch.Tensor, eps: float):
    """``family.add_rms_norm`` normalising the fp32 sum before rounding it, as a fused compiled
    group may: the rebuild (the norm of the rounded sum) then differs in the last bit."""
    s = h.float() + o.float()
    x = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    return s.to(h.dtype), weight * x.to(h.dtype)


@contextlib.contextmanager
def add_norm_variant(fusion: str):
    """Within, the decoder's residual add + norm group as ``fusion`` says: "split", the compiled
    group becomes the residual add (eager) then the compiled norm (the forward's norm output is
    then what the rebuild, that norm alone, gives); "unrounded", eager elementwise work with
    ``unrounded_add_rms_norm`` (Llama's norm); otherwise unchanged."""
    from lightning_lorafusion.model import decoder as dec
    from lightning_lorafusion.model.family import add_offset_rms_norm, add_rms_norm, offset_rms_norm, rms_norm

    compiled, add_norm = dec._compiled, dec.family_add_norm

    def split(fn, compiler):
        norm = {add_rms_norm: rms_norm, add_offset_rms_norm: offset_rms_norm}.get(fn)
        if norm is None:
            return compiled(fn, compiler)
        norm = compiled(norm, compiler)

        def add_then_norm(h, o, weight, eps):
            h = h + o
            return h, norm(h, weight, eps)
        return add_then_norm

    if fusion == "split":
        dec._compiled = split
    elif fusion == "unrounded":
        dec.family_add_norm = lambda family: unrounded_add_rms_norm
    try:
        yield
    finally:
        dec._compiled, dec.family_add_norm = compiled, add_norm


def main(argv=None) -> Report:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bases", type=comma_list(("bf16", "nf4")), default=["bf16", "nf4"])
    ap.add_argument("--fusions", type=comma_list(("auto", "on", "split", "off", "unrounded")),
                    default=["auto", "off"], help="split: 'on' with the MLP's residual add outside its compiled "
                    "norm; unrounded: 'off' with the add + norm normalising the unrounded sum (a CPU stand-in "
                    "for what the compiled group may do on a GPU)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--dropout", type=float, default=0.1,
                    help="the adapters' (on the CPU, 0 makes the torch LoRA keep the norm output, as the fused "
                    "kernels always do)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--fp32-reference", action="store_true")
    ap.add_argument("--wrong-rebuild", action="store_true",
                    help="rebuild the norm outputs one row off (a deliberate error, to size a real one)")
    ap.add_argument("--device", default=default_device())
    add_output_args(ap)
    a = ap.parse_args(argv)
    backend = "triton" if a.device.startswith("cuda") else "torch"
    dtype = getattr(torch, a.dtype)
    report = Report(a.device, a, out=a.out, file_name="recompute_gradients.json", log=log)
    rows, first, first_loss = [], {}, {}
    for base in a.bases:
        config, params, bank = build(a, a.device, dtype, base)
        ref32 = None
        if a.fp32_reference and base == "bf16" and dtype != torch.float32:
            _, params32, bank32 = build(a, a.device, torch.float32, base)
            with torch.no_grad():
                for p32, p in zip(bank32.parameters(), bank.parameters()):
                    p32.copy_(p)
            params32 = torch.utils._pytree.tree_map(lambda t: t.float() if torch.is_tensor(t) else t, params)
            ref32 = step(config, params32, bank32, PLAIN, "off", backend, a.tokens)[1]
            del params32, bank32
        for fusion in a.fusions:
            plain_loss, plain = step(config, params, bank, PLAIN, fusion, backend, a.tokens)
            if fusion != a.fusions[0]:  # a correct step rounding differently: the first fusion's plain one
                rows.append({"base": base, "fusion": f"{fusion} vs {a.fusions[0]}", "mlp_recompute": "none",
                             "norms": False, **gaps(plain, first[base]),
                             "loss_gap": float((plain_loss - first_loss[base]).abs().max() / plain_loss.abs().max())})
                log(f"{rows[-1]}")
            else:
                first[base], first_loss[base] = plain, plain_loss
            for setting in SETTINGS:
                loss, grads = (plain_loss, plain) if setting == PLAIN else step(config, params, bank, setting,
                                                                                 fusion, backend, a.tokens,
                                                                                 a.wrong_rebuild)
                row = {"base": base, "fusion": fusion, "mlp_recompute": setting[0], "norms": setting[1],
                       "loss_gap": float((loss - plain_loss).abs().max() / plain_loss.abs().max()),
                       **gaps(grads, plain)}
                if ref32 is not None:
                    row["rel_norm_vs_fp32"] = max(float((g - ref32[n]).norm() / ref32[n].norm())
                                                  for n, g in grads.items())
                rows.append(row)
                log(f"{base} {fusion} {setting}: {row}")
        del params, bank
        report["rows"] = rows
        report.save()
    print("\n| base | fusion | mlp_recompute | norms | loss gap | grad max gap / max | grad norm gap | worst tensor "
          "| bar failures | exact | norm gap vs fp32 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        fp32 = f"{r['rel_norm_vs_fp32']:.2e}" if "rel_norm_vs_fp32" in r else "-"
        print(f"| {r['base']} | {r['fusion']} | {r['mlp_recompute']} | {r['norms']} | {r['loss_gap']:.1e} "
              f"| {r['rel_max']:.2e} | {r['rel_norm']:.2e} | {r['worst']} | {r['bar_failures']} | {r['exact']} "
              f"| {fp32} |")
    return report


if __name__ == "__main__":
    main()
