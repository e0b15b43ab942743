"""Parquet source: a table with the same columns as the JSONL rows, read with pyarrow."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...specs import ConfigError
from .jsonl import JsonlSource

@dataclass(frozen=True, kw_only=True)
class ParquetSource(JsonlSource):
    """A Parquet table with the same columns as the JSONL rows (read with pyarrow)."""

    kind: str = "parquet"

    def read_rows(self, path: Path, where: str) -> list[Any]:
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            raise ConfigError(
                f"{where}: reading Parquet needs pyarrow; pip install 'pyarrow>=15'"
            ) from err
        try:
            return pq.read_table(path).to_pylist()
        except Exception as err:  # pyarrow raises its own error types for corrupt files
            raise ConfigError(f"{where}: cannot read {path} as Parquet: {err}") from err
