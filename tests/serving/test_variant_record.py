"""The record of the kernel variants compiled ahead (serving/variant_record.py): written whole, read
back to the same variants of the same kernels, ignored (and recorded again) when its key differs
or it cannot be read; a restart with a record compiles the same variants as the run that found
them, without running the pieces to find them, and ends with the same captures. Also which
mixed-step pieces run eagerly before their capture (``MixedPieces.piece_kind``).

On the CPU nothing compiles: launches are found with ``test_compile_ahead.interpreter_launches``
and the compile function is replaced by one that lists what it is given.
"""

from __future__ import annotations

import json
import logging
import threading
import types

import pytest
import torch

from lightning_lorafusion.serving import compile_ahead, variant_record
from lightning_lorafusion.serving import warm_up as warm_up_module
from lightning_lorafusion.serving.compile_ahead import KernelVariant
from lightning_lorafusion.serving.mixed_graphs import layer_kind
from lightning_lorafusion.serving.variant_record import load_record, record_key, record_path, resolve_kernel, save_record

from test_cold_start import make_ranked_engine
from test_compile_ahead import TRITON_PREFILL, interpreter_launches


def _kernels():
    from lightning_lorafusion.kernels import lora_gather, rms_norm  # noqa: F401

    names = ["lightning_lorafusion.kernels.lora_gather:_lora_shrink_kernel"]
    return [KernelVariant(n, json.dumps({"case": i}), resolve_kernel(n)) for i, n in enumerate(names * 2)]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAFUSION_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_record_round_trips_and_is_written_whole(cache):
    key = {"format": 1, "part": "mixed", "model": "m"}
    variants = _kernels()
    path = record_path(key)
    assert path.parent == cache / "kernel_variants" and path.name.startswith("mixed-")
    save_record(path, key, variants)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    loaded, dropped = load_record(path, key)
    assert loaded == variants and dropped == 0
    assert all(a.kernel is b.kernel for a, b in zip(loaded, variants))
    assert record_path(dict(key, model="other")) != path


def test_a_mismatched_corrupt_or_missing_record_is_ignored_with_a_log_line(cache, caplog):
    key = {"format": 1, "part": "mixed", "model": "m"}
    path = record_path(key)
    with caplog.at_level(logging.INFO, logger="lightning_lorafusion.serving"):
        assert load_record(path, key) is None
        save_record(path, dict(key, model="other"), _kernels())  # another key under this name
        assert load_record(path, key) is None
        path.write_text('{"key": ')
        assert load_record(path, key) is None
        path.write_text(json.dumps({"key": key, "variants": [{"name": 3}]}))
        assert load_record(path, key) is None
    messages = [r.getMessage() for r in caplog.records]
    assert sum("no record" in m for m in messages) == 1
    assert sum("another model" in m for m in messages) == 1
    assert sum("cannot be read" in m for m in messages) == 2


def test_a_variant_whose_kernel_changed_or_is_gone_is_dropped(cache):
    key = {"format": 1, "part": "decode"}
    path = record_path(key)
    save_record(path, key, _kernels())
    body = json.loads(path.read_text())
    body["variants"][0]["source"] = "an older source"
    body["variants"].append({"name": "lightning_lorafusion.kernels.lora_gather:no_such_kernel", "data": "{}",
                             "source": ""})
    path.write_text(json.dumps(body))
    loaded, dropped = load_record(path, key)
    assert loaded == _kernels()[1:] and dropped == 2


