"""The HTTP server against a real engine (tiny random Llama, PEFT adapters in a store): OpenAI
endpoints, streaming, echo scoring vs HF + PEFT, n/seed/stop, errors, security, store pickup,
metrics, disconnects, shutdown, and `serve` as a subprocess queried with the openai client. The key
cases run twice: engine in the server's process, and in its own (``EngineClient``)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import subprocess
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

REPO = Path(__file__).resolve().parents[2]
BASE = "tiny"
# role words are vocabulary words of the random model's word-level tokenizer
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}w1{% else %}w2{% endif %} "
                 "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w3{% endif %}")
ENGINE_CONFIG = dict(num_pages=160, page_size=8, max_num_seqs=16, max_num_batched_tokens=512, backend="torch")
PROMPT = "w5 w9 w17 w30 w2"
# where the engine runs: the server's process (Engine) or a child process (EngineClient)
MODES = ["in_process", "engine_process"]


def _engine(model_dir, mode: str = "in_process", **config) -> Engine | EngineClient:
    build = functools.partial(Engine.from_pretrained, str(model_dir), None,
                              EngineConfig(**{**ENGINE_CONFIG, **config}), device="cpu", dtype=torch.float32)
    engine = build() if mode == "in_process" else EngineClient(build)
    engine.tokenizer.chat_template = CHAT_TEMPLATE  # the server applies chat templates in its own process
    return engine


def _store(tmp_path, adapter_dirs, names) -> Path:
    store = tmp_path / "store"
    store.mkdir()
    for name in names:
        shutil.copytree(adapter_dirs[name], store / name)
    return store


def _greedy(engine, prompt_ids, adapter, max_new_tokens, **kw):
    req = GenerationRequest(prompt_token_ids=tuple(prompt_ids), adapter=adapter,
                            sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **kw))
    return engine.generate([req])[0]


def _sse(response) -> list:
    """Decoded `data:` payloads of an event stream; checks it ends with [DONE]."""
    lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    return [json.loads(line[6:]) for line in lines[:-1]]


def _error(response, status, *, param=None, code=None):
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


@pytest.fixture(scope="module", params=MODES)
def served(request, model_dir, adapter_dirs, tmp_path_factory):
    """One app over a store holding two of the three test adapters (mlp8 stays outside)."""
    engine = _engine(model_dir, request.param)
    store = _store(tmp_path_factory.mktemp("served"), adapter_dirs, ["all4", "attn2"])
    app = create_app(engine, config=ServerConfig(served_model_name=BASE, rescan_interval_s=0),
                     store=AdapterStore(store, engine))
    with TestClient(app) as client:
        yield SimpleNamespace(engine=engine, client=client, store=store)
    engine.close()


def _complete(client, **body):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


# -- endpoints ---------------------------------------------------------------------------------


def test_models_lists_base_and_adapters_with_rank_and_targets(served, adapter_dirs):
    r = served.client.get("/v1/models")
    assert r.status_code == 200
    data = r.json()["data"]
    assert [m["id"] for m in data] == [BASE, "all4", "attn2"]
    assert "lora" not in data[0]
    for card in data[1:]:
        cfg = json.loads((Path(adapter_dirs[card["id"]]) / "adapter_config.json").read_text())
        assert card["parent"] == BASE and card["object"] == "model"
        assert card["lora"]["rank"] == cfg["r"] and card["lora"]["alpha"] == cfg["lora_alpha"]
        assert sorted(card["lora"]["target_modules"]) == sorted(cfg["target_modules"])
    assert served.client.get("/health").json() == {"status": "ok"}


def test_greedy_completions_equal_engine_generate_per_adapter(served):
    prompt_ids = served.engine.tokenizer(PROMPT)["input_ids"]
    texts = {}
    for model, adapter in ((BASE, None), ("all4", "all4"), ("attn2", "attn2")):
        body = _complete(served.client, model=model, max_tokens=8)
        expected = _greedy(served.engine, prompt_ids, adapter, 8)
        (choice,) = body["choices"]
        assert choice["text"] == expected.text and choice["finish_reason"] == expected.finish_reason
        assert body["model"] == model and body["object"] == "text_completion"
        assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": len(expected.token_ids),
                                 "total_tokens": len(prompt_ids) + len(expected.token_ids)}
        texts[model] = choice["text"]
    assert len(set(texts.values())) == 3  # each adapter changes the output


def test_chat_uses_the_chat_template_and_equals_engine_generate(served):
    messages = [{"role": "system", "content": "w40"}, {"role": "user", "content": "w11 w12 w13"}]
    r = served.client.post("/v1/chat/completions", json={"model": "attn2", "messages": messages, "max_tokens": 6,
                                                         "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    prompt_ids = served.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                             return_dict=True)["input_ids"]
    expected = _greedy(served.engine, prompt_ids, "attn2", 6)
    (choice,) = body["choices"]
    assert body["object"] == "chat.completion"
    assert choice["message"] == {"role": "assistant", "content": expected.text}
    assert body["usage"]["prompt_tokens"] == len(prompt_ids) == 7
    assert body["usage"]["completion_tokens"] == len(expected.token_ids)


def test_streamed_completion_equals_the_non_streamed_one_with_usage_last(served):
    full = _complete(served.client, model="all4", max_tokens=10)
    with served.client.stream("POST", "/v1/completions", json={
            "model": "all4", "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = _sse(r)
    *deltas, usage = chunks
    assert "".join(c["choices"][0]["text"] for c in deltas) == full["choices"][0]["text"]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in deltas)
    assert deltas[-1]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in deltas[:-1])
    assert usage["choices"] == [] and usage["usage"] == full["usage"]


def test_streamed_chat_with_n_choices(served):
    body = {"model": "all4", "messages": [{"role": "user", "content": "w20 w21"}], "max_tokens": 5,
            "temperature": 1.0, "seed": 3, "n": 2}
    full = served.client.post("/v1/chat/completions", json=body).json()
    with served.client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        chunks = _sse(r)
    texts, roles, finish = ["", ""], set(), {}
    for c in chunks:
        assert c["object"] == "chat.completion.chunk" and "usage" not in c
        (choice,) = c["choices"]
        roles.add((choice["index"], choice["delta"].get("role")))
        texts[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            finish[choice["index"]] = choice["finish_reason"]
    assert {(0, "assistant"), (1, "assistant")} <= roles
    assert texts == [c["message"]["content"] for c in full["choices"]]
    assert finish == {c["index"]: c["finish_reason"] for c in full["choices"]}


def test_echo_scores_the_prompt_like_hf_peft(served, hf_reference):
    prompt = [10, 20, 30, 11, 25, 40, 7]
    for max_tokens in (0, 1):
        body = _complete(served.client, model="attn2", prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=1)
        (choice,) = body["choices"]
        lp = choice["logprobs"]
        ref = torch.log_softmax(hf_reference.logits(prompt, "attn2"), dim=-1)
        expected = [None] + [ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
        got = lp["token_logprobs"][:len(prompt)]
        assert got[0] is None and len(lp["tokens"]) == len(prompt) + max_tokens
        assert max(abs(g - e) for g, e in zip(got[1:], expected[1:])) < 1e-4
        assert choice["text"].startswith(served.engine.tokenizer.decode(prompt))
        assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": max_tokens,
                                 "total_tokens": len(prompt) + max_tokens}
        if max_tokens == 1:  # the generated token: greedy, with its logprob and top-1
            token = int(ref[-1].argmax())
            assert abs(lp["token_logprobs"][-1] - ref[-1, token].item()) < 1e-4
            assert lp["top_logprobs"][-1] == {served.engine.tokenizer.decode([token]): lp["token_logprobs"][-1]}


def test_echo_logprobs_have_the_shape_lm_eval_reads(served, hf_reference):
    """lm-evaluation-harness ``local-completions`` scores a continuation with echo, logprobs=1
    and max_tokens=1, then reads ``token_logprobs[ctxlen:-1]`` and ``top_logprobs[ctxlen:-1]``
    (a dict per token; greedy if the token's logprob is the top one). With max_tokens=0 the
    same lists cover exactly the prompt. Both against HF + PEFT's log-softmax."""
    prompt, ctxlen = [10, 20, 30, 11, 25, 40, 7], 4
    ref = torch.log_softmax(hf_reference.logits(prompt, "attn2").double(), dim=-1)
    decode = served.engine.tokenizer.decode
    bodies = [_complete(served.client, model="attn2", prompt=[prompt, prompt[:3]], max_tokens=m, echo=True,
                        logprobs=1) for m in (1, 0)]
    for max_tokens, body in zip((1, 0), bodies):
        lp = body["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(prompt) + max_tokens
        assert lp["top_logprobs"][0] is None and all(isinstance(d, dict) and len(d) == 1
                                                     for d in lp["top_logprobs"][1:])
        end = len(prompt) if max_tokens == 0 else -1
        continuation = lp["token_logprobs"][ctxlen:end]
        tops = lp["top_logprobs"][ctxlen:end]
        assert len(continuation) == len(tops) == len(prompt) - ctxlen
        for t, (value, top) in zip(range(ctxlen, len(prompt)), zip(continuation, tops)):
            assert value == pytest.approx(ref[t - 1, prompt[t]].item(), abs=1e-4)
            best = int(ref[t - 1].argmax())
            assert top == {decode([best]): pytest.approx(ref[t - 1, best].item(), abs=1e-4)}
            assert (value == max(top.values())) == (best == prompt[t])  # lm-eval's is_greedy test
        assert body["usage"]["completion_tokens"] == 2 * max_tokens
        short = body["choices"][1]
        assert short["finish_reason"] == "length" and len(short["logprobs"]["tokens"]) == 3 + max_tokens


def test_generated_token_logprobs_equal_hf_peft(served, hf_reference):
    prompt = [12, 13, 14, 15]
    body = _complete(served.client, model="all4", prompt=prompt, max_tokens=4, logprobs=3)
    lp = body["choices"][0]["logprobs"]
    generated = served.engine.tokenizer.convert_tokens_to_ids(lp["tokens"])
    ref = torch.log_softmax(hf_reference.logits(prompt + generated, "all4"), dim=-1)
    for k, tok in enumerate(generated):
        row = ref[len(prompt) + k - 1]
        assert abs(lp["token_logprobs"][k] - row[tok].item()) < 1e-4
        top = torch.topk(row, 3)
        expected = {served.engine.tokenizer.decode([int(i)]): v.item() for v, i in zip(top.values, top.indices)}
        assert lp["top_logprobs"][k].keys() == expected.keys()
        assert max(abs(lp["top_logprobs"][k][t] - v) for t, v in expected.items()) < 1e-4
    chat = served.client.post("/v1/chat/completions", json={
        "model": "all4", "messages": [{"role": "user", "content": "w8"}], "max_tokens": 2, "temperature": 0,
        "logprobs": True, "top_logprobs": 2}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and all(len(c["top_logprobs"]) == 2 for c in content)
    assert all(c["top_logprobs"][0]["logprob"] >= c["top_logprobs"][1]["logprob"] for c in content)
    assert all(c["logprob"] == c["top_logprobs"][0]["logprob"] for c in content)  # greedy = most likely


def test_n_choices_use_seed_plus_index_and_reproduce(served):
    body = {"model": "attn2", "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 3}
    first = _complete(served.client, **body)
    again = _complete(served.client, **body)
    texts = [c["text"] for c in first["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert texts == [c["text"] for c in again["choices"]]
    assert len(set(texts)) > 1
    single = _complete(served.client, **{**body, "n": 1, "seed": 8})
    assert single["choices"][0]["text"] == texts[1]
    assert first["usage"]["prompt_tokens"] == 3 * len(served.engine.tokenizer(PROMPT)["input_ids"])


def test_stop_string_cuts_the_text(served):
    free = _complete(served.client, model="all4", max_tokens=8, ignore_eos=True)["choices"][0]["text"]
    words = free.split()
    stop = words[3]
    cut = _complete(served.client, model="all4", max_tokens=8, ignore_eos=True, stop=[stop])["choices"][0]
    assert cut["text"] == free[:free.index(stop)] and cut["finish_reason"] == "stop"


def test_logit_bias_and_penalties_reach_the_engine(served):
    """A +100 bias on one token makes greedy decoding repeat it; a strong repetition penalty
    with that bias turns it off after its first use; a bias outside the vocabulary is a 400."""
    tok = served.engine.tokenizer
    word = "w7"
    (tid,) = tok.encode(word, add_special_tokens=False)
    forced = _complete(served.client, model="all4", max_tokens=4, ignore_eos=True, logit_bias={str(tid): 100})
    assert forced["choices"][0]["text"].split() == [word] * 4
    # a +5 bias picks w7 first; once it is in the output the repetition penalty divides its
    # (positive) logit by 50 and the presence penalty takes 2 more off: it is not picked again
    free = _complete(served.client, model="all4", max_tokens=4, ignore_eos=True)["choices"][0]["text"].split()
    once = _complete(served.client, model="all4", max_tokens=4, ignore_eos=True, logit_bias={str(tid): 5},
                     repetition_penalty=50.0, presence_penalty=2.0)["choices"][0]["text"].split()
    assert once[0] == word and word not in once[1:] and free != [word] * 4
    _error(served.client.post("/v1/completions", json={"model": BASE, "prompt": "w5", "logit_bias": {"64": 1}}),
           400)
    # vLLM's stop_token_ids and min_tokens: stop on w7's id at once; with min_tokens 3, w7
    # cannot be picked for 3 tokens, then its +100 bias picks it and the request stops
    stopped = _complete(served.client, model="all4", max_tokens=4, ignore_eos=True, logit_bias={str(tid): 100},
                        stop_token_ids=[tid])["choices"][0]
    assert stopped["text"] == "" and stopped["finish_reason"] == "stop"
    held = _complete(served.client, model="all4", max_tokens=4, ignore_eos=True, logit_bias={str(tid): 100},
                     stop_token_ids=[tid], min_tokens=3)["choices"][0]
    assert len(held["text"].split()) == 3 and word not in held["text"].split() and held["finish_reason"] == "stop"
    _error(served.client.post("/v1/completions", json={"model": BASE, "prompt": "w5", "max_tokens": 2,
                                                       "min_tokens": 3}), 400)


def test_tokenize_and_detokenize_give_what_the_server_runs(served):
    """vLLM's /tokenize: the prompt's ids as completions run them (usage counts them), chat
    messages as chat completions run them; /detokenize inverts; unknown model 404, bad ids 400."""
    c = served.client
    got = c.post("/tokenize", json={"model": "all4", "prompt": PROMPT}).json()
    usage = _complete(c, model="all4", max_tokens=1)["usage"]
    assert got["count"] == len(got["tokens"]) == usage["prompt_tokens"] and got["max_model_len"] == 128
    assert c.post("/detokenize", json={"model": BASE, "tokens": got["tokens"]}).json()["prompt"] == \
        served.engine.tokenizer.decode(got["tokens"])
    messages = [{"role": "user", "content": "w5 w6"}]
    chat = c.post("/tokenize", json={"model": BASE, "messages": messages}).json()
    bare = c.post("/tokenize", json={"model": BASE, "messages": messages, "add_generation_prompt": False}).json()
    answered = c.post("/v1/chat/completions", json={"model": BASE, "messages": messages, "max_tokens": 1,
                                                    "temperature": 0}).json()
    assert chat["count"] == answered["usage"]["prompt_tokens"] == bare["count"] + 1  # the template's "w3"
    _error(c.post("/tokenize", json={"model": "nope", "prompt": "w5"}), 404)
    _error(c.post("/tokenize", json={"model": BASE}), 400)
    _error(c.post("/tokenize", json={"model": BASE, "prompt": "w5", "messages": messages}), 400)
    _error(c.post("/detokenize", json={"model": BASE, "tokens": [5, 64]}), 400, param="tokens")


def test_several_prompts_and_token_id_prompts(served):
    prompts = [[9, 10, 11], [30, 31]]
    body = _complete(served.client, model=BASE, prompt=prompts, max_tokens=3, n=2)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for i, choice in enumerate(body["choices"]):
        assert choice["text"] == _greedy(served.engine, prompts[i // 2], None, 3).text
    assert body["usage"]["prompt_tokens"] == 2 * (3 + 2)


# -- errors and security -----------------------------------------------------------------------


@pytest.mark.parametrize("body,status,param", [
    ({"model": "nope", "prompt": "w5"}, 404, "model"),
    ({"prompt": "w5"}, 400, "model"),
    ({"model": BASE, "prompt": "w5", "temperature": "hot"}, 400, "temperature"),
    ({"model": BASE, "prompt": list(range(4, 64)) * 3}, 400, "prompt"),  # 180 tokens > context 128
    ({"model": BASE, "prompt": "w5", "max_tokens": 100000}, 400, "max_tokens"),
    ({"model": BASE, "prompt": "w5 w6 w7 w8", "max_tokens": 125}, 400, "max_tokens"),  # 4 + 125 > 128
    ({"model": BASE, "prompt": "w5", "stream": True, "echo": True}, 400, "echo"),
    ({"model": BASE, "prompt": "w5", "n": 17}, 400, "n"),
    ({"model": BASE, "prompt": [5, 64]}, 400, "prompt"),
])
def test_bad_requests_get_openai_errors(served, body, status, param):
    _error(served.client.post("/v1/completions", json=body), status, param=param)


def test_malformed_and_oversized_bodies(served):
    _error(served.client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
           400)
    _error(served.client.post("/v1/chat/completions", json=[1, 2]), 400)
    _error(served.client.post("/v1/completions", json={"model": BASE, "prompt": "w5 " * 400_000}), 413)
    _error(served.client.get("/v1/nothing"), 404)


@pytest.mark.parametrize("name", ["../all4", "all4/../attn2", "/etc", ".", "..", ".hidden", "all4/", "%2e%2e"])
def test_model_names_cannot_leave_the_store(served, name):
    _error(served.client.post("/v1/completions", json={"model": name, "prompt": "w5"}), 404, code="model_not_found")


def test_api_key_is_required_on_v1_routes(model_dir, adapter_dirs, tmp_path):
    engine = _engine(model_dir)
    app = create_app(engine, config=ServerConfig(served_model_name=BASE, api_key="sekret", rescan_interval_s=0))
    with TestClient(app) as client:
        _error(client.get("/v1/models"), 401, code="invalid_api_key")
        _error(client.post("/v1/completions", json={"model": BASE, "prompt": "w5"},
                           headers={"Authorization": "Bearer wrong"}), 401)
        ok = client.post("/v1/completions", json={"model": BASE, "prompt": "w5", "max_tokens": 2},
                         headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
        _error(client.post("/tokenize", json={"model": BASE, "prompt": "w5"}), 401)
        _error(client.post("/detokenize", json={"model": BASE, "tokens": [5]}), 401)
        assert client.post("/tokenize", json={"model": BASE, "prompt": "w5"},
                           headers={"Authorization": "Bearer sekret"}).json()["count"] >= 1
    engine.close()


# -- the adapter store while serving -------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_adapters_appear_and_disappear_without_restart(model_dir, adapter_dirs, tmp_path, mode):
    engine = _engine(model_dir, mode)
    store = _store(tmp_path, adapter_dirs, ["all4"])
    app = create_app(engine, config=ServerConfig(served_model_name=BASE, rescan_interval_s=0),
                     store=AdapterStore(store, engine))
    ids = engine.tokenizer(PROMPT)["input_ids"]
    with TestClient(app) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [BASE, "all4"]
        _error(client.post("/v1/completions", json={"model": "mlp8", "prompt": PROMPT}), 404)
        shutil.copytree(adapter_dirs["mlp8"], store / "mlp8")  # copied in while serving: found on request
        body = _complete(client, model="mlp8", max_tokens=6)
        assert body["choices"][0]["text"] == _greedy(engine, ids, "mlp8", 6).text
        shutil.copytree(adapter_dirs["attn2"], store / "attn2")  # and listed by /v1/models
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [BASE, "all4", "attn2", "mlp8"]
        shutil.rmtree(store / "all4")
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [BASE, "attn2", "mlp8"]
        _error(client.post("/v1/completions", json={"model": "all4", "prompt": PROMPT}), 404)
        assert "all4" not in {a.name for a in engine.adapters()}
    engine.close()


def test_periodic_rescan_picks_up_new_adapters(model_dir, adapter_dirs, tmp_path):
    engine = _engine(model_dir)
    store = _store(tmp_path, adapter_dirs, [])
    app = create_app(engine, config=ServerConfig(served_model_name=BASE, rescan_interval_s=0.1),
                     store=AdapterStore(store, engine))
    with TestClient(app):
        shutil.copytree(adapter_dirs["attn2"], store / "attn2")
        deadline = time.monotonic() + 10
        while "attn2" not in {a.name for a in engine.adapters()} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert {a.name for a in engine.adapters()} == {"attn2"}  # no request asked for it
    engine.close()


def test_load_and_unload_lora_adapter_endpoints(model_dir, adapter_dirs, tmp_path):
    engine = _engine(model_dir)
    store = _store(tmp_path, adapter_dirs, ["all4"])
    outside = tmp_path / "outside"
    shutil.copytree(adapter_dirs["mlp8"], outside)
    (store / "escape").symlink_to(outside, target_is_directory=True)
    app = create_app(engine, config=ServerConfig(served_model_name=BASE, rescan_interval_s=0, api_key="k"),
                     store=AdapterStore(store, engine))
    auth = {"Authorization": "Bearer k"}
    with TestClient(app) as client:
        _error(client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "all4"}), 401)
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "copy", "lora_path": "all4"}, headers=auth)
        assert r.status_code == 200, r.text
        a = client.post("/v1/completions", json={"model": "copy", "prompt": PROMPT, "max_tokens": 4,
                                                 "temperature": 0}, headers=auth).json()
        b = client.post("/v1/completions", json={"model": "all4", "prompt": PROMPT, "max_tokens": 4,
                                                 "temperature": 0}, headers=auth).json()
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
        for path in (str(outside), "escape", "../outside", "all4/../../outside"):
            _error(client.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": path},
                               headers=auth), 400, param="lora_path")
        _error(client.post("/v1/completions", json={"model": "escape", "prompt": "w5"}, headers=auth), 404)
        _error(client.post("/v1/load_lora_adapter", json={"lora_name": "copy", "lora_path": "all4"}, headers=auth),
               400)
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "copy"}, headers=auth).status_code == 200
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "all4"}, headers=auth).status_code == 200
        _error(client.post("/v1/unload_lora_adapter", json={"lora_name": "copy"}, headers=auth), 404)
        # unloaded stays unloaded though its directory is still in the store
        assert [m["id"] for m in client.get("/v1/models", headers=auth).json()["data"]] == [BASE]
        _error(client.post("/v1/completions", json={"model": "all4", "prompt": "w5"}, headers=auth), 404)
    engine.close()


