"""The adapter store against a real engine: scans add, reload and remove adapters; names and
paths (symlinks included) never reach outside the store; broken adapters do not stop others."""

from __future__ import annotations

import json
import pickle
import shutil

import pytest
import torch

from lightning_lorafusion.serving import Engine, EngineConfig, GenerationRequest, SamplingParams
from lightning_lorafusion.serving.adapter_store import AdapterPathError, AdapterStore, valid_adapter_name
from lightning_lorafusion.specs import ConfigError


@pytest.fixture
def engine(model_dir):
    engine = Engine.from_pretrained(str(model_dir), None, EngineConfig(num_pages=160, page_size=8, backend="torch"),
                                    device="cpu", dtype=torch.float32)
    yield engine
    engine.close()


@pytest.fixture
def store_dir(tmp_path, adapter_dirs):
    root = tmp_path / "store"
    root.mkdir()
    shutil.copytree(adapter_dirs["all4"], root / "all4")
    shutil.copytree(adapter_dirs["attn2"], root / "attn2")
    return root


def _names(engine) -> set[str]:
    return {a.name for a in engine.adapters()}


def test_scan_adds_adapter_directories_and_skips_everything_else(engine, store_dir, adapter_dirs, tmp_path):
    shutil.copytree(adapter_dirs["mlp8"], store_dir / ".mlp8.tmp-123")  # a fit export being written
    (store_dir / "notes.txt").write_text("not an adapter")
    (store_dir / "empty").mkdir()
    (store_dir / "config-only").mkdir()
    shutil.copy(store_dir / "all4" / "adapter_config.json", store_dir / "config-only")
    shutil.copytree(adapter_dirs["mlp8"], store_dir / "bad name")
    outside = tmp_path / "outside"
    shutil.copytree(adapter_dirs["mlp8"], outside)
    (store_dir / "escape").symlink_to(outside, target_is_directory=True)
    (store_dir / "alias").symlink_to(store_dir / "attn2", target_is_directory=True)  # inside: fine

    report = AdapterStore(store_dir, engine).scan()
    assert set(report.added) == {"all4", "attn2", "alias"} and not report.removed and not report.failed
    assert _names(engine) == {"all4", "attn2", "alias"}
    info = {a.name: a for a in engine.adapters()}
    assert (info["all4"].rank, info["attn2"].rank, info["alias"].rank) == (4, 2, 2)
    assert AdapterStore(store_dir, engine).scan() == type(report)()  # a second store sees them as foreign


