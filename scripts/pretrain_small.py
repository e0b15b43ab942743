"""Pretrain a small Llama-family LM from random init on ACLSum paper texts, saved as a bf16 HF directory.

Why: the NF4 convergence check needs a base trained in 16 bits; the only real small model that
installs here is a Q4_1 GGUF. This script makes one, in two steps:

``prepare`` (CPU, needs the ``aclsum`` package and the SmolLM2 GGUF): tokenizes the ACLSum
papers' full texts (title, abstract, section titles, paragraphs; ``<|endoftext|>`` after each)
with SmolLM2's tokenizer into ``tokens.u16.xz`` (uint16, little endian, xz) plus ``corpus.json``
(which paper is where, which ones are held out). The papers of ACLSum's train split are left
out entirely: the convergence check trains and scores adapters on their summaries (prompt =
paper start + title), so the base must never have read them. Of the other papers every tenth
(sorted by id) is the pretraining's held-out set. It also writes the architecture
(``config.json``: SmolLM2-135M's, read from the converted GGUF directory), the tokenizer files
with the base model's special tokens (``<|endoftext|>`` as BOS/EOS, no chat template), and the
convergence check's samples (``aclsum_summaries.jsonl.gz``: ACLSum train split, three aspects,
plain "Summary:" prompts).

``train`` (GPU; needs only torch, numpy, transformers): AdamW (betas 0.9/0.95, weight decay 0.1
on matrices, grad-norm clip 1.0), linear warmup (100 steps) then cosine decay to 10 % of the
peak (1e-3), fp32 master weights under bf16 autocast, torch SDPA attention, ``--seq-len`` 1024
windows drawn at random offsets of the training stream, ``--batch-tokens`` (16k: many small
steps; the corpus is under a million tokens) per step. ``--time-budget`` sets the step count
from the measured time of the first steps and of a held-out pass (the schedule is fixed from
then on); ``--steps`` fixes it outright. The held-out loss is measured every ``--eval-every``
steps and the best pass's weights are saved (early stopping: a model this size memorises a
corpus this small within a few epochs); ``--keep last`` saves the last step's. Saved in bf16
with the tokenizer files and ``pretraining.json`` (recipe, curves, and the held-out loss of a
unigram model of the training tokens: what a model that learned only frequencies scores).

    python scripts/pretrain_small.py prepare --out aclsum_pretrain
    python3 scripts/pretrain_small.py train --data aclsum_pretrain --out /tmp/aclsum-135m --time-budget 210
    python scripts/pretrain_small.py baselines --data aclsum_pretrain     # unigram / bigram held-out bars
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from harness import logger, sync

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

log = logger("pretrain")
TOKENS_FILE = "tokens.u16.xz"
INDEX_FILE = "corpus.json"
SAMPLES_FILE = "aclsum_summaries.jsonl.gz"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# The base (not instruct) SmolLM2 tokenizer's specials: one document separator, no chat roles.
DOC_SEPARATOR = "<|endoftext|>"
HELD_OUT_EVERY = 10  # every tenth non-excluded paper (sorted by id) is held out
CALIBRATION_STEPS = 20  # --time-budget: steps 3..20 time a step, then the schedule is fixed
ARCH_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
             "rope_parameters", "rope_theta", "rope_scaling", "tie_word_embeddings", "vocab_size",
             "attention_bias", "mlp_bias", "initializer_range")


# ----------------------------------------------------------------------------- corpus files
def write_corpus(out: Path, documents: list[dict[str, Any]], *, config: dict[str, Any], tokenizer_dir: Path,
                 meta: dict[str, Any]) -> dict[str, Any]:
    """Write a corpus directory: ``documents`` = [{"id", "role": "train" | "heldout", "ids"}]
    (token ids, separator included) -> tokens file, index, ``config.json``, tokenizer files."""
    out.mkdir(parents=True, exist_ok=True)
    flat: list[int] = []
    index = []
    for d in documents:
        if d["role"] not in ("train", "heldout"):
            raise ValueError(f"document {d['id']}: role {d['role']!r}, expected 'train' or 'heldout'")
        index.append({"id": d["id"], "role": d["role"], "start": len(flat), "length": len(d["ids"])})
        flat.extend(d["ids"])
    if max(flat) >= 2**16:
        raise ValueError(f"token id {max(flat)} does not fit uint16")
    import numpy as np

    raw = np.asarray(flat, dtype="<u2").tobytes()
    (out / TOKENS_FILE).write_bytes(lzma.compress(raw, preset=9))
    counts = {r: sum(d["length"] for d in index if d["role"] == r) for r in ("train", "heldout")}
    record = {**meta, "tokens": len(flat), "tokens_by_role": counts, "sha256": hashlib.sha256(raw).hexdigest(),
              "documents": index}
    (out / INDEX_FILE).write_text(json.dumps(record, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, out / name)
    return record


def read_corpus(data: Path) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """-> (train stream, held-out stream) as int64 token tensors, and the index."""
    import numpy as np

    index = json.loads((data / INDEX_FILE).read_text())
    raw = lzma.decompress((data / TOKENS_FILE).read_bytes())
    if hashlib.sha256(raw).hexdigest() != index["sha256"]:
        raise SystemExit(f"{data / TOKENS_FILE} does not match {data / INDEX_FILE}; rerun `prepare`")
    flat = torch.from_numpy(np.frombuffer(raw, dtype="<u2").astype(np.int64))
    parts: dict[str, list[torch.Tensor]] = {"train": [], "heldout": []}
    for d in index["documents"]:
        parts[d["role"]].append(flat[d["start"]:d["start"] + d["length"]])
    return torch.cat(parts["train"]), torch.cat(parts["heldout"]), index


def paper_text(paper: dict[str, Any]) -> str:
    """One ACLSum paper (S2ORC JSON) as plain text: title, abstract, section titles, paragraphs."""
    parts = [paper.get("title") or "", paper.get("abstract") or ""]
    section = None
    for p in paper["pdf_parse"]["body_text"]:
        if p.get("section") and p["section"] != section:
            section = p["section"]
            parts.append(section)
        parts.append(p["text"])
    return "\n\n".join(x.strip() for x in parts if x and x.strip())


def prepare(args) -> None:
    import bench_convergence as bc
    from lightning_lorafusion.data.sources.aclsum import aclsum_data_dir, read_aclsum
    from lightning_lorafusion.model.hf_loading import resolve_model_dir
    from transformers import AutoTokenizer

    out = Path(args.out)
    source = resolve_model_dir(bc._weights_name(args.tokenizer))
    src_config = json.loads((source / "config.json").read_text())
    config = {k: src_config[k] for k in ARCH_KEYS if k in src_config}
    tok_dir = out / ".tokenizer"  # the source's tokenizer.json with the base model's specials
    tok_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source / "tokenizer.json", tok_dir / "tokenizer.json")
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": DOC_SEPARATOR, "eos_token": DOC_SEPARATOR,
        "unk_token": DOC_SEPARATOR, "pad_token": DOC_SEPARATOR, "model_max_length": 8192}, indent=2))
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    sep = tokenizer.convert_tokens_to_ids(DOC_SEPARATOR)
    config.update(bos_token_id=sep, eos_token_id=sep, pad_token_id=sep)

    excluded = sorted(d["id"] for d in read_aclsum("train"))
    papers_dir = aclsum_data_dir() / "paper_jsons"
    ids = sorted(p.stem for p in papers_dir.glob("*.json"))
    kept = [i for i in ids if i not in set(excluded)]
    heldout = set(kept[::HELD_OUT_EVERY])
    documents = []
    for pid in kept:
        paper = json.loads((papers_dir / f"{pid}.json").read_text(encoding="utf-8"))
        token_ids = tokenizer(paper_text(paper), add_special_tokens=False)["input_ids"] + [sep]
        documents.append({"id": pid, "role": "heldout" if pid in heldout else "train", "ids": token_ids})
    record = write_corpus(out, documents, config=config, tokenizer_dir=tok_dir, meta={
        "source": "ACLSum paper_jsons (full texts)", "tokenizer": str(args.tokenizer), "separator_id": sep,
        "excluded_ids": excluded,
        "excluded_why": "ACLSum train split: the convergence check's adapters train and score on these papers",
        "heldout_rule": f"every {HELD_OUT_EVERY}th kept paper sorted by id"})
    shutil.rmtree(tok_dir)
    bc.write_samples_file(str(out / SAMPLES_FILE), str(out), max_document_tokens=args.max_document_tokens,
                          use_chat_template=False)
    log(f"{len(documents)} papers ({len(heldout)} held out), {record['tokens_by_role']} tokens; "
        f"{len(excluded)} train-split papers left out; {TOKENS_FILE} "
        f"{(out / TOKENS_FILE).stat().st_size / 2**20:.2f} MiB")


# ----------------------------------------------------------------------------- training
def lr_at(step: int, *, peak: float, warmup: int, total: int, floor: float) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup over ``warmup`` steps,
    then cosine from ``peak`` down to ``floor * peak`` at step ``total - 1``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(total - 1 - warmup, 1)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def unigram_cross_entropy(train: torch.Tensor, heldout: torch.Tensor, vocab: int) -> float:
    """Held-out cross-entropy (nats per token) of the training tokens' unigram distribution,
    add-one smoothed: the loss a model that learned only token frequencies would have."""
    counts = torch.bincount(train, minlength=vocab).double() + 1.0
    logp = counts.log() - counts.sum().log()
    return float(-logp[heldout].mean())


def bigram_cross_entropy(train: torch.Tensor, heldout: torch.Tensor, vocab: int, weight: float) -> float:
    """Held-out cross-entropy of the training tokens' bigram model interpolated with the unigram
    one: P(b | a) = weight * count(a, b) / count(a) + (1 - weight) * P_unigram(b)."""
    uni = torch.bincount(train, minlength=vocab).double() + 1.0
    uni /= uni.sum()
    pairs, counts = torch.unique(train[:-1] * vocab + train[1:], return_counts=True)  # sorted
    context = torch.bincount(train[:-1], minlength=vocab).double()
    query = heldout[:-1] * vocab + heldout[1:]
    pos = torch.searchsorted(pairs, query).clamp_max(pairs.numel() - 1)
    pair_counts = torch.where(pairs[pos] == query, counts[pos].double(), 0.0)
    ctx = context[heldout[:-1]]
    p_bigram = torch.where(ctx > 0, pair_counts / ctx.clamp_min(1.0), 0.0)
    return float(-(weight * p_bigram + (1 - weight) * uni[heldout[1:]]).log().mean())


def baselines(args) -> dict[str, Any]:
    """The held-out bars a pretrained model is judged against: unigram and interpolated bigram
    models of the training tokens (the bigram's weight picked on the held-out tokens, which
    flatters it), and optionally an HF model directory's held-out loss (fp32, on the CPU)."""
    train_stream, heldout_stream, index = read_corpus(Path(args.data))
    vocab = json.loads((Path(args.data) / "config.json").read_text())["vocab_size"]
    bigram = {w: bigram_cross_entropy(train_stream, heldout_stream, vocab, w) for w in (0.5, 0.6, 0.7, 0.8, 0.9)}
    out: dict[str, Any] = {"heldout_tokens": heldout_stream.numel(),
                           "unigram": unigram_cross_entropy(train_stream, heldout_stream, vocab),
                           "bigram_by_weight": bigram, "bigram_best": min(bigram.values())}
    if args.model:
        from contextlib import nullcontext

        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
        out["model"] = {"path": args.model, "heldout_loss": heldout_loss(
            model, heldout_stream, seq_len=args.seq_len, micro_batch=4, device=torch.device("cpu"),
            autocast=nullcontext)}
    print(json.dumps(out, indent=1))
    return out