# -- metrics -----------------------------------------------------------------------------------


def _samples(client) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_count_requests_and_tokens_per_app(served, model_dir):
    key = ("lorafusion_http_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))
    before = _samples(served.client)
    body = _complete(served.client, model="all4", max_tokens=5)
    _complete(served.client, model="attn2", max_tokens=5, stream=False)
    served.client.post("/v1/completions", json={"model": "nope", "prompt": "w5"})
    streamed = served.client.post("/v1/completions", json={"model": "all4", "prompt": PROMPT, "max_tokens": 3,
                                                           "stream": True})
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    after = _samples(served.client)
    assert after[key] - before.get(key, 0) == 3
    notfound = ("lorafusion_http_requests_total", (("endpoint", "/v1/completions"), ("status", "404")))
    assert after[notfound] - before.get(notfound, 0) == 1
    generated = ("lorafusion_generated_tokens_total", ())
    assert after[generated] - before[generated] >= body["usage"]["completion_tokens"]
    for name in ("lorafusion_queue_length", "lorafusion_adapters_resident", "lorafusion_adapter_page_ins_total",
                 "lorafusion_requests_running", "lorafusion_prefill_chunks_total"):
        assert (name, ()) in after
    assert after[("lorafusion_adapters_resident", ())] >= 1
    # time to first token at the server: the streamed request only (non-streamed answers have no
    # first token to send); the engine's busy time grew
    ttft = ("lorafusion_http_time_to_first_token_seconds_count", (("endpoint", "/v1/completions"),))
    assert after[ttft] - before.get(ttft, 0) == 1
    busy = ("lorafusion_engine_busy_seconds_total", ())
    assert after[busy] > before[busy] and after[("lorafusion_engine_steps_total", ())] > 0
    # a second app in the same process has its own registry
    other = create_app(served.engine, config=ServerConfig(served_model_name=BASE))
    with TestClient(other) as client:
        assert key not in _samples(client)


# -- a real socket: disconnects and shutdown ---------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Uvicorn:
    """uvicorn serving ``app`` in a thread, for behaviour TestClient cannot show."""

    def __init__(self, app, **config):
        import uvicorn

        self.port = _free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    log_config=None, **config))  # keep this process's handlers
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()


