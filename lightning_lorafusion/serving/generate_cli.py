"""`lightning-lorafusion generate`: prompts (a JSONL file or --prompt) through a base and its LoRA
adapters in shared batches; one JSONL result per prompt."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterable, TextIO

from ..model.peft_io import CONFIG_FILE
from ..specs import ConfigError
from .adapters import UnknownAdapterError
from .checkpoint import read_checkpoint_adapters
from .config import PREFILL_ATTENTION, EngineTuning

PROG = "lightning-lorafusion generate"
# per-line keys of the prompts file that override the command line's sampling settings
SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "min_p",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                 "stop_token_ids")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Generate with a base model and any of its LoRA adapters, all in shared batches.",
        epilog='Prompts file: one JSON object a line, {"prompt": "...", "adapter": "name" (absent or null = '
               f'the base), "id": any, and optionally {", ".join(SAMPLING_KEYS)}}}. Each result line holds id, '
               "adapter, prompt, completion, tokens (the generated token ids), finish_reason (stop, length) and "
               "prompt_tokens. Exit status: 0 done; 2 a usage or input mistake (one 'error:' line).")
    p.add_argument("--base_model", "--base", required=True,
                   help="A local HF model directory or a name fit accepts (smollm2-135m-instruct).")
    p.add_argument("--adapters", nargs="*", default=[], metavar="[NAME=]DIR|CKPT",
                   help="PEFT adapter directories (served under the directory's name, or NAME), or directories "
                        "of them such as a fit run's adapters/ directory (each subdirectory one adapter), or a "
                        "fit checkpoint (.ckpt: every adapter in it, under its training name, best weights).")
    p.add_argument("--prompts", help="A JSONL file of prompts (see below).")
    p.add_argument("--prompt", action="append", default=[], help="A prompt (repeatable); used with --adapter_name.")
    p.add_argument("--adapter_name", action="append", default=None,
                   help="Adapter for the --prompt prompts (repeatable: every prompt with every adapter; "
                        "'base' = no adapter). Default: the base.")
    p.add_argument("--out", help="Where the JSONL results go (default: standard output).")
    p.add_argument("--chat", action="store_true", help="Wrap each prompt as a user message in the tokenizer's "
                                                       "chat template (with the generation prompt).")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default).")
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--top_k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="A stop string (repeatable).")
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if present).")
    p.add_argument("--dtype", default=None, help="bfloat16, float16, float32 (default: bf16 on CUDA, fp32 on CPU).")
    p.add_argument("--max_num_seqs", type=int, default=256, help="Requests decoding at once, at most.")
    p.add_argument("--cuda_graphs", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--prefill_attention", default="auto", choices=PREFILL_ATTENTION,
                   help="How prompts attend while prefilled: varlen, paged (the paged prefill kernel), "
                        "auto (default: paged with the Triton kernels, i.e. on CUDA; docs/serving.md); "
                        "EngineTuning.prefill_attention.")
    p.add_argument("--progress", default="auto", choices=("auto", "on", "off"),
                   help="Requests done and generated tokens/s on standard error while generating (auto: only "
                        "when standard error is a terminal; the results never mix with it).")
    return p


class Progress:
    """Requests done and generated tokens per second on ``stream`` while an engine generates:
    a thread reads ``Engine.stats()`` every ``interval`` seconds and rewrites one line; leaving
    the ``with`` block writes the final one. Done = requests submitted since the start and no longer running or
    waiting (all of ``generate``'s requests are submitted before its first step)."""

    def __init__(self, engine: Any, total: int, stream: TextIO, interval: float = 1.0) -> None:
        self.engine, self.total, self.stream, self.interval = engine, total, stream, interval
        start = engine.stats()
        self._requests0, self._tokens0 = start["requests_total"], start["generated_tokens_total"]
        self._t0 = time.perf_counter()
        self._done = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="generate-progress", daemon=True)

    def __enter__(self) -> "Progress":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._write(final=True, finished=exc[0] is None)

    def line(self, finished: bool = False) -> str:
        stats = self.engine.stats()
        if finished:
            self._done = self.total
        else:  # monotone: a request moving from waiting to running may be counted in neither for an instant
            busy = stats["running"] + stats["waiting"]
            self._done = max(self._done, min(self.total, stats["requests_total"] - self._requests0 - busy))
        tokens = stats["generated_tokens_total"] - self._tokens0
        elapsed = time.perf_counter() - self._t0
        rate = tokens / elapsed if elapsed > 0 else 0.0
        return (f"{PROG}: {self._done}/{self.total} requests, {tokens} tokens generated, "
                f"{rate:.1f} tokens/s, {elapsed:.0f} s")

    def _write(self, final: bool, finished: bool = False) -> None:
        self.stream.write("\r" + self.line(finished) + ("\n" if final else ""))
        self.stream.flush()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._write(final=False)


