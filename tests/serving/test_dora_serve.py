"""The engine serves DoRA adapters (PEFT ``use_dora``) beside plain LoRA ones: greedy tokens
and logits equal HF transformers + PEFT in heterogeneous batches (prefill and decode rows)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_lorafusion.model.hf_loading import load_base_model
from lightning_lorafusion.model.peft_io import peft_key
from lightning_lorafusion.serving import GenerationRequest, SamplingParams
from lightning_lorafusion.serving.adapters import load_peft_adapter
from lightning_lorafusion.specs import ConfigError

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
CASES = [
    ([11, 4, 30, 22, 8, 19, 40], "dora"),
    ([5, 9, 17], None),
    ([7, 13, 21, 33, 45, 50, 6, 12, 28], "all4"),
    ([60, 2, 35, 18, 26], "dora-mlp"),
    ([44, 41, 10], "dora"),
]


def _write_dora(model_dir, out_dir, *, rank, alpha, targets, seed):
    """A PEFT DoRA directory: random A, B and magnitudes (moved off the row norms of W)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_dora=True))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    peft_model.save_pretrained(out_dir)
    return str(out_dir)


@pytest.fixture(scope="module")
def dora_dirs(model_dir, adapter_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("dora")
    return {
        "dora": _write_dora(model_dir, root / "dora", rank=4, alpha=8.0, seed=1,
                            targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
        "dora-mlp": _write_dora(model_dir, root / "dora-mlp", rank=3, alpha=5.0, seed=2,
                                targets=["gate_proj", "up_proj", "down_proj"]),
        "all4": adapter_dirs["all4"],
    }


def _requests(cases, sampling=GREEDY):
    return [GenerationRequest(prompt_token_ids=p, adapter=a, sampling=sampling) for p, a in cases]


@pytest.mark.parametrize("backend", ["torch", "triton", "triton_grouped"])
def test_dora_and_lora_batch_is_greedy_equal_to_hf_peft(make_engine, model_dir, dora_dirs, hf_reference_of, backend,
                                                        monkeypatch):
    """"triton_grouped": the decode rows' LoRA grouped by adapter from the first row (the
    grouped shrink with its one-row groups per row, the grouped expand with its one-row groups
    by the row loop): DoRA rows (g * B folded at load) go through it like LoRA rows."""
    if backend == "triton_grouped":
        from lightning_lorafusion.kernels import lora_gather

        for name, value in (("GROUPED_MIN_ROWS", 1), ("GROUPED_EXPAND_MIN_ROWS", 1),
                            ("GROUPED_SHRINK_SINGLE_ROWS", True), ("GROUPED_EXPAND_LOOP_ROWS", 1)):
            monkeypatch.setattr(lora_gather, name, value)
        backend = "triton"
    engine = make_engine(with_adapters=False, num_pages=96, page_size=4, backend=backend)
    for name, path in dora_dirs.items():
        engine.add_adapter(name, path)
    ref = hf_reference_of(model_dir, dora_dirs)
    cases = CASES if backend == "torch" else CASES[:4]
    sampling = GREEDY if backend == "torch" else SamplingParams(max_new_tokens=3, temperature=0.0)
    for (prompt, adapter), res in zip(cases, engine.generate(_requests(cases, sampling))):
        assert list(res.token_ids) == ref.generate(prompt, adapter, sampling.max_new_tokens), (adapter, prompt)
    # DoRA changes the outputs: the adapter's tokens differ from the base's
    prompt = CASES[0][0]
    outs = {a: engine.generate(_requests([(prompt, a)]))[0].token_ids for a in (None, "dora")}
    assert outs[None] != outs["dora"]


def test_dora_prompt_logprobs_equal_hf_peft_logits(make_engine, model_dir, dora_dirs, hf_reference_of):
    engine = make_engine(with_adapters=False, num_pages=96, page_size=4)
    engine.add_adapter("dora", dora_dirs["dora"])
    ref = hf_reference_of(model_dir, {"dora": dora_dirs["dora"]})
    prompt = CASES[0][0]
    sp = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=0)
    res = engine.generate(_requests([(prompt, "dora")], sp))[0]
    logits = ref.logits(prompt, "dora")
    expected = torch.log_softmax(logits.double(), -1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    got = torch.tensor([lp for lp in res.prompt_logprobs[1:]], dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_loading_a_dora_adapter_without_the_base_is_refused(model_dir, dora_dirs):
    config, _, _ = load_base_model(str(model_dir), dtype=torch.float32)
    with pytest.raises(ConfigError, match=r"is a DoRA adapter \(use_dora\); loading it needs the base weights"):
        load_peft_adapter("dora", dora_dirs["dora"], config, dtype=torch.float32)


def _bank_state(peft_dir, num_layers, targets):
    """A DoRA adapter's tensors under the adapter bank's state_dict names (adapter 0)."""
    from safetensors.torch import load_file

    from lightning_lorafusion.model.peft_io import peft_magnitude_key

    state = load_file(f"{peft_dir}/adapter_model.safetensors")
    out = {}
    for layer in range(num_layers):
        for module in targets:
            prefix = f"bank.adapters.0.{layer}.{module}."
            out[prefix + "lora_A"] = state[peft_key(layer, module, "lora_A")]
            out[prefix + "lora_B"] = state[peft_key(layer, module, "lora_B")]
            out[prefix + "lora_magnitude"] = state[peft_magnitude_key(layer, module)]
    return out


def test_dora_from_tensors_and_from_a_checkpoint_equal_the_peft_directory(make_engine, dora_dirs, tmp_path):
    """``add_adapter_weights(magnitudes=...)`` (the val samples of fit) and a fit checkpoint's
    DoRA adapter serve what the PEFT directory serves."""
    targets = ("gate_proj", "up_proj", "down_proj")
    engine = make_engine(with_adapters=False, num_pages=128, page_size=4)
    engine.add_adapter("dir", dora_dirs["dora-mlp"])
    state = _bank_state(dora_dirs["dora-mlp"], engine.model_config.num_layers, targets)
    factors = {(layer, m): (state[f"bank.adapters.0.{layer}.{m}.lora_A"], state[f"bank.adapters.0.{layer}.{m}.lora_B"])
               for layer in range(engine.model_config.num_layers) for m in targets}
    magnitudes = {k: state[f"bank.adapters.0.{k[0]}.{k[1]}.lora_magnitude"] for k in factors}
    engine.add_adapter_weights("tensors", factors, rank=3, alpha=5.0, magnitudes=magnitudes)
    ckpt = tmp_path / "fit.ckpt"
    torch.save({"hyper_parameters": {"adapters": [{"name": "ckpt", "rank": 3, "alpha": 5.0, "dora": True}]},
                "state_dict": state}, ckpt)
    engine.add_adapters_from_checkpoint(str(ckpt))
    prompt = CASES[3][0]
    outs = [engine.generate(_requests([(prompt, a)]))[0].token_ids for a in ("dir", "tensors", "ckpt", None)]
    assert outs[0] == outs[1] == outs[2] != outs[3]


def test_dora_on_a_base_with_biases_equals_hf_peft(tmp_path, hf_reference_of):
    """Qwen2's q/k/v biases: the DoRA rows' frozen products are rescaled without their bias."""
    from lightning_lorafusion.serving import Engine, EngineConfig
    from test_generation import _write_family

    model_dir = _write_family(tmp_path / "qwen2", "qwen2")
    path = _write_dora(model_dir, tmp_path / "dora", rank=3, alpha=6.0, seed=4,
                       targets=["q_proj", "k_proj", "v_proj", "down_proj"])
    engine = Engine.from_pretrained(str(model_dir), {"dora": path}, EngineConfig(num_pages=64, page_size=4),
                                    device="cpu")
    cases = [([5, 9, 17, 30, 2, 44, 8, 12], "dora"), ([7, 13, 21], None), ([11, 4, 30], "dora")]
    sp = SamplingParams(max_new_tokens=6, temperature=0.0)
    results = engine.generate(_requests(cases, sp))
    engine.close()
    ref = hf_reference_of(model_dir, {"dora": path})
    for (prompt, adapter), res in zip(cases, results):
        assert list(res.token_ids) == ref.generate(prompt, adapter, 6), adapter


def _spy_decode_dora(engine):
    """Record the kind of DoRA rows each decode-only step takes (slot table, ranges, none)."""
    from lightning_lorafusion.serving.dora_rows import DoraSlotRows

    runner, kinds = engine.runner, []
    decode_dora = runner._decode_dora

    def spied(decode, rows):
        found = decode_dora(decode, rows)
        kinds.append("slots" if isinstance(found, DoraSlotRows) else "ranges" if found is not None else None)
        return found

    runner._decode_dora = spied
    return kinds


@pytest.mark.parametrize("slots", [8, 1])
def test_graph_shaped_steps_with_dora_rows_are_greedy_equal_to_hf_peft(make_engine, model_dir, dora_dirs,
                                                                        hf_reference_of, slots):
    """Decode steps padded to batch buckets and mixed steps as pieces (what the decode CUDA
    graphs and the captured pieces run, here eagerly on the CPU; chunked prefill, so steps mix
    prefill and decode rows): the DoRA rows read their gains from the fixed-shape slot table
    by a per-row slot index; two DoRA adapters and a LoRA one in one batch give HF + PEFT's
    greedy tokens. With one slot the steps holding both DoRA adapters take the row ranges (no
    graph) instead, and the tokens are the same; the slot is reused as the rows change."""
    from lightning_lorafusion.serving.dora_rows import DoraSlots

    engine = make_engine(with_adapters=False, num_pages=96, page_size=4, mixed_graphs="eager",
                         enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=8)
    for name, path in dora_dirs.items():
        engine.add_adapter(name, path)
    engine.runner.pad_decode = True
    engine.runner._slots = DoraSlots(engine.model_config, max_rows=engine.runner.decode_inputs.max_rows,
                                     device=engine.runner.device, dtype=engine.pool.storage.dtype, slots=slots)
    kinds = _spy_decode_dora(engine)
    ref = hf_reference_of(model_dir, dora_dirs)
    sampling = SamplingParams(max_new_tokens=6, temperature=0.0)
    # staggered lengths: the decode rows change as requests finish (slots taken and given up)
    reqs = [GenerationRequest(prompt_token_ids=p, adapter=a, sampling=dataclasses.replace(
        sampling, max_new_tokens=3 + i)) for i, (p, a) in enumerate(CASES)]
    for req, res in zip(reqs, engine.generate(reqs)):
        want = ref.generate(req.prompt_token_ids, req.adapter, req.sampling.max_new_tokens)
        assert list(res.token_ids) == want, (req.adapter, req.prompt_token_ids)
    assert "slots" in kinds
    assert ("ranges" in kinds) == (slots == 1)
    assert engine.runner._mixed_dora  # mixed steps with DoRA rows ran their pieces


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_decode_graphs_with_dora_rows_equal_hf_peft(model_dir, dora_dirs, hf_reference_of):
    """On a GPU (fp32): with decode graphs on, steps with DoRA rows replay a graph (captured on
    the first such step of a bucket) and the greedy tokens equal graphs off and HF + PEFT."""
    from lightning_lorafusion.serving import Engine, EngineConfig
    from lightning_lorafusion.serving.config import EngineTuning

    def engine(graphs):
        return Engine.from_pretrained(str(model_dir), dora_dirs, EngineConfig(
            num_pages=96, page_size=4, max_num_seqs=16, cuda_graphs=graphs,
            tuning=EngineTuning(async_decode="off")), device="cuda", dtype=torch.float32)

    on, off = engine("on"), engine("off")
    ref = hf_reference_of(model_dir, dora_dirs)
    got_on, got_off = on.generate(_requests(CASES)), off.generate(_requests(CASES))
    assert any(key[2] for key in on.runner.graphs.keys)  # a DoRA graph was captured and replayed
    for (prompt, adapter), a, b in zip(CASES, got_on, got_off):
        assert list(a.token_ids) == list(b.token_ids) == ref.generate(prompt, adapter, GREEDY.max_new_tokens)
    on.close()
    off.close()


@pytest.mark.parametrize("padded", [False, True])
def test_dora_on_phi3_fused_projections_equals_hf_peft(tmp_path, padded):
    """Phi-3's fused ``qkv_proj`` / ``gate_up_proj``: PEFT's DoRA keeps one magnitude over the
    fused output and normalises each fused row; the engine splits the adapter into the members
    (B's rows and the gains by member rows) and gives HF + PEFT's greedy tokens beside a base
    row, eagerly and in graph-shaped (padded, slot-table) decode steps."""
    import os
    import sys

    from peft import LoraConfig, PeftModel, get_peft_model

    from lightning_lorafusion.model.hf_loading import params_from_hf_model
    from lightning_lorafusion.serving import Engine, EngineConfig

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "model"))
    from _tiny_hf import tiny_hf_model

    model = tiny_hf_model("phi3", seed=1)
    peft_model = get_peft_model(model, LoraConfig(r=3, lora_alpha=6.0, use_dora=True, target_modules=[
        "qkv_proj", "o_proj", "gate_up_proj", "down_proj"]))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_magnitude_vector" in name:
                if "gate_up_proj" in name:  # one magnitude over the fused output
                    assert p.shape == (2 * model.config.intermediate_size,)
                p.mul_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    peft_model.save_pretrained(tmp_path / "dora")
    model = peft_model.unload()
    config, params = params_from_hf_model(model)
    engine = Engine(config, params, None, EngineConfig(num_pages=96, page_size=4))
    engine.add_adapter("dora", str(tmp_path / "dora"))
    engine.runner.pad_decode = padded
    kinds = _spy_decode_dora(engine)
    cases = [([11, 4, 30, 22, 8, 19, 40, 71], "dora"), ([5, 9, 17, 3], None), ([60, 2, 35, 18, 26], "dora")]
    sp = SamplingParams(max_new_tokens=6, temperature=0.0)
    results = engine.generate(_requests(cases, sp))
    engine.close()
    assert set(kinds) == {"slots" if padded else "ranges"}
    ref = PeftModel.from_pretrained(model, str(tmp_path / "dora")).eval()
    eos = model.generation_config.eos_token_id
    assert eos is None or all(eos not in r.token_ids for r in results)  # six tokens each, none cut short
    for (prompt, adapter), res in zip(cases, results):
        ids = torch.tensor([prompt])
        with torch.no_grad(), (ref.disable_adapter() if adapter is None else _nothing()):
            out = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=6, pad_token_id=0)
        assert list(res.token_ids) == out[0, len(prompt):].tolist(), adapter
    assert results[0].token_ids != engine_base_tokens(ref, cases[0][0])  # the adapter changes the tokens


def engine_base_tokens(ref, prompt):
    """HF's greedy tokens of ``prompt`` on the base (the adapter off)."""
    ids = torch.tensor([prompt])
    with torch.no_grad(), ref.disable_adapter():
        out = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                           pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _nothing():
    import contextlib

    return contextlib.nullcontext()
