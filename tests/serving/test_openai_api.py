"""The OpenAI translation layer without a server or an engine loop: request validation, prompts,
sampling parameters, response and stream-chunk shapes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_lorafusion.serving import SamplingParams, TokenEvent
from lightning_lorafusion.serving import openai_api as oa

# role words are vocabulary words of the random model's word-level tokenizer
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}w1{% else %}w2{% endif %} "
                 "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w3{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from lightning_lorafusion.model.random_model import write_random_llama

    path = write_random_llama(tmp_path_factory.mktemp("tiny"), hidden_size=16, intermediate_size=32, num_layers=1)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _raises_400(cls, body, param):
    with pytest.raises(oa.APIError) as e:
        oa.parse_request(cls, body)
    assert e.value.status == 400
    assert e.value.param == param, e.value.message
    return e.value


# -- parsing -----------------------------------------------------------------------------------


def test_completion_prompt_forms_are_normalised_to_a_list():
    one = oa.parse_request(oa.CompletionRequest, {"model": "m", "prompt": "w5 w6"})
    assert one.prompt == ["w5 w6"] and one.n == 1 and one.max_tokens is None
    ids = oa.parse_request(oa.CompletionRequest, {"model": "m", "prompt": [5, 6, 7]})
    assert ids.prompt == [[5, 6, 7]]
    many = oa.parse_request(oa.CompletionRequest, {"model": "m", "prompt": [[5], [6, 7]]})
    assert many.prompt == [[5], [6, 7]]
    strs = oa.parse_request(oa.CompletionRequest, {"model": "m", "prompt": ["a", "b"], "stop": "w9"})
    assert strs.prompt == ["a", "b"] and strs.stop_sequences() == ("w9",)


@pytest.mark.parametrize("body,param", [
    ({"model": "m", "prompt": [5, "x"]}, "prompt"),
    ({"model": "m", "prompt": []}, "prompt"),
    ({"model": "m", "prompt": [[5], []]}, "prompt"),
    ({"model": "m", "prompt": [True, 5]}, "prompt"),
    ({"prompt": "x"}, "model"),
    ({"model": "m", "prompt": "x", "n": 0}, "n"),
    ({"model": "m", "prompt": "x", "temperature": 2.5}, "temperature"),
    ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "m", "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"model": "m", "prompt": "x", "logprobs": 21}, "logprobs"),
    ({"model": "m", "prompt": "x", "stop": ["a", ""]}, "stop"),
    ({"model": "m", "prompt": "x", "stop": [f"s{i}" for i in range(17)]}, "stop"),
    ({"model": "m", "prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"model": "m", "prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ({"model": "m", "prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"model": "m", "prompt": "x", "min_p": 1.5}, "min_p"),
    ({"model": "m", "prompt": "x", "logit_bias": {"five": 1.0}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
])
def test_completion_field_errors_are_400_naming_the_field(body, param):
    _raises_400(oa.CompletionRequest, body, param)


@pytest.mark.parametrize("body,words", [
    ({"model": "m", "prompt": "x", "best_of": 3}, "best_of"),
    ({"model": "m", "prompt": "x", "suffix": "y"}, "suffix"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_unsupported_openai_features_are_refused_not_ignored(body, words):
    with pytest.raises(oa.APIError) as e:
        oa.parse_request(oa.CompletionRequest, body)
    assert e.value.status == 400 and words in e.value.message


def test_penalties_bias_and_min_p_reach_the_sampling_settings():
    req = oa.parse_request(oa.CompletionRequest, {
        "model": "m", "prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 1.2,
        "min_p": 0.1, "logit_bias": {"7": -100, " 3": 2.5}})
    kw = oa.sampling_kwargs(req, max_new_tokens=4, choice=0, logprobs=None)
    assert (kw["presence_penalty"], kw["frequency_penalty"], kw["repetition_penalty"], kw["min_p"]) == (
        0.5, -0.25, 1.2, 0.1)
    assert kw["logit_bias"] == {7: -100.0, 3: 2.5}
    plain = oa.sampling_kwargs(oa.parse_request(oa.CompletionRequest, {"model": "m", "prompt": "x"}),
                               max_new_tokens=4, choice=0, logprobs=None)
    assert (plain["presence_penalty"], plain["repetition_penalty"], plain["logit_bias"]) == (0.0, 1.0, {})


def test_unknown_fields_are_ignored_and_non_objects_refused():
    req = oa.parse_request(oa.CompletionRequest, {"model": "m", "prompt": "x", "user": "u", "whatever": 1})
    assert req.model == "m"
    with pytest.raises(oa.APIError) as e:
        oa.parse_request(oa.CompletionRequest, ["not", "an", "object"])
    assert e.value.status == 400


def test_chat_request_validation():
    ok = oa.parse_request(oa.ChatCompletionRequest, {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "w5"}, {"type": "text", "text": " w6"}]}],
        "max_tokens": 9, "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 2})
    assert ok.messages[0].text() == "w5 w6" and ok.requested_max_tokens() == 4
    assert oa.parse_request(oa.ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                       "max_tokens": 9}).requested_max_tokens() == 9
    _raises_400(oa.ChatCompletionRequest, {"model": "m", "messages": []}, "messages")
    for bad in ({"top_logprobs": 2}, {"tools": [{"type": "function"}]}, {"response_format": {"type": "json_object"}}):
        with pytest.raises(oa.APIError) as e:
            oa.parse_request(oa.ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                        **bad})
        assert e.value.status == 400
    with pytest.raises(oa.APIError) as e:
        oa.parse_request(oa.ChatCompletionRequest, {"model": "m", "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert "text content" in e.value.message


def test_error_body_has_openai_shape():
    err = oa.model_not_found("nope")
    assert err.status == 404
    body = err.body()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    assert oa.error_body(503, "busy")["error"]["type"] == "service_unavailable_error"


# -- prompts -----------------------------------------------------------------------------------


def test_completion_prompts_tokenize_strings_and_check_ids(tokenizer):
    req = oa.parse_request(oa.CompletionRequest, {"model": "m", "prompt": ["w5 w6", "w7"]})
    prompts = oa.completion_prompts(req, tokenizer, vocab_size=256)
    assert [p.token_ids for p in prompts] == [tuple(tokenizer(t)["input_ids"]) for t in ("w5 w6", "w7")]
    assert prompts[0].text == "w5 w6"
    ids = oa.parse_request(oa.CompletionRequest, {"model": "m", "prompt": [9, 10]})
    (p,) = oa.completion_prompts(ids, tokenizer, vocab_size=256)
    assert p.token_ids == (9, 10) and p.text == tokenizer.decode([9, 10])
    too_big = oa.parse_request(oa.CompletionRequest, {"model": "m", "prompt": [9, 256]})
    with pytest.raises(oa.APIError) as e:
        oa.completion_prompts(too_big, tokenizer, vocab_size=256)
    assert e.value.status == 400 and "256" in e.value.message


def test_chat_prompt_uses_the_template_with_generation_prompt(tokenizer):
    req = oa.parse_request(oa.ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "system", "content": "w10"}, {"role": "user", "content": "w11 w12"}]})
    p = oa.chat_prompt(req, tokenizer)
    assert p.token_ids == tuple(tokenizer("w2 w10 w1 w11 w12 w3")["input_ids"])
    assert p.token_ids[-1] == tokenizer.convert_tokens_to_ids("w3")


def test_chat_prompt_without_template_is_a_400(tokenizer):
    req = oa.parse_request(oa.ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}]})
    saved = tokenizer.chat_template
    tokenizer.chat_template = None
    try:
        with pytest.raises(oa.APIError) as e:
            oa.chat_prompt(req, tokenizer)
    finally:
        tokenizer.chat_template = saved
    assert e.value.status == 400 and "chat template" in e.value.message


# -- sampling ----------------------------------------------------------------------------------


def test_sampling_kwargs_build_engine_params_with_per_choice_seeds():
    req = oa.parse_request(oa.CompletionRequest, {"model": "m", "prompt": "x", "temperature": 0.7, "top_p": 0.9,
                                                  "seed": 11, "n": 3, "stop": ["w9", "w8"], "top_k": 5})
    params = [SamplingParams(**oa.sampling_kwargs(req, max_new_tokens=7, choice=j, logprobs=2)) for j in range(3)]
    assert [p.seed for p in params] == [11, 12, 13]
    p = params[0]
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.stop, p.logprobs, p.prompt_logprobs) == (
        7, 0.7, 0.9, 5, ("w9", "w8"), 2, None)
    unseeded = oa.parse_request(oa.CompletionRequest, {"model": "m", "prompt": "x", "n": 2})
    assert {oa.sampling_kwargs(unseeded, max_new_tokens=1, choice=j, logprobs=None)["seed"] for j in range(2)} == {None}


def test_resolve_max_tokens():
    kw = dict(prompt_len=10, max_model_len=64, limit=40)
    assert oa.resolve_max_tokens(5, default=None, **kw) == 5
    assert oa.resolve_max_tokens(None, default=None, **kw) == 40  # what fits, capped by the limit
    assert oa.resolve_max_tokens(None, default=8, **kw) == 8
    assert oa.resolve_max_tokens(0, default=8, **kw) == 0
    for requested, code in ((41, None), (60, None)):
        with pytest.raises(oa.APIError) as e:
            oa.resolve_max_tokens(requested, default=None, **{**kw, "limit": 100 if requested == 60 else 40})
        assert e.value.status == 400 and e.value.param == "max_tokens"
    with pytest.raises(oa.APIError) as e:
        oa.resolve_max_tokens(None, default=None, prompt_len=64, max_model_len=64, limit=40)
    assert e.value.code == "context_length_exceeded"


# -- responses ---------------------------------------------------------------------------------


def _event(tid, text, lp=None, top=None, finish=None):
    return TokenEvent(request_id="r", token_id=tid, text=text, logprob=lp, top_logprobs=top, finish_reason=finish)


def test_choice_output_folds_events():
    out = oa.ChoiceOutput()
    for e in (_event(20, " w16", -0.5, {20: -0.5, 21: -1.0}), _event(21, "", -1.5, {21: -1.0, 20: -1.2}),
              _event(22, " w17 w18", -0.1, {22: -0.1}, finish="length")):
        out.add(e)
    assert out.token_ids == [20, 21, 22] and out.text == " w16 w17 w18" and out.finish_reason == "length"
    assert out.logprobs == [-0.5, -1.5, -0.1] and out.top_logprobs[1] == {21: -1.0, 20: -1.2}
    aborted = oa.ChoiceOutput()
    aborted.add(_event(None, "", finish="abort"))
    assert aborted.token_ids == [] and aborted.finish_reason == "abort"


def test_completion_choice_with_echo_and_logprobs(tokenizer):
    prompt = oa.Prompt((10, 11, 12), "w6 w7 w8")
    out = oa.ChoiceOutput(token_ids=[20, 21], text=" w16 w17", finish_reason="stop", logprobs=[-0.5, -0.25],
                          top_logprobs=[{20: -0.5, 5: -2.0}, {21: -0.25}], prompt_logprobs=[None, -3.0, -2.5])
    choice = oa.completion_choice(3, out, tokenizer, prompt=prompt, logprobs=2)
    assert choice["index"] == 3 and choice["text"] == "w6 w7 w8 w16 w17" and choice["finish_reason"] == "stop"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["w6", "w7", "w8", "w16", "w17"]
    assert lp["token_logprobs"] == [None, -3.0, -2.5, -0.5, -0.25]
    assert lp["top_logprobs"][:3] == [None, None, None] and lp["top_logprobs"][3] == {"w16": -0.5, "w1": -2.0}
    assert lp["text_offset"] == [0, 2, 4, 6, 9]
    plain = oa.completion_choice(0, out, tokenizer, prompt=None, logprobs=None)
    assert plain["text"] == " w16 w17" and plain["logprobs"] is None
    only_chosen = oa.completion_choice(0, out, tokenizer, prompt=None, logprobs=0)["logprobs"]
    assert only_chosen["token_logprobs"] == [-0.5, -0.25] and only_chosen["top_logprobs"] is None


def test_completion_and_chat_responses_carry_usage(tokenizer):
    out = oa.ChoiceOutput(token_ids=[20], text=" w16", finish_reason="length", logprobs=[-0.5],
                          top_logprobs=[{20: -0.5, 30: -0.1, 5: -3.0}])
    resp = oa.completion_response(request_id="cmpl-1", model="a", created=1, prompt_tokens=4, completion_tokens=1,
                                  choices=[oa.completion_choice(0, out, tokenizer, prompt=None, logprobs=None)])
    assert resp["object"] == "text_completion" and resp["usage"] == {"prompt_tokens": 4, "completion_tokens": 1,
                                                                     "total_tokens": 5}
    chat = oa.chat_response(request_id="c", model="a", created=1, prompt_tokens=4, completion_tokens=1,
                            choices=[oa.chat_choice(0, out, tokenizer, logprobs=True)])
    choice = chat["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": " w16"} and chat["usage"]["total_tokens"] == 5
    (entry,) = choice["logprobs"]["content"]
    assert entry["token"] == "w16" and entry["logprob"] == -0.5 and entry["bytes"] == list(b"w16")
    assert [t["token"] for t in entry["top_logprobs"]] == ["w26", "w16", "w1"]  # most likely first


def test_stream_chunks_and_sse_framing(tokenizer):
    chunk = oa.completion_chunk(request_id="x", model="a", created=1, index=2, text=" w5", finish_reason=None,
                                with_usage_field=True)
    raw = oa.sse(chunk)
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
    assert json.loads(raw[6:]) == chunk and chunk["usage"] is None and chunk["choices"][0]["index"] == 2
    delta = oa.chat_chunk(request_id="x", model="a", created=1, index=0, delta={"content": "w5"}, finish_reason="stop")
    assert delta["object"] == "chat.completion.chunk" and "usage" not in delta
    final = oa.usage_chunk(request_id="x", model="a", created=1, object_name="chat.completion.chunk",
                           prompt_tokens=3, completion_tokens=2)
    assert final["choices"] == [] and final["usage"]["total_tokens"] == 5
    assert oa.SSE_DONE == b"data: [DONE]\n\n"
    lp = oa.stream_event_logprobs(tokenizer, _event(20, " w16", -0.5, {20: -0.5}), chat=False, top=1, text_offset=4)
    assert lp == {"tokens": ["w16"], "token_logprobs": [-0.5], "top_logprobs": [{"w16": -0.5}], "text_offset": [4]}
    assert oa.stream_event_logprobs(tokenizer, _event(None, "", finish="stop"), chat=True, top=None) is None


def test_model_cards():
    base = oa.model_card("base", created=5)
    lora = oa.model_card("a", created=5, root="/s/a", parent="base", rank=4, alpha=8.0, target_modules=("q_proj",))
    assert "lora" not in base and lora["lora"] == {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj"]}
    assert oa.models_list([base, lora])["data"][1]["parent"] == "base"
    assert "adapter_version" not in lora
    assert oa.model_card("a", created=5, parent="base", rank=4, alpha=8.0, adapter_version=3)["adapter_version"] == 3


@settings(max_examples=300, deadline=None)
@given(text=st.text(), model=st.text(min_size=1), index=st.integers(0, 40), created=st.integers(0, 2**40),
       finish=st.sampled_from([None, "stop", "length", "abort"]), chat=st.booleans(), with_usage=st.booleans(),
       version=st.one_of(st.none(), st.integers(1, 2**40)))
def test_chunk_writer_is_byte_for_byte_the_dict_path(text, model, index, created, finish, chat, with_usage, version):
    """The streamed chunks' pre-encoded template equals ``sse(completion_chunk / chat_chunk)``:
    any text (quotes, control characters, non-ASCII, empty), model name, finish reason and
    adapter version."""
    write = oa.ChunkWriter(request_id="cmpl-1\"x", model=model, created=created, chat=chat,
                           with_usage_field=with_usage)
    if chat:
        expected = oa.sse(oa.chat_chunk(request_id="cmpl-1\"x", model=model, created=created, index=index,
                                        delta={"content": text} if text else {}, finish_reason=finish,
                                        with_usage_field=with_usage, adapter_version=version))
        got = write(index, text or None, finish, version)
    else:
        expected = oa.sse(oa.completion_chunk(request_id="cmpl-1\"x", model=model, created=created, index=index,
                                              text=text, finish_reason=finish, with_usage_field=with_usage,
                                              adapter_version=version))
        got = write(index, text, finish, version)
    assert got == expected
    assert got == write(index, text or None if chat else text, finish, version)  # the cached per-index head
