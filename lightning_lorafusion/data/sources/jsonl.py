"""JSONL source: one JSON object per line, prompt/completion fields or a ``messages`` list."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...specs import ConfigError
from ..tokenization import TokenizedSample
from .rows import RowFields, check_file, check_limit, resolve_path, tokenize_all

@dataclass(frozen=True, kw_only=True)
class JsonlSource:
    """One JSON object per line: prompt/completion fields or a ``messages`` list."""

    path: str | Mapping[str, str]
    fields: RowFields = field(default_factory=RowFields)
    limit: int | None = None  # keep only the first `limit` samples
    kind: str = "jsonl"

    def __post_init__(self) -> None:
        check_limit(self.limit, self.kind)

    def read_rows(self, path: Path, where: str) -> list[Any]:
        rows = []
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ConfigError(f"{where}: {path} line {line_no} is not valid JSON: {err}") from err
        return rows

    def build(
        self, tokenizer: Any, *, split: str, max_length: int | None, name: str
    ) -> list[TokenizedSample]:
        where = f"adapter dataset {name} ({self.kind})"
        path = resolve_path(self.path, split, where)
        check_file(path, where)
        if tokenizer is None:
            raise ConfigError(f"{where}: a tokenizer is required to read text data")
        rows = self.read_rows(path, where)
        where = f"{where} {path}"
        return tokenize_all(
            rows,
            lambda row, i: self.fields.tokenize_row(row, i, tokenizer, max_length, where),
            name=name,
            max_length=max_length,
            limit=self.limit,
        )
