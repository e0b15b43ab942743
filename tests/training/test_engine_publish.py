"""``PublishToEngine``: fit pushes every adapter's weights into a running engine at each
validation, with no file in between; the engine's newest version is the trained weights."""


import torch

from lightning_lorafusion.serving import Engine, EngineConfig, GenerationRequest, SamplingParams
from lightning_lorafusion.serving.adapters import load_peft_adapter
from lightning_lorafusion.training.engine_publish import PublishToEngine
from test_validation import fit_val, val_specs


def _engine(model_dir, adapters=None) -> Engine:
    return Engine.from_pretrained(model_dir, adapters, EngineConfig(backend="torch", num_pages=256, page_size=8),
                                  device="cpu", dtype=torch.float32)


def test_fit_publishes_each_adapter_at_every_validation(tiny_model_dir, tmp_path):
    engine = _engine(tiny_model_dir)
    publish = PublishToEngine(engine)
    module, _, _ = fit_val(tiny_model_dir, val_specs(dropout=0.0), max_epochs=2, callbacks=[publish])
    assert publish.versions == [{"a": 1, "b": 1, "c": 1}, {"a": 2, "b": 2, "c": 2}]
    assert {a.name: a.version for a in engine.adapters()} == {"a": 2, "b": 2, "c": 2}
    # the newest version holds the weights fit ended with (its last validation was after the last step)
    out = tmp_path / "exported"
    module.export_adapters(str(out))
    dirs = {}
    for name in ("a", "b", "c"):
        last = out / name / "last"
        dirs[name] = str(last if last.is_dir() else out / name)
        exported = load_peft_adapter(name, dirs[name], engine.model_config, dtype=torch.float32)
        assert torch.equal(engine._adapters[name].flat, exported.flat), name
    reference = _engine(tiny_model_dir, dirs)
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    requests = [GenerationRequest(prompt_token_ids=(5, 9, 17, 30, 2), adapter=n, sampling=sp) for n in dirs]
    published = engine.generate(requests)
    again = reference.generate([GenerationRequest(prompt_token_ids=r.prompt_token_ids, adapter=r.adapter,
                                                  sampling=sp) for r in requests])
    assert [r.token_ids for r in published] == [r.token_ids for r in again]
    assert [r.adapter_version for r in published] == [2, 2, 2]
    engine.close()
    reference.close()


def test_publish_subset_and_no_publish_outside_fit(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    publish = PublishToEngine(engine, adapters=["b"])
    module, _, trainer = fit_val(tiny_model_dir, val_specs(dropout=0.0), max_epochs=1, callbacks=[publish])
    assert publish.versions == [{"b": 1}] and [a.name for a in engine.adapters()] == ["b"]
    trainer.validate(module, datamodule=trainer.datamodule)  # validate alone publishes nothing
    assert publish.versions == [{"b": 1}]
    engine.close()
