"""Training step time of one DoRA adapter against the same LoRA adapter, ours and HF + PEFT, same run.

A random Llama-shaped decoder (default: Llama-3.1-8B layer shapes, 2 layers, a 32k vocabulary so
the LM head does not dominate) trains one adapter (rank 16, alpha 32, all seven projections) on
one packed microbatch of ``--tokens`` tokens (samples of ``--sample-len``):

    ours-lora   our functional decoder, the fused LoRA kernels (``--backend``, default auto)
    ours-dora   the same adapter with ``dora: true`` (kernels/dora.py: the row norm from rank-r
                products, the magnitude applied per DoRA row after the fused product)
    peft-lora   transformers + PEFT on the same weights and samples (batch of samples, no padding)
    peft-dora   the same with ``use_dora=True`` (PEFT materialises W + s·B·A per step)

A step is forward + backward (loss summed over label tokens) with the gradients zeroed before;
times are the median of ``--reps`` after ``--warmup`` steps. The ratio column is DoRA over LoRA
of the same implementation (the target is <= 1.15 for ours).

    python scripts/bench_dora.py --out $OUT                       # 8B shapes, GPU
    python scripts/bench_dora.py --device cpu --dtype float32 --hidden 64 --intermediate 128 \\
        --heads 4 --kv-heads 2 --vocab 128 --tokens 64 --sample-len 32 --reps 2   # tiny, CPU
"""

from __future__ import annotations

import argparse
import sys

from harness import add_device_args, add_output_args, device_info, dtype_of, logger, timed_ms, write_json

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning_lorafusion.model import decoder as D  # noqa: E402
from lightning_lorafusion.model.adapter_bank import AdapterBank  # noqa: E402
from lightning_lorafusion.model.hf_loading import params_from_hf_model  # noqa: E402
from lightning_lorafusion.specs import ALL_TARGET_MODULES, IGNORE_INDEX, AdapterSpec  # noqa: E402

log = logger("bench_dora")
VARIANTS = ("ours-lora", "ours-dora", "peft-lora", "peft-dora")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of the packed microbatch")
    ap.add_argument("--sample-len", type=int, default=1024, help="tokens per sample")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"))
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    add_device_args(ap)
    add_output_args(ap)
    args = ap.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or not args.variants:
        ap.error(f"--variants {bad or args.variants}: choose from {', '.join(VARIANTS)}")
    if args.tokens % args.sample_len:
        ap.error(f"--tokens {args.tokens} must be a multiple of --sample-len {args.sample_len}")
    return args


def hf_model(args, dtype, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=max(4096, args.sample_len),
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def samples(args, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    n = args.tokens // args.sample_len
    return torch.randint(0, args.vocab, (n, args.sample_len), generator=g).to(device)


def ours_step(args, model, ids, dora: bool, dtype, device):
    """A closure of one training step of our decoder on the packed samples."""
    config, params = params_from_hf_model(model)
    spec = AdapterSpec(name="bench", rank=args.rank, alpha=args.alpha, target_modules=ALL_TARGET_MODULES, dora=dora)
    bank = AdapterBank([spec], config, dtype=dtype, device=device)
    bank.init_dora(params)
    with torch.no_grad():  # B off zero, so the DoRA norm has its cross terms
        for name, p in bank.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0.0, 1e-3)
    n, length = ids.shape
    flat = ids.reshape(-1)
    labels = torch.cat([ids[:, 1:], torch.full((n, 1), IGNORE_INDEX, device=device)], dim=1).reshape(-1)
    pos = torch.arange(length, device=device).repeat(n)
    cu = torch.arange(0, n * length + 1, length, device=device, dtype=torch.int32)
    routing = bank.routing(((0, n * length, 0),), microbatch_index=0, num_rows=n * length)
    label_rows = (labels != IGNORE_INDEX).nonzero().squeeze(1)
    view = bank.view()

    def step():
        bank.zero_grad(set_to_none=True)
        loss = D.forward_loss_sums(params, view, flat, labels, pos, cu, routing, config=config, backend=args.backend,
                                   max_seqlen=length, label_rows=label_rows)
        loss.sum().backward()

    return step


def peft_steps(args, model, ids, variants):
    """Closures of one PEFT training step per wanted variant (one PeftModel, two adapters)."""
    from peft import LoraConfig, get_peft_model

    def config(dora):
        return LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=list(ALL_TARGET_MODULES),
                          lora_dropout=0.0, use_dora=dora)

    peft_model = get_peft_model(model, config(False), adapter_name="peft-lora")
    peft_model.add_adapter("peft-dora", config(True))
    peft_model.train()
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            with torch.no_grad():
                p.normal_(0.0, 1e-3)
    steps = {}
    for variant in variants:
        def step(variant=variant):
            peft_model.base_model.set_adapter(variant)
            peft_model.zero_grad(set_to_none=True)
            logits = peft_model(input_ids=ids).logits
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                   reduction="sum")
            loss.backward()
        steps[variant] = step
    return steps


def table(rows) -> str:
    by = {r["variant"]: r for r in rows}
    lines = ["| variant | step ms (median) | min ms | DoRA / LoRA |", "| --- | ---: | ---: | ---: |"]
    for r in rows:
        base = by.get(r["variant"].replace("dora", "lora"))
        ratio = f"{r['median_ms'] / base['median_ms']:.3f}" if "dora" in r["variant"] and base else ""
        lines.append(f"| {r['variant']} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | {ratio} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device, dtype = torch.device(args.device), dtype_of(args.dtype)
    model = hf_model(args, dtype, device)
    ids = samples(args, device)
    steps = {}
    for variant in ("ours-lora", "ours-dora"):
        if variant in args.variants:
            steps[variant] = ours_step(args, model, ids, variant == "ours-dora", dtype, device)
    wanted_peft = [v for v in args.variants if v.startswith("peft")]
    if wanted_peft:  # wraps the model in place: after ours took its weights
        steps.update(peft_steps(args, model, ids, wanted_peft))
    rows = []
    for variant in args.variants:
        t = timed_ms(steps[variant], device, warmup=args.warmup, reps=args.reps)
        rows.append({"variant": variant, **t})
        log(f"{variant}: {t['median_ms']:.2f} ms")
    print(table(rows))
    report = {**device_info(device), "args": vars(args), "rows": rows}
    write_json(args.out, f"dora_h{args.hidden}_l{args.layers}_t{args.tokens}_r{args.rank}.json", report)
    return rows


if __name__ == "__main__":
    main()
