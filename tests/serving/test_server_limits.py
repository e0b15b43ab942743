"""No request can hurt another: out-of-range numbers are 400 / ConfigError naming the field, a
request's bad settings fail that request only, a killed engine process is restarted, the
admission limit is exact under concurrency, broken adapters in the store hurt nobody, request
heads are bounded in size and time, and vLLM clients' tokenizer calls work."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from lightning_lorafusion.serving import Engine, EngineConfig, GenerationRequest, SamplingParams
from lightning_lorafusion.serving.adapter_store import AdapterStore
from lightning_lorafusion.serving.engine_process import EngineClient
from lightning_lorafusion.serving.server import ServerConfig, create_app
from lightning_lorafusion.specs import ConfigError
from test_server import _Uvicorn  # uvicorn in a thread

BASE = "tiny"
ENGINE_CONFIG = dict(num_pages=160, page_size=8, max_num_seqs=16, max_num_batched_tokens=512, backend="torch")
PROMPT = "w5 w9 w17 w30 w2"


def _build(model_dir, **config):
    return functools.partial(Engine.from_pretrained, str(model_dir), None,
                             EngineConfig(**{**ENGINE_CONFIG, **config}), device="cpu", dtype=torch.float32)


def _store(tmp_path, adapter_dirs, names):
    store = tmp_path / "store"
    store.mkdir()
    for name in names:
        shutil.copytree(adapter_dirs[name], store / name)
    return store


def _error(response, status, *, param=None, code=None):
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def _wait_for(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def served(model_dir, adapter_dirs, tmp_path_factory):
    engine = _build(model_dir)()
    store = _store(tmp_path_factory.mktemp("limits"), adapter_dirs, ["all4", "attn2"])
    app = create_app(engine, config=ServerConfig(served_model_name=BASE, rescan_interval_s=0, max_n=8),
                     store=AdapterStore(store, engine))
    with TestClient(app) as client:
        yield SimpleNamespace(engine=engine, client=client, store=store, app=app)
    engine.close()


# -- numbers out of range ----------------------------------------------------------------------


BIG = 2 ** 70


@pytest.mark.parametrize("field, value, param", [
    ("top_k", BIG, "top_k"),
    ("max_tokens", BIG, "max_tokens"),
    ("seed", BIG, "seed"),
    ("seed", -BIG, "seed"),
    ("n", BIG, "n"),
    ("min_tokens", BIG, "min_tokens"),
    ("stop_token_ids", [BIG], "stop_token_ids"),
    ("logit_bias", {"\u00b2": 1.0}, "logit_bias"),  # "²" is a digit to str.isdigit, not to int()
    ("logit_bias", {str(BIG): 1.0}, "logit_bias"),
    ("repetition_penalty", 1e300, "repetition_penalty"),
])
def test_out_of_range_numbers_are_400_naming_the_field(served, field, value, param):
    r = served.client.post("/v1/completions", json={"model": BASE, "prompt": PROMPT, "temperature": 1.0,
                                                    field: value})
    _error(r, 400, param=param)
    assert served.client.get("/health").status_code == 200


def test_unparseable_bodies_are_400_not_500(served):
    huge = b'{"model": "tiny", "prompt": "w5", "max_tokens": ' + b"9" * 5000 + b"}"  # > Python's 4300 digits
    _error(served.client.post("/v1/completions", content=huge, headers={"content-type": "application/json"}), 400)
    deep = b"[" * 100_000 + b"]" * 100_000  # RecursionError in the JSON decoder
    _error(served.client.post("/v1/completions", content=deep, headers={"content-type": "application/json"}), 400)
    nan = b'{"model": "tiny", "prompt": "w5", "temperature": NaN}'  # Python's json accepts NaN
    _error(served.client.post("/v1/completions", content=nan, headers={"content-type": "application/json"}), 400,
           param="temperature")


@pytest.mark.parametrize("field, value", [("top_k", BIG), ("max_new_tokens", BIG), ("min_tokens", -BIG),
                                          ("seed", BIG), ("stop_token_ids", (BIG,)), ("logit_bias", {BIG: 1.0}),
                                          ("temperature", math.inf), ("top_p", math.nan)])
def test_sampling_params_refuse_out_of_range_numbers_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**{field: value})


def test_a_request_whose_settings_cannot_run_fails_alone(make_engine):
    """Settings that slipped past SamplingParams (set after construction, as a careless caller
    may) are refused at Engine.submit for that request only: the batch keeps running."""
    engine = make_engine(with_adapters=False, backend="torch")
    good = GenerationRequest(prompt_token_ids=(5, 6, 7), sampling=SamplingParams(max_new_tokens=6, temperature=0.0))
    alone = engine.generate([good])[0].token_ids
    bad_params = SamplingParams(temperature=1.0, max_new_tokens=4)
    object.__setattr__(bad_params, "top_k", BIG)  # frozen dataclass: what a careless caller could still do
    bad = GenerationRequest(prompt_token_ids=(5, 6), sampling=bad_params)
    again = GenerationRequest(prompt_token_ids=(5, 6, 7), sampling=SamplingParams(max_new_tokens=6,
                                                                                   temperature=0.0))
    engine.submit(again)
    with pytest.raises(ConfigError, match="top_k"):
        engine.submit(bad)
    while engine.stats()["running"] or engine.stats()["waiting"]:
        engine.step()
    result = engine.generate([dataclasses.replace(again, request_id="again-2")])[0]
    assert result.token_ids == alone and result.finish_reason == "length"


# -- the engine process dies: restarted, adapters back ------------------------------------------


def test_a_killed_engine_process_is_restarted_and_serves_again(model_dir, adapter_dirs, tmp_path, process_exited):
    client = EngineClient(_build(model_dir), restart_on_crash=True)
    store = _store(tmp_path, adapter_dirs, ["all4"])
    app = create_app(client, config=ServerConfig(served_model_name=BASE, rescan_interval_s=0),
                     store=AdapterStore(store, client))
    try:
        with TestClient(app) as http:
            body = {"model": "all4", "prompt": PROMPT, "temperature": 0, "max_tokens": 8}
            before = http.post("/v1/completions", json=body)
            assert before.status_code == 200, before.text
            first_pid = client.pid
            with ThreadPoolExecutor(1) as pool:  # a long request in flight when the process dies
                long = pool.submit(http.post, "/v1/completions", json={
                    "model": "all4", "prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "temperature": 0})
                _wait_for(lambda: client.stats()["running"] > 0)
                os.kill(first_pid, signal.SIGKILL)
                failed = long.result(timeout=60)
            err = _error(failed, 503, code="engine_restarting")
            assert "retry" in err["message"] and failed.headers["retry-after"]
            statuses = set()

            def health() -> str:
                statuses.add(http.get("/health").json()["status"])
                return http.get("/health").json()["status"]

            _wait_for(lambda: health() == "ok", timeout=120)
            assert "restarting" in statuses  # /health said so while the new process started
            assert client.pid != first_pid and process_exited(first_pid) and client.restarts == 1
            after = http.post("/v1/completions", json=body)  # the adapter was added again
            assert after.status_code == 200, after.text
            assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
            assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [BASE, "all4"]
    finally:
        client.close()


# -- the admission limit is exact --------------------------------------------------------------


def test_admission_limit_is_exact_with_more_clients_than_the_limit(served):
    """Twelve requests at once against a limit of three: exactly three are admitted (checking
    the limit and counting a request in must not be split by an await)."""
    import asyncio

    limit, clients = 3, 12
    app = create_app(served.engine, config=ServerConfig(served_model_name=BASE, max_pending_requests=limit))
    body = {"model": BASE, "prompt": "w5 w6", "max_tokens": 100, "ignore_eos": True, "temperature": 0}

    async def all_at_once():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(clients)))

    answers = asyncio.run(all_at_once())
    assert sorted(r.status_code for r in answers) == [200] * limit + [503] * (clients - limit)
    assert all(r.json()["error"]["code"] == "server_overloaded" for r in answers if r.status_code == 503)
    assert not app.state.server.in_flight


# -- broken adapters hurt nobody; /v1/models shows no server paths ------------------------------


def _copy_with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))  # NaN is written as NaN, as json.dumps does


@pytest.mark.parametrize("changes", [{"lora_alpha": math.nan}, {"lora_alpha": math.inf}, {"lora_alpha": -4.0},
                                     {"lora_alpha": 0}, {"r": 0}, {"r": True}])
def test_adapters_with_bad_rank_or_alpha_are_skipped_and_refused(served, adapter_dirs, changes):
    name = "bad-" + "-".join(f"{k}{v}" for k, v in changes.items()).replace(".", "_")
    _copy_with_config(Path(adapter_dirs["attn2"]), served.store / name, **changes)
    try:
        models = served.client.get("/v1/models")
        assert models.status_code == 200
        assert name not in [m["id"] for m in models.json()["data"]]
        _error(served.client.post("/v1/completions", json={"model": name, "prompt": PROMPT}), 404)
        r = served.client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": name})
        err = _error(r, 400)
        assert "lora_alpha" in err["message"] or " r" in err["message"] or "r=" in err["message"]
    finally:
        shutil.rmtree(served.store / name)


def _corrupt(path, how):
    weights = path / "adapter_model.safetensors"
    if how == "json-array":
        (path / "adapter_config.json").write_text("[1, 2]")
    elif how == "not-json":
        (path / "adapter_config.json").write_text("{")
    elif how == "truncated":
        weights.write_bytes(weights.read_bytes()[:100])
    elif how == "huge-header":
        weights.write_bytes((2 ** 62).to_bytes(8, "little") + b"{}")
    elif how == "pickle":
        weights.unlink()

        class Payload:  # refused by torch.load(weights_only=True): never executed
            def __reduce__(self):
                return (print, ("executed",))

        import pickle

        (path / "adapter_model.bin").write_bytes(pickle.dumps(Payload()))


@pytest.mark.parametrize("how", ["json-array", "not-json", "truncated", "huge-header", "pickle"])
def test_load_endpoint_answers_400_for_unreadable_adapter_files(served, adapter_dirs, how):
    name = f"broken-{how}"
    shutil.copytree(adapter_dirs["attn2"], served.store / name)
    _corrupt(served.store / name, how)
    try:
        _error(served.client.post("/v1/load_lora_adapter", json={"lora_name": name}), 400)
        assert served.client.get("/v1/models").status_code == 200
        assert served.client.get("/health").status_code == 200
    finally:
        shutil.rmtree(served.store / name)


def test_models_cannot_fail_on_one_adapters_metadata(served, monkeypatch):
    real = served.engine.adapters

    def with_a_nan_alpha():
        listed = real()
        return listed + [dataclasses.replace(listed[0], name="nan-alpha", alpha=math.nan)]

    monkeypatch.setattr(served.engine, "adapters", with_a_nan_alpha)
    r = served.client.get("/v1/models")
    assert r.status_code == 200, r.text
    cards = {m["id"]: m for m in r.json()["data"]}
    assert "nan-alpha" in cards and "lora" not in cards["nan-alpha"] and cards["all4"]["lora"]["rank"] == 4


def test_models_show_paths_relative_to_the_store(served):
    cards = {m["id"]: m for m in served.client.get("/v1/models").json()["data"]}
    assert cards["all4"]["root"] == "all4" and cards["attn2"]["root"] == "attn2"
    assert str(served.store) not in json.dumps(cards)


# -- sizes before work -------------------------------------------------------------------------


def test_prompt_lists_are_refused_before_they_are_tokenized(served, monkeypatch):
    from lightning_lorafusion.serving import openai_api

    def must_not_run(*args, **kwargs):
        raise AssertionError("tokenized before the size check")

    monkeypatch.setattr(openai_api, "completion_prompts", must_not_run)
    r = served.client.post("/v1/completions", json={"model": BASE, "prompt": ["w5 w6"] * 50_000})
    _error(r, 400, param="n")


# -- request heads: size and time --------------------------------------------------------------


def _read_until(sock, end: bytes) -> bytes:
    data = b""
    while not data.endswith(end):
        chunk = sock.recv(4096)
        assert chunk, data
        data += chunk
    return data


def test_request_heads_are_bounded_in_size_and_time(served):
    from lightning_lorafusion.serving.http_limits import uvicorn_limits

    config = ServerConfig(served_model_name=BASE, max_header_bytes=8192, header_timeout_s=1.0,
                          keep_alive_timeout_s=1)
    for http in ("h11", "httptools"):
        server = _Uvicorn(create_app(served.engine, config=config), **uvicorn_limits(config, http=http))
        try:
            ok = httpx.get(f"{server.url}/health", headers={"x-small": "a" * 1000})
            assert ok.status_code == 200
            big = httpx.get(f"{server.url}/health", headers={f"x-h{i}": "a" * 1000 for i in range(64)})
            assert big.status_code == 431, (http, big.status_code)
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as slow:
                slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the end of the headers
                answer = slow.recv(4096)  # within the socket's 10 s timeout, or the test fails
                assert answer.startswith(b"HTTP/1.1 408"), (http, answer)
                assert slow.recv(4096) == b""  # closed by the server
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as kept:
                kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert _read_until(kept, b'{"status":"ok"}').startswith(b"HTTP/1.1 200")
                kept.sendall(b"GET /health HTTP/1.1\r\nHo")  # a second request, stalled in its headers
                assert kept.recv(4096).startswith(b"HTTP/1.1 408")
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as idle:
                idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert _read_until(idle, b'{"status":"ok"}').startswith(b"HTTP/1.1 200")
                assert idle.recv(4096) == b""  # then idle: closed after keep_alive_timeout_s (a recv timeout fails)
        finally:
            server.stop()


# -- clients that expect vLLM's tokenizer endpoints ----------------------------------------------


def test_tokenizer_info_and_tokenize_as_lm_eval_remote_tokenizer_calls_them(served, monkeypatch):
    from tokenizers.processors import TemplateProcessing

    tok = served.engine.tokenizer
    monkeypatch.setattr(tok._tokenizer, "post_processor",
                        TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)]))
    info = served.client.get("/tokenizer_info")
    assert info.status_code == 200
    body = info.json()
    assert body["tokenizer_class"] == type(tok).__name__ and body["eos_token"] == tok.eos_token
    assert body["bos_token"] == tok.bos_token and "chat_template" in body
    # lm-eval's remote tokenizer: no model, no special tokens
    plain = served.client.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False})
    assert plain.status_code == 200, plain.text
    assert plain.json()["tokens"] == tok(PROMPT, add_special_tokens=False)["input_ids"]
    with_bos = served.client.post("/tokenize", json={"prompt": PROMPT})  # vLLM's default: true
    assert with_bos.json()["tokens"] == [tok.bos_token_id] + plain.json()["tokens"]
    back = served.client.post("/detokenize", json={"tokens": plain.json()["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"] == tok.decode(plain.json()["tokens"])
    # with a model (vLLM's clients send it): an adapter's name works, an unknown one is a 404
    assert served.client.post("/tokenize", json={"model": "all4", "prompt": PROMPT}).status_code == 200
    _error(served.client.post("/detokenize", json={"model": "nope", "tokens": [5]}), 404)


# -- serve without its extra -------------------------------------------------------------------


def test_serve_without_the_serve_extra_is_a_one_line_error(monkeypatch, capsys):
    from lightning_lorafusion.serving import serve_cli

    from lightning_lorafusion.cli import main

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn -> ModuleNotFoundError
    for run in (lambda: serve_cli.run(["--base_model", "anything"]),
                lambda: main(["serve", "--base_model", "anything"])):  # the console script's path
        code = run()
        err = capsys.readouterr().err.strip()
        assert code != 0 and len(err.splitlines()) == 1, err
        assert 'pip install -e ".[serve]"' in err and "uvicorn" in err and "Traceback" not in err