def show_progress(mode: str, stream: TextIO) -> bool:
    """--progress: on, off, or auto (on when ``stream`` is a terminal)."""
    if mode == "auto":
        isatty = getattr(stream, "isatty", None)
        return bool(isatty and isatty())
    return mode == "on"


def adapter_dirs(specs: Iterable[str]) -> dict[str, Path]:
    """``[NAME=]DIR`` arguments -> name -> PEFT directory. A DIR without adapter_config.json is
    a directory of adapters (a fit run's ``adapters/``): each subdirectory that has one."""
    found: dict[str, Path] = {}

    def add(name: str, path: Path) -> None:
        if name in found:
            raise ConfigError(f"two adapters are named {name!r} ({found[name]} and {path}); name one NAME=DIR")
        found[name] = path

    for spec in specs:
        name, sep, path_text = spec.partition("=")
        path = Path(path_text if sep else spec)
        if not path.is_dir():
            raise ConfigError(f"adapter directory {str(path)!r} does not exist")
        if (path / CONFIG_FILE).is_file():
            add(name if sep else path.name, path)
            continue
        subdirs = sorted(d for d in path.iterdir() if (d / CONFIG_FILE).is_file())
        if not subdirs:
            raise ConfigError(f"{str(path)!r} is neither a PEFT adapter directory (no {CONFIG_FILE}) nor a "
                              "directory of them")
        if sep:
            raise ConfigError(f"{spec!r}: NAME= names one adapter directory, but {str(path)!r} holds several")
        for d in subdirs:
            add(d.name, d)
    return found


def read_prompts(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The prompts file's lines (validated) followed by --prompt x --adapter_name pairs."""
    items: list[dict[str, Any]] = []
    if args.prompts:
        path = Path(args.prompts)
        if not path.is_file():
            raise ConfigError(f"prompts file {str(path)!r} does not exist")
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"]:
                raise ConfigError(f"{path}:{n}: each line needs a non-empty string \"prompt\"")
            unknown = set(item) - {"prompt", "adapter", "id", *SAMPLING_KEYS}
            if unknown:
                raise ConfigError(f"{path}:{n}: unknown keys {sorted(unknown)}")
            items.append({"id": item.get("id", f"{path.name}:{n}"), "where": f"{path}:{n}", **item})
    names = args.adapter_name or ["base"]
    for i, prompt in enumerate(args.prompt):
        for name in names:
            items.append({"id": f"prompt{i}" + ("" if len(names) == 1 else f"-{name}"), "where": f"--prompt {i}",
                          "prompt": prompt, "adapter": None if name == "base" else name})
    if not items:
        raise ConfigError("nothing to generate: give --prompts FILE.jsonl or --prompt TEXT")
    return items


def _sampling(args: argparse.Namespace, item: dict[str, Any]):
    from .sampling import SamplingParams

    settings = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
                "top_k": args.top_k, "seed": args.seed, "stop": tuple(args.stop)}
    settings.update({k: item[k] for k in SAMPLING_KEYS if k in item})
    try:
        return SamplingParams(**settings)
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"{item['where']}: {e}") from None