def test_recorded_variants_reads_a_matching_record_and_records_a_stale_one_again(cache, monkeypatch):
    key = {"format": 1, "part": "mixed"}
    monkeypatch.setattr(variant_record, "uses_records", lambda device: True)
    monkeypatch.setattr(variant_record, "record_key", lambda engine, part: key)
    engine = types.SimpleNamespace(device=torch.device("cpu"))
    calls = []

    def find():
        calls.append(1)
        return _kernels()

    first = variant_record.recorded_variants(engine, "mixed", find)
    second = variant_record.recorded_variants(engine, "mixed", find)
    assert (first[1]["source"], second[1]["source"], len(calls)) == ("recorded", "record", 1)
    assert first[0] == second[0] == _kernels()
    path = record_path(key)
    body = json.loads(path.read_text())
    body["variants"][1]["source"] = "an older source"
    path.write_text(json.dumps(body))
    third = variant_record.recorded_variants(engine, "mixed", find)
    assert third[1]["source"] == "recorded" and len(calls) == 2
    assert load_record(path, key) == (_kernels(), 0)  # written again, current
    assert variant_record.recorded_variants(engine, "mixed", find, use_record=False)[1]["source"] == "off"
    assert len(calls) == 3


def test_the_key_follows_the_setup_not_the_adapters(make_engine):
    """Adapters of other ranks: the same key; another token-bucket mode or dtype-relevant setting:
    another key; the record switch and the capture warm-ups are not in it."""
    one = make_ranked_engine(make_engine, [8], mixed_graphs="eager")
    many = make_ranked_engine(make_engine, [4, 24, 128], mixed_graphs="eager", kernel_variant_record="off",
                              capture_warm_up="every")
    pow2 = make_ranked_engine(make_engine, [8], mixed_graphs="eager", token_buckets="pow2")
    assert record_key(one, "mixed") == record_key(many, "mixed")
    assert record_key(one, "mixed") != record_key(pow2, "mixed")
    assert record_key(one, "mixed") != record_key(one, "decode")
    json.dumps(record_key(one, "mixed"))  # plain JSON


def test_a_restart_reads_the_record_and_compiles_what_the_first_run_found(make_engine, cache, monkeypatch):
    """First engine: the variants found by running the pieces (recorded), kept in the record. A
    second engine of the same setup (the restart; other adapters and ranks): the list read from
    the record, the pieces not run to find it, the same variants compiled and the same captures.
    With the record off the pieces run again."""
    monkeypatch.setattr(compile_ahead, "record_launches", interpreter_launches)
    monkeypatch.setattr(variant_record, "uses_records", lambda device: True)
    compiled: list[list[KernelVariant]] = []
    lock = threading.Lock()

    def fake_compile(variant, device):
        with lock:
            compiled[-1].append(variant)

    monkeypatch.setattr(compile_ahead, "compile_variant", fake_compile)
    reports, keys = [], []
    for ranks in ([4, 64], [8, 16, 128]):
        engine = make_ranked_engine(make_engine, ranks, **TRITON_PREFILL)
        compiled.append([])
        reports.append(engine.warm_up(prompt_len=3, max_new_tokens=2))
        keys.append(engine.runner.capture_keys())
        if len(reports) == 1:  # the restart must not find them by running the pieces
            monkeypatch.setattr(warm_up_module, "warm_up_variants", lambda engine: pytest.fail("recorded again"))
    first, restart = (r["compile_ahead"] for r in reports)
    assert (first["source"], restart["source"]) == ("recorded", "record")
    assert first["path"] == restart["path"] and restart["dropped"] == 0
    assert len(compiled[0]) > 1 and set(compiled[0]) == set(compiled[1])
    assert len(compiled[0]) == len(set(compiled[0])) == first["variants"] == restart["variants"]
    assert keys[0] == keys[1]
    off = make_ranked_engine(make_engine, [8], **TRITON_PREFILL, kernel_variant_record="off")
    with pytest.raises(pytest.fail.Exception, match="recorded again"):
        off.warm_up(prompt_len=3, max_new_tokens=2)


def test_the_record_is_off_where_nothing_compiles_ahead(make_engine, cache):
    engine = make_ranked_engine(make_engine, [8], mixed_graphs="eager")
    report = engine.warm_up(prompt_len=3, max_new_tokens=2)
    assert report["compile_ahead"]["source"] == "off" and report["compile_ahead"]["path"] is None
    assert not (cache / "kernel_variants").exists()


