"""In-place updates over HTTP: ``/v1/load_lora_adapter`` with ``replace``, versions in
``/v1/models`` and in every response (whole and streamed), in this process and through the
engine process."""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch
from fastapi.testclient import TestClient

from lightning_lorafusion.serving import Engine, EngineConfig
from lightning_lorafusion.serving.adapter_store import AdapterStore
from lightning_lorafusion.serving.engine_process import EngineClient
from lightning_lorafusion.serving.server import ServerConfig, create_app

BASE = "tiny"
PROMPT = "w5 w9 w17 w30 w2"
CHAT_TEMPLATE = "{% for m in messages %}w1 {{ m['content'] }} {% endfor %}w3"
CONFIG = dict(num_pages=160, page_size=8, max_num_seqs=16, max_num_batched_tokens=512, backend="torch")


def _versions(client) -> dict:
    return {m["id"]: m.get("adapter_version") for m in client.get("/v1/models").json()["data"]}


def _complete(client, model, **body):
    r = client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "temperature": 0, "max_tokens": 6,
                                             **body})
    assert r.status_code == 200, r.text
    return r


@pytest.mark.parametrize("mode", ["in_process", "engine_process"])
def test_replace_updates_in_place_and_responses_name_the_version(mode, model_dir, adapter_dirs, tmp_path):
    build = functools.partial(Engine.from_pretrained, str(model_dir), {"fixed": adapter_dirs["mlp8"]},
                              EngineConfig(**CONFIG), device="cpu", dtype=torch.float32)
    engine = build() if mode == "in_process" else EngineClient(build)
    engine.tokenizer.chat_template = CHAT_TEMPLATE  # the server applies it in its own process
    store = tmp_path / "store"
    store.mkdir()
    for name in ("all4", "attn2"):
        shutil.copytree(adapter_dirs[name], store / name)
    app = create_app(engine, config=ServerConfig(served_model_name=BASE, rescan_interval_s=0),
                     store=AdapterStore(store, engine))
    try:
        with TestClient(app) as client:
            r = client.post("/v1/load_lora_adapter", json={"lora_name": "tenant", "lora_path": "all4"})
            assert r.status_code == 200, r.text
            assert _versions(client) == {BASE: None, "all4": 1, "attn2": 1, "fixed": 1, "tenant": 1}
            before = _complete(client, "tenant").json()
            assert before["choices"][0]["adapter_version"] == 1
            assert before["choices"][0]["text"] == _complete(client, "all4").json()["choices"][0]["text"]
            r = client.post("/v1/load_lora_adapter", json={"lora_name": "tenant", "lora_path": "all4"})
            assert r.status_code == 400 and "replace" in r.json()["error"]["message"]
            r = client.post("/v1/load_lora_adapter", json={"lora_name": "tenant", "lora_path": "attn2",
                                                           "replace": True})
            assert r.status_code == 200 and "version 2" in r.text
            cards = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
            assert cards["tenant"]["adapter_version"] == 2 and cards["tenant"]["lora"]["rank"] == 2
            after = _complete(client, "tenant").json()
            assert after["choices"][0]["adapter_version"] == 2
            assert after["choices"][0]["text"] == _complete(client, "attn2").json()["choices"][0]["text"]
            assert "adapter_version" not in _complete(client, BASE).json()["choices"][0]  # the base has none
            lines = [line for line in _complete(client, "tenant", stream=True).iter_lines() if line]
            chunks = [json.loads(line[6:]) for line in lines[:-1]]
            assert chunks[-1]["choices"][0]["finish_reason"] is not None
            assert chunks[-1]["choices"][0]["adapter_version"] == 2
            assert all("adapter_version" not in c["choices"][0] for c in chunks[:-1])
            chat = client.post("/v1/chat/completions", json={"model": "tenant", "max_tokens": 3, "temperature": 0,
                                                             "messages": [{"role": "user", "content": "w5"}]})
            assert chat.status_code == 200, chat.text
            assert chat.json()["choices"][0]["adapter_version"] == 2
            for body, param in (({"lora_name": "fixed", "lora_path": "all4", "replace": True}, "lora_name"),
                                ({"lora_name": "tenant", "lora_path": "all4", "replace": "yes"}, None)):
                r = client.post("/v1/load_lora_adapter", json=body)
                assert r.status_code == 400, r.text
                assert param is None or r.json()["error"]["param"] == param
            assert _versions(client)["fixed"] == 1 and _versions(client)["tenant"] == 2
    finally:
        engine.close()


def test_a_rewritten_store_directory_is_updated_in_place(model_dir, adapter_dirs, tmp_path):
    """A rescan that finds changed files swaps the weights with no moment where the name is unknown."""
    engine = Engine.from_pretrained(str(model_dir), None, EngineConfig(**CONFIG), device="cpu", dtype=torch.float32)
    store = tmp_path / "store"
    store.mkdir()
    shutil.copytree(adapter_dirs["all4"], store / "x")
    adapter_store = AdapterStore(store, engine)
    adapter_store.scan()
    calls = []
    engine_remove = engine.remove_adapter
    engine.remove_adapter = lambda name: (calls.append(name), engine_remove(name))
    shutil.rmtree(store / "x")
    shutil.copytree(adapter_dirs["attn2"], store / "x")
    report = adapter_store.scan()
    assert report.reloaded == ("x",) and not calls
    assert [(a.name, a.rank, a.version) for a in engine.adapters()] == [("x", 2, 2)]
    engine.close()
