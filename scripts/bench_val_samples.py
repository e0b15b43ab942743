"""Time one validation's greedy samples (training/val_samples.greedy_generate) on the CPU demo's shape.

The demo (configs/demo.yaml): SmolLM2-135M-Instruct in fp32, three adapters (ranks 8/16/4 on
their demo targets, random nonzero weights here), one prompt each, 32 new tokens. Prompts are
random token ids of ``--prompt_tokens`` each (the demo's three are about 147); EOS is off so
every prompt generates all 32 tokens (the worst case).

    PYTHONPATH=$PWD python scripts/bench_val_samples.py [--repeats 3] [--reference OLD_val_samples.py]

``--reference``: also time another ``val_samples.py`` (e.g. an older checkout's) with the same
call, for a before/after comparison, and check both give the same tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time

import torch

from lightning_lorafusion.model.adapter_bank import AdapterBank
from lightning_lorafusion.model.hf_loading import load_base_model
from lightning_lorafusion.specs import AdapterSpec
from lightning_lorafusion.training.val_samples import ValPrompt, greedy_generate

DEMO_ADAPTERS = [
    ("challenge", 8, 16, ("q_proj", "k_proj", "v_proj", "o_proj")),
    ("approach", 16, 32, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    ("outcome", 4, 8, ("q_proj", "v_proj")),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt_tokens", type=int, default=147)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reference", default=None, help="path of another val_samples.py to time too")
    args = parser.parse_args()
    torch.manual_seed(0)
    config, params, _ = load_base_model("smollm2-135m-instruct", dtype=torch.float32)
    specs = [AdapterSpec(name=n, rank=r, alpha=a, target_modules=t, seed=i + 1)
             for i, (n, r, a, t) in enumerate(DEMO_ADAPTERS)]
    bank = AdapterBank(specs, config, dtype=torch.float32)
    with torch.no_grad():
        for p in bank.parameters():
            p.copy_(torch.randn(p.shape) * 0.02)
    prompts = [ValPrompt(adapter=a, prompt=tuple(torch.randint(0, config.vocab_size, (args.prompt_tokens,)).tolist()),
                         reference=()) for a in range(len(specs))]
    kwargs = dict(max_new_tokens=args.max_new_tokens, eos_token_id=None)
    impls = [("engine", greedy_generate)]
    if args.reference:
        spec = importlib.util.spec_from_file_location("lightning_lorafusion.training._reference_val_samples",
                                                      args.reference)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
        impls.append(("reference", module.greedy_generate))
    print(f"torch threads {torch.get_num_threads()}; {len(prompts)} prompts x {args.prompt_tokens} tokens, "
          f"{args.max_new_tokens} new tokens each")
    outputs = {}
    for name, fn in impls:
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            with torch.no_grad():
                outputs[name] = fn(params, bank, config, prompts, **kwargs)
            times.append(time.perf_counter() - start)
        print(f"{name:>10}: " + ", ".join(f"{t:.2f}" for t in times) + f" s  (min {min(times):.2f} s)")
    if len(outputs) == 2:
        print("same tokens:", outputs["engine"] == outputs["reference"])


if __name__ == "__main__":
    main()
