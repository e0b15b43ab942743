"""The generation engine on every decoder family against transformers + PEFT ``generate``.

Per family (tiny random models built by transformers, fp32 on the CPU, each family's pieces
live: soft-caps that bend the scores, windows shorter than the prompts, local and global RoPE
bases that differ): greedy tokens of a heterogeneous batch (the base and three PEFT adapters of
different ranks and targets, one of them trained by PEFT) equal HF + PEFT ``generate``, with
prefix caching and chunked prefill on, a second time over the cached prefixes; the padded
mixed-step pieces (what a GPU captures) and the Triton kernels (interpreter) give the same.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from lightning_lorafusion.model.hf_loading import params_from_hf_model
from lightning_lorafusion.serving import Engine, EngineConfig, GenerationRequest, SamplingParams
from lightning_lorafusion.serving.config import EngineTuning

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "model"))
from _tiny_hf import tiny_hf_model  # noqa: E402  (tests/model's builder of tiny family models)

FAMILIES = ("llama", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2")
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, targets by per-projection names; a fused checkpoint's names replace them)
ADAPTERS = {
    "all4": (4, 8.0, ALL),
    "attn2": (2, 3.0, ["q_proj", "v_proj"]),
    "mlp6": (6, 4.0, ["gate_proj", "up_proj", "down_proj", "o_proj"]),
}
TRAINED = "trained3"  # made by PEFT's own training loop (B starts at zero, as PEFT inits it)
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
         "up_proj": "gate_up_proj"}
# prompts longer than the tiny windows (Gemma 5, Phi-3 7), two sharing a prefix of two pages
CASES = [
    ([5, 9, 17, 3, 44, 61, 2, 8], None),
    ([11, 4, 30, 22, 8, 19, 40, 71, 12, 90, 33], "all4"),
    ([7, 13, 21, 33, 45, 50, 6, 12, 28, 31, 9, 14, 55], "attn2"),
    ([60, 2, 35, 18, 26, 77], "mlp6"),
    ([11, 4, 30, 22, 8, 19, 40, 71, 3, 5], "all4"),
    ([8, 16, 99, 47, 23, 5, 64], TRAINED),
    ([7, 13, 21, 33, 45, 50, 6, 12, 28, 31, 9], "mlp6"),
]
MAX_NEW = 9


def _targets(model, names):
    if "qkv_proj" in {n.split(".")[-1] for n, _ in model.named_modules()}:
        return list(dict.fromkeys(FUSED.get(m, m) for m in names))
    return names


def _write_adapters(model, root) -> dict[str, str]:
    """PEFT directories: three with random non-zero factors, one trained a few steps by PEFT."""
    from peft import LoraConfig, get_peft_model

    dirs = {}
    for i, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items()):
        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                                                      target_modules=_targets(model, targets)))
        g = torch.Generator().manual_seed(10 + i)
        with torch.no_grad():
            for n, p in peft_model.named_parameters():
                if "lora_" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        peft_model.save_pretrained(root / name)
        dirs[name] = str(root / name)
        model = peft_model.unload()
    peft_model = get_peft_model(model, LoraConfig(r=3, lora_alpha=6.0, lora_dropout=0.0,
                                                  target_modules=_targets(model, ALL)))
    opt = torch.optim.Adam([p for p in peft_model.parameters() if p.requires_grad], lr=0.05)
    g = torch.Generator().manual_seed(7)
    for _ in range(4):
        ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=g)
        peft_model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    peft_model.save_pretrained(root / TRAINED)
    dirs[TRAINED] = str(root / TRAINED)
    peft_model.unload()
    return dirs


class _Family:
    """A tiny model of one family, its PEFT adapters and HF + PEFT greedy references."""

    def __init__(self, family: str, root, cases=CASES) -> None:
        from peft import PeftModel

        model = tiny_hf_model(family, seed=1)
        self.dirs = _write_adapters(model, root)
        self.config, self.params = params_from_hf_model(model)
        eos = model.generation_config.eos_token_id
        self.eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        names = list(self.dirs)
        ref = PeftModel.from_pretrained(model, self.dirs[names[0]], adapter_name=names[0])
        for name in names[1:]:
            ref.load_adapter(self.dirs[name], adapter_name=name)
        self.ref = ref.eval()
        self.cases = cases
        self.expected, self.expected_logprobs = zip(*(self.generate(p, a, MAX_NEW) for p, a in cases))

    @torch.no_grad()
    def generate(self, prompt, adapter, max_new_tokens) -> tuple[list[int], list[float]]:
        """Greedy tokens and each one's log-probability (a final logit soft-cap, monotonic, keeps
        the argmax: only the log-probabilities show it)."""
        ids = torch.tensor([prompt])

        def run():
            out = self.ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=max_new_tokens, pad_token_id=0, return_dict_in_generate=True,
                                    output_logits=True)
            tokens = out.sequences[0, len(prompt):].tolist()
            return tokens, [torch.log_softmax(lg[0].double(), -1)[t].item() for lg, t in zip(out.logits, tokens)]

        if adapter is None:
            with self.ref.disable_adapter():
                return run()
        self.ref.set_adapter(adapter)
        return run()

    def engine(self, **config) -> Engine:
        tuning = {k: config.pop(k) for k in ("mixed_graphs", "prefill_attention") if k in config}
        defaults = dict(num_pages=160, page_size=4, max_num_seqs=8, max_num_batched_tokens=16,
                        prefix_caching=True, enable_chunked_prefill=True)
        engine = Engine(self.config, self.params, None,
                        EngineConfig(**{**defaults, **config}, tuning=EngineTuning(**tuning)),
                        eos_token_ids=self.eos)
        for name, path in self.dirs.items():  # the engine's PEFT loading path
            engine.add_adapter(name, path)
        return engine


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    return _Family(request.param, tmp_path_factory.mktemp(request.param))


def _generate(engine, cases, max_new=MAX_NEW, logprobs=False):
    sp = SamplingParams(max_new_tokens=max_new, temperature=0.0, logprobs=1 if logprobs else None)
    results = engine.generate([GenerationRequest(prompt_token_ids=p, adapter=a, sampling=sp) for p, a in cases])
    tokens = [list(r.token_ids) for r in results]
    return (tokens, [list(r.logprobs) for r in results]) if logprobs else tokens


def _assert_equal_to_hf(family, got):
    tokens, logprobs = got
    assert tokens == list(family.expected)
    for lp, ref in zip(logprobs, family.expected_logprobs):
        assert lp == pytest.approx(ref, abs=1e-4)


def test_greedy_batch_equals_hf_peft_with_prefix_caching_and_chunked_prefill(family):
    engine = family.engine()
    try:
        _assert_equal_to_hf(family, _generate(engine, CASES, logprobs=True))
        hits = engine.stats()["prefix_cache_hits_total"]
        # again: every prompt's full pages are cached now, so prefills start mid-prompt
        _assert_equal_to_hf(family, _generate(engine, CASES, logprobs=True))
        assert engine.stats()["prefix_cache_hits_total"] > hits
    finally:
        engine.close()
    # the adapters matter: one prompt decodes differently under each
    prompt = CASES[1][0]
    outs = {a: tuple(family.generate(prompt, a, MAX_NEW)[0]) for a in (None, *family.dirs)}
    assert len(set(outs.values())) == len(outs)


def test_padded_mixed_step_pieces_equal_hf_peft(family):
    """The pieces a GPU captures around attention (decode rows first, token buckets), run eagerly."""
    engine = family.engine(mixed_graphs="eager", prefix_caching=False)
    try:
        assert _generate(engine, CASES[:5]) == list(family.expected[:5])
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "phi3"], indirect=True)
def test_triton_kernels_equal_hf_peft(family):
    """Norms (``1 + w`` included), LoRA gathers and segments, RoPE + KV write and paged attention
    in Triton (the interpreter, fp32), with the family's pieces around them: Gemma 2's soft-capped
    paged attention; Gemma 3's q/k norms, GELU-tanh, local RoPE and windows; Phi-3's fused
    checkpoint projections and their LoRA."""
    engine = family.engine(backend="triton", prefill_attention="paged", enable_chunked_prefill=False,
                           max_num_batched_tokens=64)
    try:
        got = _generate(engine, CASES[1:5], max_new=3)
    finally:
        engine.close()
    assert got == [e[:3] for e in family.expected[1:5]]


@pytest.mark.parametrize("window", [None, 4])
def test_paged_attention_soft_caps_as_training_attention_does(window):
    """Gemma 2's logit soft-cap in the paged decode and prefill attention (references and Triton
    kernels) equals training's varlen attention over the same sequence."""
    from lightning_lorafusion.kernels.paged_attention import (_paged_decode_attention_triton, paged_decode_attention,
                                                              write_kv)
    from lightning_lorafusion.kernels.paged_prefill import paged_prefill_attention
    from lightning_lorafusion.model.attention import sdpa_varlen_loop

    g = torch.Generator().manual_seed(0)
    n, hq, hkv, d, page, cap = 11, 4, 2, 8, 4, 1.5
    q, k, v = (torch.randn(n, h, d, generator=g) * 2 for h in (hq, hkv, hkv))
    pool = torch.zeros(6, 1, 2, page, hkv, d)
    pages = torch.tensor([4, 1, 5])
    write_kv(pool, 0, k, v, pages[torch.arange(n) // page], torch.arange(n) % page)
    expected = sdpa_varlen_loop(q, k, v, torch.tensor([0, n]), scale=0.3, sliding_window=window, softcap=cap)
    start = 6  # the prefill of rows 6.. over a cached prefix
    prefill = paged_prefill_attention(q[start:], pool, 0, torch.tensor([0, n - start], dtype=torch.int32),
                                      torch.tensor([start], dtype=torch.int32), pages[None].int(), scale=0.3,
                                      sliding_window=window, softcap=cap, backend="torch")
    decode = paged_decode_attention(q[-1:], pool, 0, pages[None].int(), torch.tensor([n], dtype=torch.int32),
                                    scale=0.3, sliding_window=window, softcap=cap, backend="torch")
    torch.testing.assert_close(prefill, expected[start:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(decode, expected[-1:], rtol=1e-5, atol=1e-5)
    uncapped = paged_decode_attention(q[-1:], pool, 0, pages[None].int(), torch.tensor([n], dtype=torch.int32),
                                      scale=0.3, sliding_window=window, backend="torch")
    assert (uncapped - decode).abs().max() > 1e-2  # the cap bends these scores
    # the Triton kernels (interpreter, fp32) soft-cap the same way
    for splits in (1, 2):  # one program per row, and the flash-decoding split + combine
        got = _paged_decode_attention_triton(q[-1:], pool, 0, pages[None].int(), torch.tensor([n], dtype=torch.int32),
                                             0.3, window, softcap=cap, splits=splits)
        torch.testing.assert_close(got, decode, rtol=1e-5, atol=1e-5)
    got = paged_prefill_attention(q[start:], pool, 0, torch.tensor([0, n - start], dtype=torch.int32),
                                  torch.tensor([start], dtype=torch.int32), pages[None].int(), scale=0.3,
                                  sliding_window=window, softcap=cap, backend="triton")
    torch.testing.assert_close(got, prefill, rtol=1e-5, atol=1e-5)


# Partial rotary + LongRoPE (Phi-4-mini's RoPE; 32-token pretraining context): prompts longer
# than it take the long factors from their first step (chunked prefill included: the choice is
# by the request's length, not the chunk's), prompts that stay within it keep the short ones.
# Two long and two short prompts share prefixes (prefix caching reuses pages of the same kind).
# A request crossing the switch mid-decode is not here: HF recomputes its whole cache with the
# long factors at that point, the engine keeps the keys it wrote (docs/model.md, "RoPE scaling").
def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 101, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


LONGROPE_CASES = [
    (_prompt(1, 37), "all4"),
    (_prompt(1, 40)[:36] + _prompt(2, 5), "attn2"),
    (_prompt(3, 12), None),
    (_prompt(4, 45), TRAINED),
    (_prompt(3, 12)[:8] + _prompt(5, 6), "mlp6"),
    (_prompt(6, 21), "all4"),
    (_prompt(7, 34), None),
]


@pytest.fixture(scope="module")
def longrope(tmp_path_factory):
    return _Family("phi3_partial_longrope", tmp_path_factory.mktemp("longrope"), cases=LONGROPE_CASES)


def test_partial_rotary_longrope_greedy_equals_hf_peft(longrope):
    assert longrope.config.rotary_dim < longrope.config.head_dim and longrope.config.rope_type == "longrope"
    assert {len(p) + MAX_NEW > 32 for p, _ in LONGROPE_CASES} == {True, False}
    engine = longrope.engine()
    try:
        _assert_equal_to_hf(longrope, _generate(engine, LONGROPE_CASES, logprobs=True))
        hits = engine.stats()["prefix_cache_hits_total"]
        _assert_equal_to_hf(longrope, _generate(engine, LONGROPE_CASES, logprobs=True))
        assert engine.stats()["prefix_cache_hits_total"] > hits
    finally:
        engine.close()
    engine = longrope.engine(mixed_graphs="eager", prefix_caching=False)  # the pieces a GPU captures
    try:
        assert _generate(engine, LONGROPE_CASES) == list(longrope.expected)
    finally:
        engine.close()


def test_longrope_prefix_pages_are_never_shared_between_short_and_long_factors(longrope):
    """A prompt within the 32-token switch caches pages written with the short factors; a longer
    prompt over the same tokens runs on the long ones, so it must not reuse them (nor may a
    short request reuse a long one's), while requests on the same side still share."""
    short = _prompt(8, 24)
    long = short + _prompt(9, 14)
    engine = longrope.engine()
    try:
        _generate(engine, [(short, None)], max_new=2)
        hits = engine.stats()["prefix_cache_hits_total"]
        got_long = _generate(engine, [(long, None)], max_new=4)
        assert engine.stats()["prefix_cache_hits_total"] == hits  # the short pages are not its prefix
        got_short = _generate(engine, [(short + [7], None)], max_new=2)  # 25 tokens: short again
        assert engine.stats()["prefix_cache_hits_total"] == hits + 1
        _generate(engine, [(long + [7], None)], max_new=2)  # long again: reuses the long pages
        assert engine.stats()["prefix_cache_hits_total"] == hits + 2
    finally:
        engine.close()
    engine = longrope.engine(prefix_caching=False)
    try:
        assert _generate(engine, [(long, None)], max_new=4) == got_long
        assert _generate(engine, [(short + [7], None)], max_new=2) == got_short
    finally:
        engine.close()


@pytest.mark.slow
def test_partial_rotary_longrope_triton_kernels_equal_hf_peft(longrope):
    """The RoPE + KV write kernels (interpreter, fp32) rotating 12 of 16 dims, long and short rows."""
    engine = longrope.engine(backend="triton", prefill_attention="paged", enable_chunked_prefill=False,
                             max_num_batched_tokens=64)
    try:
        got = _generate(engine, LONGROPE_CASES[:4], max_new=3)
    finally:
        engine.close()
    assert got == [e[:3] for e in longrope.expected[:4]]


def test_local_rope_table_is_built_once_per_step(monkeypatch):
    """Gemma 3 (two sliding layers of three): each forward builds one global and one local
    RoPE table, however many sliding layers read them."""
    from lightning_lorafusion.serving import paged_forward

    config, params = params_from_hf_model(tiny_hf_model("gemma3_text", seed=1))
    assert sum(config.local_rope(i) for i in range(config.num_layers)) == 2
    builds, forwards = [], []
    build, embed = paged_forward.rope_cos_sin, paged_forward.embed_rows
    monkeypatch.setattr(paged_forward, "rope_cos_sin", lambda *a, **k: builds.append(k.get("local")) or build(*a, **k))
    monkeypatch.setattr(paged_forward, "embed_rows", lambda *a, **k: forwards.append(1) or embed(*a, **k))
    engine = Engine(config, params, None, EngineConfig(num_pages=64, page_size=4, max_num_seqs=4))
    try:
        _generate(engine, [(p, None) for p, _ in CASES[:3]], max_new=3)
    finally:
        engine.close()
    assert forwards and len(builds) == 2 * len(forwards)
    assert builds.count(True) == len(forwards)


# prompts within the 32-token switch whose greedy continuation grows past it while decoding
CROSSING_CASES = [
    (_prompt(10, 27), "all4"),
    (_prompt(11, 30), None),
    (_prompt(12, 25), TRAINED),
    (_prompt(3, 12), "mlp6"),  # stays short throughout
]


@pytest.fixture(scope="module")
def crossing(tmp_path_factory):
    return _Family("phi3_partial_longrope", tmp_path_factory.mktemp("crossing"), cases=CROSSING_CASES)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_longrope_request_crossing_the_switch_mid_decode_is_recomputed_like_hf(crossing, prefix_caching):
    """HF's Phi-3 recomputes the whole cache on the long factors at the token that takes a
    sequence past ``original_max_position_embeddings``; the engine re-prefills the request
    there (its pages on the short factors given back), so tokens and log-probs stay HF's."""
    assert all(len(p) <= 32 < len(p) + MAX_NEW for p, _ in CROSSING_CASES[:3])
    engine = crossing.engine(prefix_caching=prefix_caching)
    try:
        _assert_equal_to_hf(crossing, _generate(engine, CROSSING_CASES, logprobs=True))
        assert engine.stats()["rope_recomputes_total"] == 3
        assert engine.stats()["preemptions_total"] == 0  # not counted as preemptions for pages
        # the same prompts again: short prefixes are reused, and the recomputed requests still agree
        _assert_equal_to_hf(crossing, _generate(engine, CROSSING_CASES, logprobs=True))
        assert engine.stats()["rope_recomputes_total"] == 6
    finally:
        engine.close()