def _wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture(scope="module", params=MODES)
def long_engine(request, tmp_path_factory):
    """A 4096-token context, shared by the tests below (each waits until its requests are gone):
    a 4000-token request surely still runs while a test acts."""
    from lightning_lorafusion.model.random_model import write_random_llama

    long_dir = write_random_llama(tmp_path_factory.mktemp("long"), vocab_size=64, hidden_size=32,
                                  intermediate_size=64, num_layers=2, max_positions=4096)
    engine = _engine(long_dir, request.param, num_pages=600)
    yield engine
    engine.close()


def _idle(engine) -> bool:
    stats = engine.stats()
    return stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_pages_used"] == 0


def test_client_disconnect_mid_stream_frees_pages(long_engine):
    # A 4000-token request: on a loaded machine a short one could finish before the server
    # notices the disconnect, and the test would prove nothing.
    engine = long_engine
    generated = engine.stats()["generated_tokens_total"]
    server = _Uvicorn(create_app(engine, config=ServerConfig(served_model_name=BASE)))
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            with client.stream("POST", "/v1/completions", json={
                    "model": BASE, "prompt": "w5 w6", "max_tokens": 4000, "ignore_eos": True, "stream": True}) as r:
                lines = r.iter_lines()  # held: dropping the iterator would close the connection already
                first = next(lines)
                assert r.status_code == 200 and '"finish_reason":null' in first.replace(" ", ""), first
                assert engine.stats()["kv_pages_used"] > 0
        # gone after the first token: the engine aborts the request and frees its pages
        _wait_for(lambda: _idle(engine))
        assert engine.stats()["generated_tokens_total"] - generated < 4000
    finally:
        server.stop()