def _prompt_ids(tokenizer: Any, text: str, chat: bool, where: str) -> tuple[int, ...]:
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("--chat: the base model's tokenizer has no chat template")
        out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)
        ids = out["input_ids"]
    else:
        ids = tokenizer(text)["input_ids"]
    if not ids:
        raise ConfigError(f"{where}: the prompt tokenizes to nothing")
    return tuple(int(t) for t in ids)


def generate(args: argparse.Namespace, out: TextIO) -> int:
    """Load, run every prompt, write one result line each (in the prompts' order); returns how
    many were written."""
    import torch

    from . import Engine, EngineConfig, GenerationRequest

    checkpoints = [a for a in args.adapters if a.endswith(".ckpt")]
    adapters = adapter_dirs([a for a in args.adapters if not a.endswith(".ckpt")])
    from_ckpt = [a for c in checkpoints for a in read_checkpoint_adapters(c)]
    for a in from_ckpt:
        if a.name in adapters:
            raise ConfigError(f"two adapters are named {a.name!r} (one from a checkpoint); load one of them")
        adapters[a.name] = None
    items = read_prompts(args)
    for item in items:
        name = item.get("adapter")
        if name is not None and name not in adapters:
            raise ConfigError(f"{item['where']}: adapter {name!r} is not loaded; loaded: {sorted(adapters)} "
                              "(or null for the base)")
    dtype = None
    if args.dtype is not None:
        dtype = getattr(torch, args.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(f"--dtype {args.dtype!r} is not a torch dtype; use bfloat16, float16 or float32")
    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=max(8192, args.max_num_seqs),
                          cuda_graphs=args.cuda_graphs, tuning=EngineTuning(prefill_attention=args.prefill_attention))
    engine = Engine.from_pretrained(args.base_model, {n: str(p) for n, p in adapters.items() if p is not None},
                                    config, device=args.device, dtype=dtype)
    for a in from_ckpt:
        engine.add_adapter_weights(a.name, a.factors, rank=a.rank, alpha=a.alpha, layout=a.layout)
    with engine:
        requests = [GenerationRequest(prompt_token_ids=_prompt_ids(engine.tokenizer, it["prompt"], args.chat,
                                                                   it["where"]),
                                      adapter=it.get("adapter"), sampling=_sampling(args, it)) for it in items]
        if show_progress(args.progress, sys.stderr):
            with Progress(engine, len(requests), sys.stderr):
                results = engine.generate(requests)
        else:
            results = engine.generate(requests)
    for item, res in zip(items, results):
        out.write(json.dumps({"id": item["id"], "adapter": res.adapter, "prompt": item["prompt"],
                              "completion": res.text, "tokens": list(res.token_ids),
                              "finish_reason": res.finish_reason, "prompt_tokens": len(res.prompt_token_ids)},
                             ensure_ascii=False) + "\n")
    return len(results)


def run(argv: list[str] | None = None) -> int:
    """Parse ``argv``, generate, write the results. Returns the process exit code (0, or 2 with
    one ``error:`` line for a usage or input mistake)."""
    args = build_parser().parse_args(argv if argv is not None else sys.argv[1:])
    logging.basicConfig(level=logging.WARNING, format="[lorafusion] %(message)s")
    try:
        if args.out:
            out_path = Path(args.out)
            if not out_path.parent.is_dir():
                raise ConfigError(f"--out {args.out!r}: directory {str(out_path.parent)!r} does not exist")
            # written to a temporary file first: a failed run leaves no half-written output
            tmp = out_path.with_name(f".{out_path.name}.partial")
            with tmp.open("w", encoding="utf-8") as f:
                n = generate(args, f)
            tmp.replace(out_path)
            print(f"{PROG}: {n} results -> {out_path}", file=sys.stderr)
        else:
            generate(args, sys.stdout)
    except (ConfigError, FileNotFoundError, UnknownAdapterError) as e:
        message = " ".join(str(e).split())
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2
    finally:
        if args.out:
            Path(args.out).with_name(f".{Path(args.out).name}.partial").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(run())