def test_pieces_of_layers_alike_are_one_kind(make_engine):
    """The middle pieces of layers of the same shapes are one kind (run eagerly once before their
    captures); the first and the last are kinds of their own; a layer whose weights differ in
    shape makes its pieces another kind."""
    engine = make_ranked_engine(make_engine, [8], mixed_graphs="eager")
    runner = engine.runner
    runner.build_mixed_pieces()
    pieces = next(iter(runner._mixed.values()))
    n = engine.model_config.num_layers
    kinds = [pieces.piece_kind(i) for i in range(n + 1)]
    assert n >= 2 and len(set(kinds[1:n])) == 1
    assert len({kinds[0], kinds[1], kinds[n]}) == 3
    layers = runner.model.params["layers"]
    before, layer = layer_kind(runner.model, 1), layers[1]
    layers[1] = {**layer, "extra": torch.zeros(3, 5)}
    try:
        wide = layer_kind(runner.model, 1)
        assert wide != before and layer_kind(runner.model, 0) == before
        layers[1] = {**layer, "extra": torch.zeros(5, 3)}
        assert layer_kind(runner.model, 1) not in (before, wide)
    finally:
        layers[1] = layer


@pytest.fixture(scope="module")
def four_layer_dir(tmp_path_factory):
    from lightning_lorafusion.model.random_model import write_random_llama

    path = tmp_path_factory.mktemp("four-layers")
    write_random_llama(path, vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                       num_kv_heads=2, init_std=0.15, max_positions=128, seed=3)
    return path


def test_capture_runs_one_piece_of_each_kind_eagerly_and_retries_a_miss(four_layer_dir, monkeypatch):
    """``MixedPieces.capture`` (its CUDA calls replaced so it runs on the CPU): with "first" only
    the first piece, the first middle one and the last run eagerly before their captures; a
    capture that launches a variant not compiled yet is dropped, the variant compiled, the piece
    run eagerly and captured again; with "every" each piece runs eagerly first."""
    import contextlib

    from lightning_lorafusion.serving import mixed_graphs

    from lightning_lorafusion.serving import Engine, EngineConfig
    from lightning_lorafusion.serving.config import EngineTuning

    engine = Engine.from_pretrained(str(four_layer_dir), None, EngineConfig(
        num_pages=64, max_num_batched_tokens=16, max_num_seqs=4, tuning=EngineTuning(mixed_graphs="eager")),
        device="cpu", dtype=torch.float32)
    runner = engine.runner
    pieces = runner._new_pieces(8, write=True)
    n = engine.model_config.num_layers
    assert n == 4
    log: list[tuple[str, int]] = []
    state = {"capturing": False, "miss_at": 1}
    missing: list[list] = []

    class FakeGraph:
        def pool(self):
            return "pool"

    @contextlib.contextmanager
    def fake_capture(graph, pool=None):
        state["capturing"] = True
        yield
        state["capturing"] = False

    @contextlib.contextmanager
    def fake_record():
        found: list = []
        missing.append(found)
        yield found

    def piece(i):
        log.append(("capture" if state["capturing"] else "eager", i))
        if state["capturing"] and i == state["miss_at"] and missing:
            missing[-1].append(KernelVariant("m:k", "{}", None))
            state["miss_at"] = None

    compiled = []
    monkeypatch.setattr(mixed_graphs, "graph_capture", fake_capture)
    monkeypatch.setattr(mixed_graphs, "capture_batch", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(mixed_graphs, "record_launches", fake_record)
    monkeypatch.setattr(mixed_graphs, "compile_variants", lambda variants, device: compiled.extend(variants))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(pieces, "piece", piece)
    pieces.capture(None)
    eager = [i for kind, i in log if kind == "eager"]
    assert eager == [0, 1, 1, n]  # piece 1 again after its capture missed a variant
    assert [i for kind, i in log if kind == "capture"] == [0, 1, 1, *range(2, n + 1)]
    assert len(pieces.graphs) == n + 1 and [v.name for v in compiled] == ["m:k"]
    log.clear()
    runner.capture_warm_up = "every"
    pieces.capture(None)
    assert [i for kind, i in log if kind == "eager"] == list(range(n + 1))
    engine.close()