def test_overload_is_503_with_retry_after(long_engine):
    app = create_app(long_engine, config=ServerConfig(served_model_name=BASE, max_pending_requests=2,
                                                      retry_after_s=2))
    server = _Uvicorn(app)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            _error(client.post("/v1/completions", json={"model": BASE, "prompt": "w5", "max_tokens": 1, "n": 3}),
                   503, code="server_overloaded")
            with client.stream("POST", "/v1/completions", json={
                    "model": BASE, "prompt": "w5", "max_tokens": 4000, "ignore_eos": True, "stream": True,
                    "n": 2}) as r:
                lines = r.iter_lines()  # held: dropping the iterator would close the connection
                next(lines)  # the first event: both choices are running
                busy = client.post("/v1/completions", json={"model": BASE, "prompt": "w5", "max_tokens": 1})
                _error(busy, 503, code="server_overloaded")
                assert busy.headers["retry-after"] == "2"
            _wait_for(lambda: not app.state.server.in_flight)
            after = client.post("/v1/completions", json={"model": BASE, "prompt": "w5", "max_tokens": 1})
            assert after.status_code == 200
    finally:
        server.stop()
    _wait_for(lambda: _idle(long_engine))


def test_graceful_shutdown_lets_running_requests_finish(long_engine):
    engine = long_engine
    server = _Uvicorn(create_app(engine, config=ServerConfig(served_model_name=BASE)), timeout_graceful_shutdown=20)
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, f"{server.url}/v1/completions", timeout=60, json={
            "model": BASE, "prompt": "w5 w6", "max_tokens": 100, "ignore_eos": True})
        _wait_for(lambda: engine.stats()["running"] > 0)
        server.stop()
        r = answer.result()
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 100
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_shutdown_cancels_requests_that_outlast_the_grace_period(long_engine):
    engine = long_engine
    generated = engine.stats()["generated_tokens_total"]
    server = _Uvicorn(create_app(engine, config=ServerConfig(served_model_name=BASE)), timeout_graceful_shutdown=0.5)
    with ThreadPoolExecutor(2) as pool:
        answers = [pool.submit(httpx.post, f"{server.url}/v1/completions", timeout=60, json={
            "model": BASE, "prompt": "w5 w6", "max_tokens": 4000, "ignore_eos": True, "stream": stream})
            for stream in (False, True)]
        _wait_for(lambda: engine.stats()["running"] == 2)
        server.stop()
        for a in answers:
            try:
                r = a.result()
                assert r.status_code != 200 or "[DONE]" not in r.text  # cut off, not completed
            except httpx.HTTPError:
                pass  # the connection was closed under it
    _wait_for(lambda: _idle(engine))
    assert engine.stats()["generated_tokens_total"] - generated < 2 * 4000