def test_paths_outside_the_store_are_refused(engine, store_dir, adapter_dirs, tmp_path):
    store = AdapterStore(store_dir, engine)
    outside = tmp_path / "outside"
    shutil.copytree(adapter_dirs["mlp8"], outside)
    leaky = store_dir / "leaky"  # config inside, weights a symlink to a file outside
    leaky.mkdir()
    shutil.copy(outside / "adapter_config.json", leaky)
    (leaky / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    for path in (str(outside), "../outside", "all4/../../outside", "leaky", "missing", ".", ""):
        with pytest.raises(AdapterPathError):
            store.resolve(path)
    assert store.resolve("all4") == (store_dir / "all4").resolve()
    assert store.resolve(str(store_dir / "attn2")) == (store_dir / "attn2").resolve()
    for name in ("../outside", "/abs", "a/b", "..", ".hidden", "", "x" * 200, "leaky"):
        assert not store.lookup(name)
    assert store.scan().added == ("all4", "attn2")
    for bad in ("a/b", "..", "-x"):
        assert not valid_adapter_name(bad)
    with pytest.raises(ConfigError):
        AdapterStore(tmp_path / "nothing-here", engine)


def test_lookup_loads_on_demand(engine, store_dir, adapter_dirs):
    store = AdapterStore(store_dir, engine)
    assert not store.lookup("mlp8")
    shutil.copytree(adapter_dirs["mlp8"], store_dir / "mlp8")
    assert store.lookup("mlp8") and _names(engine) == {"mlp8"}
    assert store.lookup("mlp8")  # already loaded
    assert set(store.scan().added) == {"all4", "attn2"}


def test_changed_files_reload_and_removed_directories_are_unlisted(engine, store_dir, adapter_dirs):
    store = AdapterStore(store_dir, engine)
    store.scan()
    shutil.rmtree(store_dir / "all4")
    shutil.copytree(adapter_dirs["mlp8"], store_dir / "all4")  # a new export under the same name
    shutil.rmtree(store_dir / "attn2")
    report = store.scan()
    assert report.reloaded == ("all4",) and report.removed == ("attn2",) and not report.added
    assert {a.name: a.rank for a in engine.adapters()} == {"all4": 8}
    assert store.scan() == type(report)()  # nothing changed since


def test_broken_adapters_fail_alone_and_are_retried_when_they_change(engine, store_dir, adapter_dirs):
    broken = store_dir / "broken"
    shutil.copytree(adapter_dirs["all4"], broken)
    cfg = json.loads((broken / "adapter_config.json").read_text())
    (broken / "adapter_config.json").write_text(json.dumps({**cfg, "r": 3}))  # does not match its weights
    store = AdapterStore(store_dir, engine)
    report = store.scan()
    assert set(report.added) == {"all4", "attn2"} and set(report.failed) == {"broken"}
    assert "broken" not in _names(engine) and not store.lookup("broken")
    assert store.scan().failed == {}  # the same files are not retried on every scan
    (broken / "adapter_config.json").write_text(json.dumps(cfg))  # fixed
    assert store.scan().added == ("broken",)


def test_fixed_adapters_are_left_alone_and_unload_sticks_until_load(engine, store_dir, adapter_dirs):
    engine.add_adapter("attn2", adapter_dirs["mlp8"])  # the serve config's own adapter of that name
    store = AdapterStore(store_dir, engine)
    assert store.scan().added == ("all4",)
    shutil.rmtree(store_dir / "attn2")
    assert store.scan().removed == () and {a.name: a.rank for a in engine.adapters()}["attn2"] == 8

    store.unload("all4")
    assert "all4" not in _names(engine)
    assert store.scan().added == () and not store.lookup("all4")
    with pytest.raises(KeyError):
        store.unload("all4")
    assert store.load("all4").rank == 4 and "all4" in _names(engine)
    with pytest.raises(ValueError):
        store.load("all4")
    assert store.load("second", "all4").rank == 4
    with pytest.raises(AdapterPathError):
        store.load("../x", "all4")


def test_an_adapter_removed_while_in_use_finishes_its_requests(engine, store_dir):
    store = AdapterStore(store_dir, engine)
    store.scan()
    req = GenerationRequest(prompt_token_ids=(5, 6, 7), adapter="all4",
                            sampling=SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    alone = engine.generate([req])[0].token_ids
    rid = engine.submit(GenerationRequest(prompt_token_ids=req.prompt_token_ids, adapter="all4",
                                          sampling=req.sampling))
    events = engine.step()  # prefill: the adapter is paged in and in use
    assert engine.stats()["adapters_resident"] == 1
    shutil.rmtree(store_dir / "all4")
    assert store.scan().removed == ("all4",) and "all4" not in _names(engine)
    while not any(e.finish_reason for e in events if e.request_id == rid):
        events += engine.step()
    assert tuple(e.token_id for e in events if e.request_id == rid) == alone
    engine.step()  # nothing runs it any more: its pages are freed
    assert engine.stats()["adapters_resident"] == 0


class _Pickled:
    """Unpickling this creates ``marker``: what an arbitrary-object .bin could do instead."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_bin_weights_never_unpickle_objects(engine, store_dir, adapter_dirs, tmp_path):
    from safetensors.torch import load_file

    evil = store_dir / "evil"
    evil.mkdir()
    shutil.copy(store_dir / "all4" / "adapter_config.json", evil)
    state = load_file(str(store_dir / "all4" / "adapter_model.safetensors"))
    marker = tmp_path / "unpickled"
    torch.save({**state, "payload": _Pickled(marker)}, evil / "adapter_model.bin", pickle_module=pickle)
    report = AdapterStore(store_dir, engine).scan()
    assert "evil" in report.failed and not marker.exists()
    plain = store_dir / "plain-bin"  # a .bin of tensors only loads
    plain.mkdir()
    shutil.copy(store_dir / "all4" / "adapter_config.json", plain)
    torch.save(state, plain / "adapter_model.bin")
    assert AdapterStore(store_dir, engine).lookup("plain-bin")
    assert {a.name: a.rank for a in engine.adapters()}["plain-bin"] == 4
    torch.load(evil / "adapter_model.bin", weights_only=False)  # the payload is real: full unpickling runs it
    assert marker.exists()
