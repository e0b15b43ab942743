"""Fixtures for training tests: a tiny random Llama directory with its own word-level tokenizer."""

import pytest


def make_tiny_model_dir(path, *, vocab_size: int = 256, seed: int = 0, num_layers: int = 2):
    """A 2-layer random Llama (GQA) and a matching word-level tokenizer in ``path``."""
    from lightning_lorafusion.model.random_model import write_random_llama

    return write_random_llama(path, vocab_size=vocab_size, seed=seed, num_layers=num_layers)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture
def tiny_model_factory():
    """``make_tiny_model_dir`` for tests that need another size (importing it from ``conftest``
    picks whichever test directory's conftest Python saw first)."""
    return make_tiny_model_dir