# -- the command line --------------------------------------------------------------------------


def test_warm_up_defaults_to_cuda_only():
    from lightning_lorafusion.serving.serve_cli import should_warm_up

    assert should_warm_up(None, "cuda:1") and not should_warm_up(None, "cpu")
    assert should_warm_up(True, "cpu") and not should_warm_up(False, "cuda")
    assert should_warm_up(None, None) == torch.cuda.is_available()


def test_serve_print_config_merges_yaml_and_overrides(capsys):
    import yaml

    from lightning_lorafusion.serving.serve_cli import run

    with pytest.raises(SystemExit) as e:
        run(["--config", str(REPO / "configs" / "serve_tiny.yaml"), "--base_model", "some/dir", "--port", "9123",
             "--engine.num_pages", "64", "--server.max_n", "4", "--print_config"])
    assert e.value.code == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["base_model"] == "some/dir" and cfg["port"] == 9123 and cfg["device"] == "cpu"
    assert cfg["engine"]["num_pages"] == 64 and cfg["engine"]["page_size"] == 8  # override + YAML
    assert cfg["server"]["max_n"] == 4 and cfg["server"]["rescan_interval_s"] == 1


def _console_dispatches_serve() -> bool:
    import inspect

    from lightning_lorafusion import cli

    return "serve_cli" in inspect.getsource(cli)


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux /proc)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


