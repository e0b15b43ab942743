"""ACLSum source: papers of the ACLSum corpus to one aspect's one-sentence summary."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...specs import ConfigError
from ..tokenization import (TokenizedSample, has_chat_template, tokenize_messages,
                            tokenize_prompt_completion)
from .rows import check_limit, normalize_split, tokenize_all

ACLSUM_ASPECTS = ("challenge", "approach", "outcome")
ACLSUM_SECTIONS = ("abstract", "introduction", "conclusion")
# One instruction per aspect, phrased after the ACLSum annotation guidelines' definitions.
ACLSUM_INSTRUCTIONS = {
    "challenge": "Summarize in one sentence the challenge this paper addresses: the problem "
    "or gap that motivates the work.",
    "approach": "Summarize in one sentence the approach this paper proposes: the method or "
    "idea used to address the challenge.",
    "outcome": "Summarize in one sentence the outcome of this paper: its main results and "
    "findings.",
}



def aclsum_data_dir() -> Path:
    """Where the installed ``aclsum`` package keeps its JSONL files (found without importing
    it: its ``__init__`` needs ``sienna``, which we do not)."""
    spec = importlib.util.find_spec("aclsum")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "dataset kind 'aclsum' needs the 'aclsum' package (ACLSum corpus); "
            "pip install aclsum --no-deps"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "dataset"


def read_aclsum(split: str) -> list[dict[str, Any]]:
    """ACLSum documents of one split as dicts (id, title, summary, sentences, ...)."""
    path = aclsum_data_dir() / f"{split}.jsonl"
    if not path.is_file():
        raise ConfigError(f"ACLSum split file {str(path)!r} is missing; reinstall the aclsum package")
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@dataclass(frozen=True, kw_only=True)
class AclsumSource:
    """ACLSum papers -> one aspect's summary: prompt = instruction + title + paper start.

    The paper text (``sections`` in paper order, ACLSum's own sentence split) is cut to
    ``max_document_tokens`` tokens, keeping its beginning, so samples stay short enough for
    CPU training. With a chat template the sample is a user/assistant conversation, else a
    plain prompt ending in "Summary:".
    """

    aspect: str
    split: str | None = None
    max_document_tokens: int = 384
    sections: tuple[str, ...] = ACLSUM_SECTIONS
    use_chat_template: bool | None = None  # None: when the tokenizer has one
    limit: int | None = None  # keep only the first `limit` papers
    kind: str = "aclsum"

    def __post_init__(self) -> None:
        check_limit(self.limit, self.kind)
        if self.aspect not in ACLSUM_ASPECTS:
            raise ConfigError(
                f"dataset kind 'aclsum': aspect={self.aspect!r}; allowed: {list(ACLSUM_ASPECTS)}"
            )
        if self.split is not None:
            object.__setattr__(self, "split", normalize_split(self.split, "dataset kind 'aclsum'"))
        if isinstance(self.sections, (list, str)):
            sections = [self.sections] if isinstance(self.sections, str) else self.sections
            object.__setattr__(self, "sections", tuple(sections))
        unknown = [s for s in self.sections if s not in ACLSUM_SECTIONS]
        if unknown or not self.sections:
            raise ConfigError(
                f"dataset kind 'aclsum': sections={list(self.sections)}; allowed: non-empty "
                f"subset of {list(ACLSUM_SECTIONS)}"
            )
        if self.max_document_tokens < 1:
            raise ConfigError(
                f"dataset kind 'aclsum': max_document_tokens={self.max_document_tokens} must be >= 1"
            )

    def prompt_text(self, tokenizer: Any, doc: Mapping[str, Any]) -> str:
        text = " ".join(s for section in self.sections for s in doc["sentences"].get(section, []))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > self.max_document_tokens:
            text = tokenizer.decode(ids[: self.max_document_tokens]).rstrip() + " ..."
        return f"{ACLSUM_INSTRUCTIONS[self.aspect]}\n\nTitle: {doc['title']}\n\n{text}"

    def build(
        self, tokenizer: Any, *, split: str, max_length: int | None, name: str
    ) -> list[TokenizedSample]:
        where = f"adapter dataset {name} (aclsum)"
        if tokenizer is None:
            raise ConfigError(f"{where}: a tokenizer is required to read text data")
        split = self.split or normalize_split(split, where)
        docs = read_aclsum(split)
        chat = has_chat_template(tokenizer) if self.use_chat_template is None else self.use_chat_template
        if chat and not has_chat_template(tokenizer):
            raise ConfigError(f"{where}: use_chat_template=true but the tokenizer has no chat template")

        def tokenize_doc(doc: Mapping[str, Any], index: int) -> TokenizedSample:
            summary = doc["summary"][self.aspect].strip()
            prompt = self.prompt_text(tokenizer, doc)
            if chat:
                messages = [
                    {"role": "user", "content": prompt},
                    {"role": "assistant", "content": summary},
                ]
                return tokenize_messages(
                    tokenizer, messages, max_length=max_length, source_index=index
                )
            return tokenize_prompt_completion(
                tokenizer, prompt + "\n\nSummary:", " " + summary,
                max_length=max_length, source_index=index,
            )

        return tokenize_all(
            docs, tokenize_doc, name=name, max_length=max_length, limit=self.limit
        )
