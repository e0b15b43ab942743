"""`lightning-lorafusion serve --config serve.yaml`: YAML plus command-line overrides (jsonargparse,
as `fit`), then the engine, the adapter store and the HTTP server under uvicorn."""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
from argparse import ArgumentError
from pathlib import Path

from jsonargparse import ActionConfigFile, ArgumentParser

from ..specs import ConfigError

API_KEY_ENV = "LORAFUSION_API_KEY"
# what `serve` needs beyond the core install: the `serve` extra of pyproject.toml
SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client")
SERVE_EXTRA_HINT = 'pip install -e ".[serve]"'


def missing_serve_module() -> str | None:
    """The first module of the ``serve`` extra that cannot be imported (None: all present)."""
    import importlib

    for name in SERVE_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            return name
    return None


def build_parser() -> ArgumentParser:
    from . import EngineConfig
    from .server import ServerConfig

    parser = ArgumentParser(
        prog="lightning-lorafusion serve",
        description="Serve a base model and every LoRA adapter of a directory behind one OpenAI-compatible "
                    "endpoint (the request's `model` names the adapter).",
        default_config_files=[],
    )
    parser.add_argument("--config", action=ActionConfigFile, help="A serve.yaml (see configs/serve.yaml).")
    parser.add_argument("--base_model", type=str, required=True,
                        help="The base: a local HF model directory or a name fit accepts (smollm2-135m-instruct).")
    parser.add_argument("--adapter_dir", type=str | None, default=None,
                        help="The adapter store: a directory of PEFT adapter directories, served under their "
                             "directory names; new ones are picked up without a restart.")
    parser.add_argument("--adapters", type=dict[str, str], default={},
                        help="Fixed adapters outside the store: name -> PEFT directory.")
    parser.add_argument("--host", type=str, default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", type=str | None, default=None, help="cuda, cuda:1, cpu (default: cuda if present).")
    parser.add_argument("--dtype", type=str | None, default=None,
                        help="bfloat16, float16, float32 (default: the engine's).")
    parser.add_argument("--engine_process", type=bool | None, default=None,
                        help="Run the engine in a child process (true) or in the server's process (false); "
                             "null (default): a child process when the engine runs on CUDA, where HTTP work "
                             "and engine steps sharing one GIL cost throughput (docs/serving_http.md).")
    parser.add_argument("--warm_up", type=bool | None, default=None,
                        help="Before accepting requests, run a few synthetic requests through the base and one "
                             "adapter of each rank (Engine.warm_up): kernel compiles and first graph replays "
                             "happen at startup, not in the first users' requests. null (default): on when the "
                             "engine runs on CUDA (on the CPU there is nothing to compile; it only delays start).")
    parser.add_argument("--log_level", type=str, default="info")
    parser.add_argument("--graceful_shutdown_s", type=float, default=30.0,
                        help="On SIGTERM/SIGINT, how long running requests may finish before they are cancelled.")
    parser.add_class_arguments(EngineConfig, "engine", help="The generation engine's settings.")
    parser.add_class_arguments(ServerConfig, "server", help="The HTTP layer's settings.")
    return parser


def parse_args(parser: ArgumentParser, argv: list[str]):
    """``parser.parse_args``, except that an engine key moved into ``engine.tuning`` (in the YAML
    or on the command line) is a ConfigError naming its new place."""
    from .config import MOVED_TO_TUNING, moved_key_error

    parser.exit_on_error = False
    try:
        return parser.parse_args(argv)
    except ArgumentError as e:
        moved = re.search(r"(?:Group 'engine' does not accept option '|--engine\.)(\w+)", str(e))
        if moved is not None and moved.group(1) in MOVED_TO_TUNING:
            raise moved_key_error(moved.group(1)) from None
        parser.exit_on_error = True
        parser.error(str(e))  # as parse_args reports any other error: usage, message, exit 2


def _dtype(name: str | None):
    if name is None:
        return None
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"dtype {name!r} is not a torch dtype; use bfloat16, float16 or float32")
    return dtype