@pytest.mark.parametrize("engine_process", ["false", "true"])
def test_serve_subprocess_with_the_openai_client(model_dir, adapter_dirs, tmp_path, engine_process, process_exited):
    openai = pytest.importorskip("openai")
    base = tmp_path / "base"
    shutil.copytree(model_dir, base)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(base)
    store = _store(tmp_path, adapter_dirs, ["all4", "attn2"])
    port = _free_port()
    script = Path(sys.executable).with_name("lightning-lorafusion")
    launcher = ([str(script)] if script.exists() and _console_dispatches_serve()
                else [sys.executable, "-m", "lightning_lorafusion.serving.serve_cli"])
    cmd = launcher + (["serve"] if launcher[0] == str(script) else []) + [
        "--config", str(REPO / "configs" / "serve_tiny.yaml"), "--base_model", str(base), "--adapter_dir", str(store),
        "--port", str(port), "--engine.num_pages", str(ENGINE_CONFIG["num_pages"]),
        "--engine_process", engine_process, "--log_level", "info"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "LORAFUSION_API_KEY": "k"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        children = _children(proc.pid)  # the engine process, if any (spawn also starts a resource tracker)
        if engine_process == "true":
            assert children
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        assert [m.id for m in client.models.list().data] == [base.name, "all4", "attn2"]

        # the same requests answered directly by an engine over the same files
        engine = _engine(base)
        for name in ("all4", "attn2", "mlp8"):
            engine.add_adapter(name, adapter_dirs[name])
        ids = engine.tokenizer(PROMPT)["input_ids"]

        def ask(model):
            out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
            return model, out.choices[0].text, out.usage.completion_tokens

        with ThreadPoolExecutor(4) as pool:  # several adapters at once, from threads
            answers = list(pool.map(ask, ["all4", "attn2", base.name, "all4"]))
        for model, text, used in answers:
            expected = _greedy(engine, ids, None if model == base.name else model, 6)
            assert text == expected.text and used == len(expected.token_ids)

        chat = client.chat.completions.create(model="attn2", messages=[{"role": "user", "content": "w11 w12"}],
                                              max_tokens=4, temperature=0)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="attn2", messages=[{"role": "user", "content": "w11 w12"}], max_tokens=4, temperature=0,
            stream=True) if c.choices)
        assert streamed == chat.choices[0].message.content and chat.usage.completion_tokens >= 1

        shutil.copytree(adapter_dirs["mlp8"], store / "mlp8")  # copied in while the server runs
        _, text, _ = ask("mlp8")
        assert text == _greedy(engine, ids, "mlp8", 6).text
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="missing", prompt=PROMPT, max_tokens=1)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        engine.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it (exit status -SIGTERM)
    out = proc.stdout.read()
    assert proc.returncode in (0, -signal.SIGTERM), out
    # before serving: the base and one of the store's two adapters (ranks 2 and 4 loaded) alone,
    # together, two each
    assert "warm-up: 8 requests (base and adapter ranks [2, 4])" in out, out
    _wait_for(lambda: all(process_exited(c) for c in children))  # the engine process stopped with the server
