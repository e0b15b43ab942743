"""``ServerConfig``: the HTTP layer's settings (the engine's are ``EngineConfig``), validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from ..specs import ConfigError


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """The HTTP layer's settings (the engine's are ``EngineConfig``).

    served_model_name: the ``model`` that means the base model without adapter (``serve``
        defaults it to the base model's name; None here = "base").
    api_key: when set, every ``/v1/*`` request needs ``Authorization: Bearer <api_key>``
        (``/health`` and ``/metrics`` stay open for probes and scrapers).
    max_request_bytes: larger request bodies are refused (413).
    max_prompt_tokens: longer prompts are refused (400); None = the engine's context length.
    max_tokens_limit: the most tokens one choice may ask for.
    default_max_tokens: chat's ``max_tokens`` when unset (None = what fits in the context);
        completions default to 16 as OpenAI's do.
    max_n: the most choices (``n`` times the number of prompts) one request may ask for.
    max_pending_requests: engine requests in flight (queued or running) above which new
        requests get 503 with ``Retry-After: retry_after_s``.
    rescan_interval_s: how often the adapter store is rescanned (0 = only on requests for
        unknown names and on ``GET /v1/models``).
    max_header_bytes: a request's line and headers larger than this get 431 and a closed
        connection (``serve`` sets it on uvicorn: ``http_limits``).
    header_timeout_s: a request whose line and headers take longer to arrive gets 408 and a
        closed connection (slow-header clients).
    keep_alive_timeout_s: an idle kept-alive connection is closed after this many seconds.
    """

    served_model_name: str | None = None
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None
    max_tokens_limit: int = 4096
    default_max_tokens: int | None = 256
    max_n: int = 16
    max_pending_requests: int = 256
    retry_after_s: int = 1
    rescan_interval_s: float = 10.0
    max_header_bytes: int = 65536
    header_timeout_s: float = 10.0
    keep_alive_timeout_s: int = 5

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_tokens_limit", "max_n", "max_pending_requests", "max_header_bytes",
                     "keep_alive_timeout_s"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ServerConfig.{name}={getattr(self, name)} must be >= 1")
        for name in ("max_prompt_tokens", "default_max_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"ServerConfig.{name}={getattr(self, name)} must be >= 1 or null")
        if not self.header_timeout_s > 0:
            raise ConfigError(f"ServerConfig.header_timeout_s={self.header_timeout_s} must be > 0")
        if self.retry_after_s < 0 or self.rescan_interval_s < 0:
            raise ConfigError("ServerConfig.retry_after_s and rescan_interval_s must be >= 0")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("ServerConfig.api_key must not be empty (leave it null for no key)")