def on_cuda_unless_set(setting: bool | None, device: str | None) -> bool:
    """A switch that is True, False, or None = on when the engine runs on CUDA (``device``
    names it, or none is given and CUDA is available): ``engine_process`` and ``warm_up``."""
    if setting is not None:
        return setting
    if device is not None:
        return device.startswith("cuda")
    import torch

    return torch.cuda.is_available()


use_engine_process = should_warm_up = on_cuda_unless_set


def run(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (``--print_config`` prints the merged config and exits), build everything
    and serve until SIGINT/SIGTERM. Returns the process exit code."""
    missing = missing_serve_module()
    if missing is not None:
        print(f"lightning-lorafusion serve: error: the server needs the 'serve' extra ({missing} is not installed): "
              f"{SERVE_EXTRA_HINT}", file=sys.stderr)
        return 1
    import uvicorn

    from . import Engine
    from .adapter_store import AdapterStore
    from .engine_process import EngineClient
    from .http_limits import uvicorn_limits
    from .server import create_app

    parser = build_parser()
    try:
        cfg = parse_args(parser, argv if argv is not None else sys.argv[1:])
    except ConfigError as e:
        print(f"lightning-lorafusion serve: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(), format="[lorafusion] %(message)s")
    try:
        objs = parser.instantiate(cfg)
        server_cfg = objs.server
        overrides = {}
        if server_cfg.api_key is None and os.environ.get(API_KEY_ENV):
            overrides["api_key"] = os.environ[API_KEY_ENV]
        if server_cfg.served_model_name is None:
            overrides["served_model_name"] = Path(cfg.base_model).name
        if overrides:
            server_cfg = type(server_cfg)(**{**vars(server_cfg), **overrides})
        build = functools.partial(Engine.from_pretrained, cfg.base_model, adapters=dict(cfg.adapters) or None,
                                  config=objs.engine, device=cfg.device, dtype=_dtype(cfg.dtype))
        engine = EngineClient(build, restart_on_crash=True) if use_engine_process(cfg.engine_process, cfg.device) else build()
        store = AdapterStore(cfg.adapter_dir, engine) if cfg.adapter_dir else None
        if should_warm_up(cfg.warm_up, cfg.device):
            if store is not None:
                store.scan()  # the store's adapters too (the server would scan them at its start anyway)
            done = engine.warm_up()
            logging.getLogger("lightning_lorafusion.serving").info(warm_up_summary(done))
    except ConfigError as e:
        print(f"lightning-lorafusion serve: error: {e}", file=sys.stderr)
        return 2
    app = create_app(engine, config=server_cfg, store=store)
    try:
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level.lower(),
                    timeout_graceful_shutdown=cfg.graceful_shutdown_s, **uvicorn_limits(server_cfg))
    finally:
        engine.close()
    return 0


def warm_up_summary(done: dict) -> str:
    """``Engine.warm_up``'s report as the one line ``serve`` logs: its time and what it compiled
    and captured (also on ``/metrics``: ``lorafusion_warm_up_seconds``, ``lorafusion_cuda_graphs``...)."""
    from .warm_up import format_capture_counts

    return (f"warm-up: {done['requests']} requests (base and adapter ranks {done['ranks']}) in "
            f"{done['seconds']:.2f} s (decode graphs captured at start in {done['decode_graphs_s']:.2f} s; "
            f"{done['compile_ahead']['variants']} kernel variants compiled ahead by "
            f"{done['compile_ahead']['workers']} threads in {done['compile_s']:.2f} s; their list "
            f"{_variant_source(done['compile_ahead'].get('source'))}, the decode graphs' "
            f"{_variant_source(done.get('decode_compile', {}).get('source'))}); "
            f"captured: {format_capture_counts(done['captures'])}; Triton kernels: {done['triton_kernels']} "
            f"variants, {done['triton_compiled']} compiled fresh, the rest from {done['triton_cache_dir']}")


def _variant_source(source: str | None) -> str:
    """How a list of kernel variants was found (``variant_record.recorded_variants``), in words."""
    return {"record": "read from its record", "recorded": "found by running the steps, then kept",
            "off": "found by running the steps"}.get(source or "off", "found by running the steps")


if __name__ == "__main__":
    sys.exit(run())
