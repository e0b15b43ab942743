"""Adapter dataset sources (ACLSum, JSONL, Parquet, `datasets`, synthetic) read into tokenized samples.

An adapter's ``dataset`` mapping (``AdapterSpec.dataset``) names one source by ``kind``; each
kind is one module of this package (``jsonl``, ``parquet``, ``hf``, ``aclsum``, ``synthetic``,
sharing ``rows``), and ``registry`` maps kinds to them. ``parse_source`` validates a mapping
into a frozen record (call it before training starts to catch config mistakes early);
``build_source`` parses and reads it into ``TokenizedSample``s.
"""

from .aclsum import AclsumSource
from .hf import HfSource
from .jsonl import JsonlSource
from .parquet import ParquetSource
from .registry import SOURCE_KINDS, SourceSpec, build_source, parse_source
from .synthetic import SyntheticSource

__all__ = ["SOURCE_KINDS", "AclsumSource", "HfSource", "JsonlSource", "ParquetSource", "SourceSpec",
           "SyntheticSource", "build_source", "parse_source"]
