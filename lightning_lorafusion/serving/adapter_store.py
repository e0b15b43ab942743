"""A directory of PEFT adapter directories served by name: scans add new or changed adapters to
the engine and remove vanished ones; names and paths never reach outside the directory."""

from __future__ import annotations

import logging
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..model.peft_io import CONFIG_FILE, WEIGHTS_FILE
from ..specs import ConfigError

log = logging.getLogger(__name__)

# a store name is one path component: no separators, no leading dot (".", "..", hidden and
# half-written export directories like ".name.tmp-x"), nothing a shell or URL would mangle
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
WEIGHT_FILES = (WEIGHTS_FILE, "adapter_model.bin")


class AdapterPathError(ValueError):
    """A name or path that does not name an adapter directory inside the store."""


@dataclass(frozen=True)
class ScanReport:
    added: tuple[str, ...] = ()
    reloaded: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    failed: dict[str, str] = field(default_factory=dict)  # name -> why it could not be loaded


@dataclass(frozen=True)
class _Entry:
    path: Path
    fingerprint: tuple
    origin: str  # "store": found by a scan; "operator": /v1/load_lora_adapter


def valid_adapter_name(name: str) -> bool:
    return isinstance(name, str) and ADAPTER_NAME.fullmatch(name) is not None


class AdapterStore:
    """Serves every adapter directory under ``root`` (``root/<name>/adapter_config.json`` plus
    ``adapter_model.safetensors`` or ``.bin``) under its directory name.

    ``scan()`` adds new directories, reloads changed ones (weights or config rewritten, e.g. a
    new ``fit`` export) and removes vanished ones through ``engine.add_adapter`` /
    ``engine.remove_adapter``; ``lookup(name)`` loads one directory on demand (a request for a
    name the engine does not know yet). Adapters the engine got elsewhere (the serve config's
    fixed ``adapters``) are never touched. Symlinks are followed only while they stay inside
    ``root``. Thread-safe: the server calls it from worker threads.
    """

    def __init__(self, root: str | os.PathLike, engine: Any):
        path = Path(root)
        if not path.is_dir():
            raise ConfigError(f"adapter_dir {str(root)!r} is not a directory; create it or fix the path")
        self.root = path.resolve()
        self._engine = engine
        self._lock = threading.RLock()
        self._entries: dict[str, _Entry] = {}
        self._failed: dict[str, tuple] = {}  # name -> fingerprint that failed to load (retried when it changes)
        self._unloaded: set[str] = set()  # unloaded by an operator: not re-added until loaded again

    # -- paths --------------------------------------------------------------------------------

    def resolve(self, path: str | os.PathLike) -> Path:
        """The adapter directory ``path`` names (relative to the store or absolute), resolved;
        refused unless it, its config and its weights all lie inside the store."""
        p = Path(path)
        p = p if p.is_absolute() else self.root / p
        try:
            real = p.resolve(strict=True)
        except (OSError, RuntimeError):
            raise AdapterPathError(f"{str(path)!r} does not exist in the adapter store") from None
        if real == self.root or not real.is_relative_to(self.root) or not real.is_dir():
            raise AdapterPathError(f"{str(path)!r} is not an adapter directory inside the adapter store")
        files = [real / CONFIG_FILE] + [real / w for w in WEIGHT_FILES if (real / w).exists()]
        if not files[0].is_file() or len(files) == 1:
            raise AdapterPathError(f"{str(path)!r} has no {CONFIG_FILE} and {' or '.join(WEIGHT_FILES)}")
        for f in files:
            if not f.resolve().is_relative_to(self.root):
                raise AdapterPathError(f"{str(path)!r}: {f.name} links outside the adapter store")
        return real

    def _fingerprint(self, path: Path) -> tuple:
        stats = []
        for name in (CONFIG_FILE, *WEIGHT_FILES):
            try:
                st = (path / name).stat()
                stats.append((name, st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                pass
        return tuple(stats)

    def _candidates(self) -> dict[str, Path]:
        found = {}
        try:
            names = os.listdir(self.root)
        except OSError as e:
            log.warning("adapter store %s cannot be listed: %s", self.root, e)
            return found
        for name in names:
            if not valid_adapter_name(name):
                continue
            try:
                found[name] = self.resolve(name)
            except AdapterPathError:
                continue
        return found

    # -- engine bookkeeping --------------------------------------------------------------------

    def _engine_names(self) -> set[str]:
        return {a.name for a in self._engine.adapters()}

    def _add(self, name: str, path: Path, origin: str, *, replace: bool = False) -> Any:
        """Load ``path`` as ``name``; with ``replace`` the engine's adapter of that name is
        updated in place (``Engine.update_adapter``: no moment without the name, its version
        goes up)."""
        fp = self._fingerprint(path)
        try:
            if replace:
                info = self._engine.update_adapter(name, str(path), add=True)
            else:
                info = self._engine.add_adapter(name, str(path))
        except Exception:
            self._failed[name] = fp
            raise
        self._failed.pop(name, None)
        self._entries[name] = _Entry(path, fp, origin)
        return info

    def _remove(self, name: str) -> None:
        self._entries.pop(name, None)
        try:
            self._engine.remove_adapter(name)
        except KeyError:
            pass  # already gone from the engine

    # -- public --------------------------------------------------------------------------------

    def scan(self) -> ScanReport:
        """Bring the engine in line with the directory (see the class docstring)."""
        added, reloaded, removed, failed = [], [], [], {}
        with self._lock:
            candidates = self._candidates()
            for name, entry in list(self._entries.items()):
                if not (entry.path / CONFIG_FILE).is_file():
                    self._remove(name)
                    removed.append(name)
            foreign = self._engine_names() - set(self._entries)
            for name, path in sorted(candidates.items()):
                if name in self._unloaded or name in foreign:
                    continue
                fp = self._fingerprint(path)
                entry = self._entries.get(name)
                if entry is not None and entry.fingerprint == fp and entry.path == path:
                    continue
                if entry is None and self._failed.get(name) == fp:
                    continue  # the same broken files as last time
                try:  # a changed adapter is updated in place: requests naming it never fail meanwhile
                    self._add(name, path, entry.origin if entry else "store", replace=entry is not None)
                except Exception as e:  # a broken adapter must not stop the others
                    failed[name] = str(e)
                    log.warning("adapter %r in %s could not be loaded: %s", name, path, e)
                    if entry is not None:
                        self._remove(name)
                        removed.append(name)
                    continue
                (reloaded if entry is not None else added).append(name)
        if added or reloaded or removed:
            log.info("adapter store %s: added %s, reloaded %s, removed %s", self.root, added, reloaded, removed)
        return ScanReport(tuple(added), tuple(reloaded), tuple(removed), failed)

    def lookup(self, name: str) -> bool:
        """Whether ``name`` is servable now, loading ``root/name`` on demand. Invalid names
        (separators, ``..``, absolute paths, links out of the store) are simply not found."""
        with self._lock:
            if name in self._engine_names():
                return True
            if not valid_adapter_name(name) or name in self._unloaded:
                return False
            try:
                path = self.resolve(name)
            except AdapterPathError:
                return False
            if self._failed.get(name) == self._fingerprint(path):
                return False
            try:
                self._add(name, path, "store")
            except Exception as e:
                log.warning("adapter %r in %s could not be loaded: %s", name, path, e)
                return False
            log.info("adapter store %s: loaded %r on request", self.root, name)
            return True

    def load(self, name: str, path: str | os.PathLike | None = None, *, replace: bool = False) -> Any:
        """Load ``path`` (default ``root/name``) as ``name`` for an operator; returns its
        ``AdapterInfo``. Raises ``AdapterPathError`` for names/paths outside the store and
        ``ValueError`` when the name is already served, unless ``replace``: then its weights
        are swapped in place (``Engine.update_adapter``). Adapters the store did not load
        (the serve config's) are never replaced."""
        if not valid_adapter_name(name):
            raise AdapterPathError(f"adapter name {name!r} must match {ADAPTER_NAME.pattern}")
        with self._lock:
            served = name in self._engine_names()
            if served and not replace:
                raise ValueError(f"adapter {name!r} is already loaded; unload it first, or send replace: true "
                                 "to update its weights in place")
            if served and name not in self._entries:
                raise ValueError(f"adapter {name!r} was not loaded from the adapter store (the serve config's "
                                 "adapters); it cannot be replaced here")
            real = self.resolve(path if path is not None else name)
            self._unloaded.discard(name)
            return self._add(name, real, "operator", replace=served)

    def unload(self, name: str) -> None:
        """Stop serving ``name`` (its pages are freed once no request uses it). A directory
        still in the store is not re-added by scans until it is loaded again. KeyError if unknown."""
        with self._lock:
            if name not in self._engine_names():
                raise KeyError(name)
            self._remove(name)
            if valid_adapter_name(name) and (self.root / name).exists():
                self._unloaded.add(name)
