"""Hub ids (``org/name[@revision]``) resolved offline from a cache laid out as huggingface_hub lays it out."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from lightning_lorafusion.model import decoder as D
from lightning_lorafusion.model.hf_loading import load_base_model, resolve_model_dir
from lightning_lorafusion.specs import ConfigError

from _tiny_hf import tiny_hf_model
from test_hf_loading import _word_tokenizer

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def _cache_model(hf_home: Path, repo_id: str, commit: str, refs: dict[str, str], seed: int = 0):
    """Write a tiny sharded Qwen3 + tokenizer as ``hub/models--org--name/{blobs,snapshots/<commit>,refs}``
    (files of a snapshot are links to blobs, as huggingface_hub makes them)."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    staging = hf_home / "staging" / commit
    model = tiny_hf_model("qwen3", seed=seed)
    model.save_pretrained(staging, max_shard_size="40KB")  # several shards + the index
    _word_tokenizer(90).save_pretrained(staging)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in staging.iterdir():
        blob = repo / "blobs" / f"{commit[:8]}-{f.name}"
        shutil.move(str(f), blob)
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    (repo / "refs").mkdir(exist_ok=True)
    for ref, target in refs.items():
        (repo / "refs" / ref).write_text(target)
    return model


@pytest.fixture
def offline_home(tmp_path, monkeypatch):
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def test_hub_id_resolves_offline_from_the_cache_and_loads_sharded_weights(offline_home):
    model = _cache_model(offline_home, "tiny-org/tiny-qwen3", COMMIT, {"main": COMMIT})
    snapshot = resolve_model_dir("tiny-org/tiny-qwen3")
    assert snapshot == offline_home / "hub" / "models--tiny-org--tiny-qwen3" / "snapshots" / COMMIT
    assert len(list(snapshot.glob("*.safetensors"))) > 1 and (snapshot / "model.safetensors.index.json").exists()
    config, params, tokenizer = load_base_model("tiny-org/tiny-qwen3")
    assert config.model_type == "qwen3" and tokenizer.convert_tokens_to_ids(["w3"]) == [4]
    ids = torch.arange(3, 15)
    with torch.no_grad():
        ours = D.logits(params, None, ids, torch.arange(12), torch.tensor([0, 12]), None, config=config)
        ref = model(ids[None]).logits[0]
    assert (ours - ref).abs().max() < 1e-4 * max(1.0, ref.abs().max().item())


def test_revision_after_at_picks_that_snapshot(offline_home):
    _cache_model(offline_home, "tiny-org/tiny-qwen3", COMMIT, {"main": COMMIT}, seed=0)
    _cache_model(offline_home, "tiny-org/tiny-qwen3", OTHER, {"v2": OTHER}, seed=1)
    assert resolve_model_dir("tiny-org/tiny-qwen3").name == COMMIT
    assert resolve_model_dir("tiny-org/tiny-qwen3@v2").name == OTHER
    assert resolve_model_dir(f"tiny-org/tiny-qwen3@{OTHER}").name == OTHER
    a, b = load_base_model("tiny-org/tiny-qwen3")[1], load_base_model("tiny-org/tiny-qwen3@v2")[1]
    assert not torch.equal(a["embed"], b["embed"])


def test_missing_model_offline_is_one_line_saying_how_to_fetch(offline_home):
    with pytest.raises(ConfigError) as info:
        resolve_model_dir("Qwen/Qwen3-0.6B@main")
    message = str(info.value)
    assert "\n" not in message
    assert "'Qwen/Qwen3-0.6B@main'" in message and "HF_HUB_OFFLINE=1" in message
    assert "hf download Qwen/Qwen3-0.6B --revision main" in message
    assert str(offline_home / "hub") in message


def test_missing_shard_named_by_the_index_is_a_clear_error(offline_home):
    _cache_model(offline_home, "tiny-org/tiny-qwen3", COMMIT, {"main": COMMIT})
    snapshot = resolve_model_dir("tiny-org/tiny-qwen3")
    next(iter(sorted(snapshot.glob("model-*.safetensors")))).unlink()
    with pytest.raises(ConfigError, match="names shards that are not there"):
        load_base_model("tiny-org/tiny-qwen3")


def test_local_directory_wins_over_a_hub_id_of_the_same_spelling(tmp_path, monkeypatch, offline_home):
    local = tmp_path / "org" / "name"
    tiny_hf_model("olmo2").save_pretrained(local)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_dir("org/name") == Path("org/name")
