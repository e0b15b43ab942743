"""In-place adapter updates: ``Engine.update_adapter`` swaps a name's weights atomically; every
request runs, token for token, on the version it was submitted under (HF + PEFT references of
each version, greedy), old versions' pages are freed after their last request, prefix-cache
pages never cross versions, and versions are reported everywhere."""

from __future__ import annotations

import asyncio

import pytest
import torch

from lightning_lorafusion.serving import Engine, EngineConfig, GenerationRequest, SamplingParams
from lightning_lorafusion.serving.adapters import UnknownAdapterError
from lightning_lorafusion.specs import ConfigError

TARGETS = ["q_proj", "v_proj", "down_proj"]
# version -> (rank, alpha, seed): the last one changes the rank too
VERSIONS = {"v1": (4, 8.0, 11), "v2": (4, 8.0, 12), "v3": (2, 5.0, 13)}
PROMPT = (5, 9, 17, 30, 2, 41, 7, 3, 22, 8, 14)  # 11 tokens: two full pages of 4 cached by prefix caching
NEW = 8


@pytest.fixture(scope="module")
def version_dirs(model_dir, tmp_path_factory, write_random_peft_adapter):
    root = tmp_path_factory.mktemp("versions")
    return {v: str(write_random_peft_adapter(model_dir, root / v, rank=r, alpha=a, targets=TARGETS, seed=s))
            for v, (r, a, s) in VERSIONS.items()}


@pytest.fixture(scope="module")
def references(model_dir, version_dirs, hf_reference_of):
    """Greedy HF + PEFT continuations of PROMPT (and of PROMPT's first 9 tokens) per version."""
    ref = hf_reference_of(model_dir, version_dirs)
    out = {v: ref.generate(list(PROMPT), v, NEW) for v in version_dirs}
    out.update({(v, "short"): ref.generate(list(PROMPT[:9]), v, NEW) for v in version_dirs})
    assert len({tuple(out[v]) for v in version_dirs}) == 3, "the versions must generate differently"
    return out


def _engine(model_dir, version_dirs, **config) -> Engine:
    cfg = dict(num_pages=96, page_size=4, max_num_seqs=8, max_num_batched_tokens=256, backend="torch")
    engine = Engine.from_pretrained(str(model_dir), None, EngineConfig(**{**cfg, **config}), device="cpu",
                                    dtype=torch.float32)
    engine.add_adapter("a", version_dirs["v1"])
    return engine


def _request(rid: str, prompt=PROMPT) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=prompt, adapter="a", request_id=rid,
                             sampling=SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True))


def test_updates_between_steps_each_request_runs_on_its_submitted_version(model_dir, version_dirs, references):
    engine = _engine(model_dir, version_dirs)
    events: dict[str, list] = {}

    def submit(rid, prompt=PROMPT):
        events[rid] = []
        engine.submit(_request(rid, prompt), events[rid].append)

    submit("r1")
    engine.step()
    engine.step()  # r1 prefilled and decoding
    submit("r1-again")  # same prompt, same version: reuses r1's prefix pages
    engine.step()
    hits_v1 = engine.stats()["prefix_cache_hits_total"]
    assert hits_v1 == 1
    info = engine.update_adapter("a", version_dirs["v2"])
    assert info.version == 2 and [a.version for a in engine.adapters()] == [2]
    submit("r2")  # after the update: v2, and none of v1's cached pages
    submit("r2-short", PROMPT[:9])
    engine.step()
    assert engine.stats()["prefix_cache_hits_total"] == hits_v1
    old = engine._states["r1"].adapter
    assert old.version == 1 and engine.pool.resident(old) is not None  # r1 still decodes on v1
    engine.update_adapter("a", version_dirs["v3"])  # r2 is running on v2 now
    submit("r3")
    while engine.scheduler.has_work() or engine._incoming:
        engine.step()
    engine.step()  # retired versions are freed at a step's start
    assert engine.pool.resident(old) is None and not engine._retired
    assert [r.adapter.version for r in engine.pool.resident_adapters()] in ([3], [])  # only the newest stays
    expected = {"r1": ("v1", 1), "r1-again": ("v1", 1), "r2": ("v2", 2), "r2-short": (("v2", "short"), 2),
                "r3": ("v3", 3)}
    for rid, (ref, version) in expected.items():
        tokens = [e.token_id for e in events[rid] if e.token_id is not None]
        assert tokens == references[ref], rid
        assert {e.adapter_version for e in events[rid]} == {version}, rid
    assert [a.version for a in engine.adapters()] == [3]


def test_a_queued_request_keeps_the_version_it_was_submitted_under(model_dir, version_dirs, references):
    engine = _engine(model_dir, version_dirs, max_num_seqs=1, max_num_batched_tokens=64)
    first = engine.submit(_request("first"))
    engine.step()
    queued = engine.submit(_request("queued"))  # waits: one running slot
    engine.update_adapter("a", version_dirs["v2"])
    after = engine.submit(_request("after"))
    results = {}
    while engine.scheduler.has_work() or engine._incoming:
        for e in engine.step():
            if e.finish_reason is not None:
                results[e.request_id] = e.adapter_version
    assert results == {first: 1, queued: 1, after: 2}


