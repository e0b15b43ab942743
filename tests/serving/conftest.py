"""Fixtures for engine tests: a tiny random Llama, random PEFT adapters, HF + PEFT references."""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.model.random_model import write_random_llama
from lightning_lorafusion.serving import Engine, EngineConfig
from lightning_lorafusion.serving.config import TUNING_FIELDS, EngineTuning

# name -> (rank, alpha, target modules); ranks and targets differ on purpose
ADAPTERS = {
    "all4": (4, 8.0, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "attn2": (2, 3.0, ["q_proj", "v_proj"]),
    "mlp8": (8, 4.0, ["gate_proj", "up_proj", "down_proj", "o_proj"]),
}
VOCAB = 64


def write_random_peft_adapter(model_dir, out_dir, *, rank, alpha, targets, seed):
    """A PEFT LoRA directory with random A and (non-zero) B, so the adapter changes outputs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                 lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    peft_model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    write_random_llama(path, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, init_std=0.15, max_positions=128, seed=3)
    return path


@pytest.fixture(scope="session")
def adapter_dirs(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: str(write_random_peft_adapter(model_dir, root / name, rank=r, alpha=a, targets=t, seed=i))
            for i, (name, (r, a, t)) in enumerate(ADAPTERS.items())}


@pytest.fixture
def make_engine(model_dir, adapter_dirs):
    engines = []

    def make(with_adapters: bool = True, device: str | None = None, **config) -> Engine:
        """An engine over the tiny model; ``config``: EngineConfig's fields, and EngineTuning's
        (``async_decode="off"``), which go into its ``tuning``."""
        adapters = adapter_dirs if with_adapters else None
        tuning = {k: config.pop(k) for k in TUNING_FIELDS if k in config}
        if tuning:
            config["tuning"] = EngineTuning(**tuning)
        if device is None:  # Triton kernels on CPU tensors need the interpreter, set only without a GPU
            device = "cuda" if config.get("backend") == "triton" and torch.cuda.is_available() else "cpu"
        engine = Engine.from_pretrained(str(model_dir), adapters, EngineConfig(**config), device=device,
                                        dtype=torch.float32)
        engines.append(engine)
        return engine

    yield make
    for e in engines:
        e.close()


class HFReference:
    """``generate(prompt, adapter, max_new_tokens)`` and ``logits(prompt, adapter)`` from HF
    transformers + PEFT over ``model_dir`` with every adapter of ``adapter_dirs`` loaded
    (``set_adapter`` / ``disable_adapter``; adapter None = the base)."""

    def __init__(self, model_dir, adapter_dirs) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        names = list(adapter_dirs)
        model = PeftModel.from_pretrained(base, str(adapter_dirs[names[0]]), adapter_name=names[0])
        for name in names[1:]:
            model.load_adapter(str(adapter_dirs[name]), adapter_name=name)
        self.model = model.eval()

    def _run(self, adapter, fn):
        if adapter is None:
            with self.model.disable_adapter():
                return fn()
        self.model.set_adapter(adapter)
        return fn()

    @torch.no_grad()
    def generate(self, prompt, adapter, max_new_tokens):
        ids = torch.tensor([prompt])
        out = self._run(adapter, lambda: self.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=0))
        return out[0, len(prompt):].tolist()

    @torch.no_grad()
    def logits(self, prompt, adapter):
        return self._run(adapter, lambda: self.model(input_ids=torch.tensor([prompt])).logits[0])


@pytest.fixture(scope="session")
def hf_reference(model_dir, adapter_dirs):
    """``HFReference`` of the tiny Llama and its three adapters."""
    return HFReference(model_dir, adapter_dirs)


@pytest.fixture(name="hf_reference_of", scope="session")
def hf_reference_of_fixture():
    """``HFReference`` itself, for tests with their own model (see ``write_random_peft_adapter``
    for why not an import)."""
    return HFReference


@pytest.fixture(name="write_random_peft_adapter", scope="session")
def write_random_peft_adapter_fixture():
    """The writer above as a fixture: test modules cannot import this conftest by name (pytest
    loads several conftest.py files, and whichever came first owns the name ``conftest``)."""
    return write_random_peft_adapter


def _process_exited(pid: int) -> bool:
    """No process ``pid`` any more, or only its zombie (nobody may reap it in a container)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return "\nState:\tZ" in status


@pytest.fixture(name="process_exited")
def process_exited_fixture():
    """``process_exited(pid)``, for tests that check child processes end (Linux /proc)."""
    return _process_exited


@pytest.fixture(name="write_adapter")
def write_adapter_fixture():
    """``write_random_peft_adapter``, for tests that build their own base model."""
    return write_random_peft_adapter