def token_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``ids`` [batch, seq + 1] (fp32 logits)."""
    hidden = model.model(input_ids=ids[:, :-1], use_cache=False).last_hidden_state
    logits = model.lm_head(hidden).float()
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, *, seq_len: int, micro_batch: int, device, autocast) -> float:
    """Mean token loss over the held-out stream cut into consecutive ``seq_len + 1`` windows."""
    model.eval()
    n = (stream.numel() - 1) // seq_len
    windows = torch.stack([stream[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)])
    total = 0.0
    for i in range(0, n, micro_batch):
        chunk = windows[i:i + micro_batch].to(device)
        with autocast():
            total += token_loss(model, chunk).double().item() * chunk.shape[0]
    model.train()
    return total / n


def train(args) -> dict[str, Any]:
    from contextlib import nullcontext

    from transformers import AutoConfig, LlamaForCausalLM

    device = torch.device(args.device)
    data, out = Path(args.data), Path(args.out)
    train_stream, heldout_stream, index = read_corpus(data)
    seq = args.seq_len
    seqs_per_step = max(args.batch_tokens // seq, 1)
    if seqs_per_step % args.micro_batch:
        raise SystemExit(f"--batch-tokens {args.batch_tokens} gives {seqs_per_step} sequences per step, "
                         f"not a multiple of --micro-batch {args.micro_batch}")
    accum = seqs_per_step // args.micro_batch
    if train_stream.numel() <= seq + 1:
        raise SystemExit(f"the training stream has {train_stream.numel()} tokens, fewer than one window")

    torch.manual_seed(args.seed)
    config = AutoConfig.from_pretrained(data)
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32).to(device)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    use_bf16 = device.type == "cuda" and not args.fp32

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if use_bf16 else nullcontext()

    n_params = sum(p.numel() for p in model.parameters())
    log(f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, {n_params / 1e6:.1f}M parameters; "
        f"train {train_stream.numel()} tokens, held out {heldout_stream.numel()}; {seqs_per_step} x {seq} "
        f"tokens per step ({accum} micro-batches of {args.micro_batch})")
    gen = torch.Generator().manual_seed(args.seed)
    total = args.steps
    history: dict[str, list] = {"step": [], "lr": [], "train_loss": [], "grad_norm": [], "seconds": [],
                                "heldout": []}
    ev = dict(seq_len=seq, micro_batch=args.micro_batch, device=device, autocast=autocast)
    # one untimed micro-batch first: the first pass also pays kernel warm-up, which the budget must not count
    heldout_loss(model, heldout_stream[: seq * args.micro_batch + 1], **ev)
    sync(device)
    te = time.perf_counter()
    history["heldout"].append([0, heldout_loss(model, heldout_stream, **ev)])
    eval_seconds = time.perf_counter() - te
    best_step, best_loss, best_state = 0, history["heldout"][0][1], None
    log(f"step 0: held-out loss {best_loss:.4f} ({eval_seconds:.1f}s per held-out pass)")
    sync(device)
    t0 = time.perf_counter()
    step_times = []
    step = 0
    while total is None or step < total:
        ts = time.perf_counter()
        lr = lr_at(step, peak=args.lr, warmup=args.warmup_steps, total=total or 10**9, floor=args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, train_stream.numel() - seq - 1, (seqs_per_step,), generator=gen)
        batch = torch.stack([train_stream[s:s + seq + 1] for s in starts.tolist()])
        loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        for m in range(accum):
            ids = batch[m * args.micro_batch:(m + 1) * args.micro_batch].to(device, non_blocking=True)
            with autocast():
                loss = token_loss(model, ids)
            (loss / accum).backward()
            loss_sum += loss.detach().double()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        train_loss = (loss_sum / accum).item()  # syncs: the step's time is complete
        step_times.append(time.perf_counter() - ts)
        step += 1
        history["step"].append(step)
        history["lr"].append(lr)
        history["train_loss"].append(train_loss)
        history["grad_norm"].append(float(grad_norm))
        history["seconds"].append(round(time.perf_counter() - t0, 2))
        if total is None and step == CALIBRATION_STEPS:  # the first steps warm up kernels and allocator
            per_step = sum(step_times[2:]) / (len(step_times) - 2)
            cost = per_step + eval_seconds / args.eval_every  # a step and its share of held-out passes
            total = max(step + 1, step + int((args.time_budget - (time.perf_counter() - t0)) / cost))
            if total <= args.warmup_steps:
                raise SystemExit(f"--time-budget {args.time_budget}s gives {total} steps at {per_step:.2f}s "
                                 f"per step, not more than --warmup-steps {args.warmup_steps}")
            log(f"{per_step:.3f}s per step: {total} steps in the {args.time_budget:.0f}s budget")
        line = f"step {step}/{total}: lr {lr:.2e}, train loss {train_loss:.4f}, grad norm {float(grad_norm):.2f}"
        evaluated = step % args.eval_every == 0 or step == total
        if evaluated:
            loss = heldout_loss(model, heldout_stream, **ev)
            history["heldout"].append([step, loss])
            line += f", held-out {loss:.4f}"
            if loss < best_loss and args.keep == "best":  # early stopping: keep the best weights
                best_step, best_loss = step, loss
                best_state = {k: v.detach().to(torch.bfloat16, copy=True) for k, v in model.state_dict().items()}
        if evaluated or step % args.log_every == 0 or step <= CALIBRATION_STEPS:
            log(line + f" ({time.perf_counter() - t0:.0f}s)")
    sync(device)
    seconds = time.perf_counter() - t0
    model.config.use_cache = True
    model.to(torch.bfloat16)
    kept = total
    if args.keep == "best" and best_state is not None:
        model.load_state_dict(best_state)
        kept = best_step
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copyfile(data / name, out / name)
    tokens_seen = total * seqs_per_step * seq
    record = {
        "architecture": {k: getattr(config, k, None) for k in ("num_hidden_layers", "hidden_size",
                         "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                         "tie_word_embeddings")},
        "parameters": n_params, "corpus": {k: index.get(k) for k in ("source", "tokens_by_role", "sha256",
                                                                      "excluded_why", "heldout_rule")},
        "recipe": {"optimizer": "AdamW(0.9, 0.95, eps 1e-8)", "lr": args.lr, "warmup_steps": args.warmup_steps,
                   "min_lr_ratio": args.min_lr_ratio, "weight_decay": args.weight_decay, "clip": args.clip,
                   "seq_len": seq, "tokens_per_step": seqs_per_step * seq, "micro_batch": args.micro_batch,
                   "steps": total, "precision": "bf16 autocast, fp32 master weights" if use_bf16 else "fp32",
                   "attention": "torch SDPA", "seed": args.seed, "time_budget": args.time_budget,
                   "eval_every": args.eval_every, "keep": args.keep},
        "tokens_seen": tokens_seen, "epochs": tokens_seen / train_stream.numel(),
        "seconds": round(seconds, 1), "tokens_per_second": round(tokens_seen / seconds),
        "final_train_loss": history["train_loss"][-1], "final_heldout_loss": history["heldout"][-1][1],
        "best_heldout": min(history["heldout"], key=lambda x: x[1]), "saved_step": kept,
        "saved_heldout_loss": dict(map(tuple, history["heldout"]))[kept],
        "unigram_heldout_loss": unigram_cross_entropy(train_stream, heldout_stream, config.vocab_size),
        "peak_allocated_gib": (round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
                               if device.type == "cuda" else None),
        "history": history, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    (out / "pretraining.json").write_text(json.dumps(record, indent=1))
    log(f"{total} steps, {tokens_seen / 1e6:.1f}M tokens ({record['epochs']:.1f} epochs) in {seconds:.0f}s "
        f"({record['tokens_per_second']} tok/s); last step: train loss {record['final_train_loss']:.4f}, held-out "
        f"{record['final_heldout_loss']:.4f}; saved {out} from step {kept}: held-out "
        f"{record['saved_heldout_loss']:.4f} (perplexity {math.exp(record['saved_heldout_loss']):.1f}); "
        f"unigram model of the training tokens: held-out {record['unigram_heldout_loss']:.4f}")
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize ACLSum papers into a corpus directory (CPU)")
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", default="smollm2-135m-instruct",
                   help="model whose config.json and tokenizer.json to use (built-in name, directory, .gguf)")
    p.add_argument("--max-document-tokens", type=int, default=384, help="paper start kept in the summary prompts")
    b = sub.add_parser("baselines", help="held-out loss of unigram / bigram models (and of --model), CPU")
    b.add_argument("--data", required=True, help="a directory written by `prepare`")
    b.add_argument("--model", default=None, help="an HF model directory to score on the held-out tokens")
    b.add_argument("--seq-len", type=int, default=1024)
    t = sub.add_parser("train", help="pretrain from random init and save a bf16 HF directory")
    t.add_argument("--data", required=True, help="a directory written by `prepare`")
    t.add_argument("--out", required=True)
    t.add_argument("--device", default="cuda")
    t.add_argument("--steps", type=int, default=None, help="optimizer steps (else from --time-budget)")
    t.add_argument("--time-budget", type=float, default=210.0, help="seconds of training when --steps is unset")
    t.add_argument("--seq-len", type=int, default=1024)
    t.add_argument("--batch-tokens", type=int, default=16 * 1024)
    t.add_argument("--micro-batch", type=int, default=16, help="sequences per forward/backward")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--min-lr-ratio", type=float, default=0.1)
    t.add_argument("--warmup-steps", type=int, default=100)
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--clip", type=float, default=1.0)
    t.add_argument("--eval-every", type=int, default=25)
    t.add_argument("--log-every", type=int, default=25)
    t.add_argument("--keep", default="best", choices=["best", "last"],
                   help="save the weights of the best held-out pass (early stopping) or of the last step")
    t.add_argument("--fp32", action="store_true", help="no bf16 autocast (CPU runs are fp32 anyway)")
    t.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.command == "prepare":
        prepare(args)
    elif args.command == "baselines":
        baselines(args)
    else:
        if args.steps is None and args.time_budget <= 0:
            sys.exit("set --steps or a positive --time-budget")
        train(args)


if __name__ == "__main__":
    main()