def test_streams_interleaved_with_updates_match_their_versions(model_dir, version_dirs, references):
    """The background loop steps while updates land between submissions; each stream's tokens
    equal the reference of the version current when it was submitted, which its events name."""
    engine = _engine(model_dir, version_dirs)

    async def consume(rid: str) -> tuple[list[int], set]:
        tokens, versions = [], set()
        async for event in engine.stream(_request(rid)):
            versions.add(event.adapter_version)
            if event.token_id is not None:
                tokens.append(event.token_id)
        return tokens, versions

    async def main():
        tasks, current = {}, "v1"
        for i, version in enumerate(["v1", "v1", "v2", "v2", "v3", "v1"]):
            if version != current:
                engine.update_adapter("a", version_dirs[version])
                current = version
            rid = f"s{i}"
            tasks[rid] = (version, asyncio.create_task(consume(rid)))
            await asyncio.sleep(0.01 * (i % 3))  # some streams are mid-decode at the next update
        return {rid: (v, await t) for rid, (v, t) in tasks.items()}

    try:
        done = asyncio.run(main())
    finally:
        engine.close()
    seen = {}
    for rid, (version, (tokens, versions)) in done.items():
        seen[rid] = versions
        assert tokens == references[version], rid
    assert [seen[f"s{i}"] for i in range(6)] == [{1}, {1}, {2}, {2}, {3}, {4}]
    assert done["s5"][1][0] == references["v1"]


def test_update_from_factors_versions_and_refusals(model_dir, version_dirs, references):
    from lightning_lorafusion.serving.adapters import load_peft_adapter

    engine = _engine(model_dir, version_dirs)
    v2 = load_peft_adapter("a", version_dirs["v2"], engine.model_config, dtype=torch.float32)
    factors = {}
    for (layer, module), slot in v2.slots.items():
        a = v2.flat[slot.a:slot.a + v2.rank * slot.in_features].view(v2.rank, slot.in_features)
        bt = v2.flat[slot.b:slot.b + v2.rank * slot.out_features].view(v2.rank, slot.out_features)
        factors[(layer, module)] = (a.clone(), bt.t().clone())
    assert engine.update_adapter("a", factors).version == 2  # alpha: the current version's (8.0, as v2's)
    out = engine.generate([_request("f")])[0]
    assert list(out.token_ids) == references["v2"] and out.adapter_version == 2
    with pytest.raises(UnknownAdapterError, match="'b'"):
        engine.update_adapter("b", version_dirs["v1"])
    assert engine.update_adapter("b", version_dirs["v1"], add=True).version == 1
    bad = {k: (a, b * float("nan")) for k, (a, b) in factors.items()}
    with pytest.raises(ConfigError, match="NaN"):
        engine.update_adapter("a", bad)
    with pytest.raises(ConfigError, match="weights must be"):
        engine.update_adapter("a", 3)
    with pytest.raises(ConfigError, match="named 'other'"):
        engine.update_adapter("a", load_peft_adapter("other", version_dirs["v1"], engine.model_config,
                                                     dtype=torch.float32))
    with pytest.raises(ConfigError, match="still run on"):  # the version being served, as its own update
        engine.update_adapter("a", engine._adapters["a"])
    assert {a.name: a.version for a in engine.adapters()} == {"a": 2, "b": 1}  # refused updates change nothing
    engine.remove_adapter("a")
    engine.add_adapter("a", version_dirs["v3"])  # a name re-added never reuses an old version number
    assert {a.name: a.version for a in engine.adapters()} == {"a": 3, "b": 1}
    out = engine.generate([_request("g")])[0]
    assert list(out.token_ids) == references["v3"] and out.adapter_version == 3


def test_versions_stay_unique_across_restarts_with_a_versions_file(make_engine, version_dirs, tmp_path):
    """With ``adapter_versions_file``, a second engine (a restarted server) numbers each name on
    from the first's latest version instead of from 1; the file holds the latest versions. A
    file that is not a name -> version object is refused at start, naming the field."""
    import json

    path = str(tmp_path / "versions.json")
    first = make_engine(with_adapters=False, num_pages=64, page_size=4, adapter_versions_file=path)
    assert first.add_adapter("a", version_dirs["v1"]).version == 1
    assert first.update_adapter("a", version_dirs["v2"]).version == 2
    assert first.add_adapter("b", version_dirs["v1"]).version == 1
    first.close()
    assert json.loads((tmp_path / "versions.json").read_text()) == {"a": 2, "b": 1}
    second = make_engine(with_adapters=False, num_pages=64, page_size=4, adapter_versions_file=path)
    assert second.add_adapter("a", version_dirs["v3"]).version == 3
    assert second.update_adapter("a", version_dirs["v1"]).version == 4
    assert [a.version for a in second.adapters()] == [4]
    plain = make_engine(with_adapters=False, num_pages=64, page_size=4)
    assert plain.add_adapter("a", version_dirs["v1"]).version == 1  # without the file: from 1
    (tmp_path / "bad.json").write_text('{"a": "two"}')
    with pytest.raises(ConfigError, match="adapter_versions_file"):
        make_engine(with_adapters=False, num_pages=64, page_size=4, adapter_versions_file=str(tmp_path / "bad.json"))
