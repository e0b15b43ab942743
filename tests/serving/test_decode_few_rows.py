"""The decode LoRA at few rows in the engine: the few-rows blocks (``lora_gather.FEW_ROWS``) and
SwiGLU computing down's shrink (``AHEAD_MAX_ROWS``), with the epilogues' paired rank loops, the
shrink's rank blocks over several programs (``RANK_SPLIT_MAX_ROWS``), the unsplit rank variant
of steps whose ranks are all small (``UNSPLIT_MAX_RANK``) and the first rank chunk of B^T
loaded ahead of the partials (``PDL``) give the tokens and logprobs of the blocks
used before and of the torch references (Triton interpreter on the CPU, fp32, tiny model with
a base row and adapters of ranks 2-8 on attention only, MLP only and all projections)."""

from __future__ import annotations

import pytest

from lightning_lorafusion.serving import GenerationRequest, SamplingParams

CASES = [([5, 9, 17], None), ([11, 4, 30, 22, 8, 19, 40], "all4"), ([7, 13, 21, 33, 45], "attn2"),
         ([60, 2, 35, 18, 26], "mlp8"), ([8, 16], "mlp8")]


def _run(make_engine, backend: str, cases) -> list:
    sp = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True, logprobs=1)
    engine = make_engine(num_pages=96, page_size=4, backend=backend)
    results = engine.generate([GenerationRequest(prompt_token_ids=p, adapter=a, sampling=sp) for p, a in cases])
    return [(list(r.token_ids), list(r.logprobs)) for r in results]


@pytest.mark.parametrize("cases", [CASES, CASES[3:4]], ids=["five_rows", "one_row"])
def test_few_rows_paths_give_the_tokens_of_before(make_engine, monkeypatch, cases):
    from lightning_lorafusion.kernels import lora_gather

    want = _run(make_engine, "torch", cases)
    runs = {}
    split_of = lora_gather.rank_split
    bounds = []  # the rank bounds the shrinks were launched with
    monkeypatch.setattr(lora_gather, "rank_split", lambda d, r, b=None: bounds.append(b) or split_of(d, r, b))
    for name, few, ahead, pair, split, pdl, unsplit in (("before", None, None, False, None, False, None),
                                                        ("few", 16, None, True, None, False, None),
                                                        ("few_ahead", 16, 16, True, None, False, None),
                                                        ("rank_split", None, None, True, 16, False, None),
                                                        ("unsplit_pdl", None, None, True, 16, True, 16),
                                                        ("pdl", 16, 16, True, 16, True, 16)):
        # (the kernel tests check these bit for bit; each runs through the engine once here: the
        # rows split ranks and PDL at one row, the unsplit variant with PDL at five)
        if name in (("rank_split", "pdl") if len(cases) > 1 else ("unsplit_pdl",)):
            continue
        monkeypatch.setattr(lora_gather, "FEW_ROWS", few)
        monkeypatch.setattr(lora_gather, "AHEAD_MAX_ROWS", ahead)
        monkeypatch.setattr(lora_gather, "PAIR_EPILOGUES", pair)
        monkeypatch.setattr(lora_gather, "RANK_SPLIT_MAX_ROWS", split)
        monkeypatch.setattr(lora_gather, "PDL", pdl)
        monkeypatch.setattr(lora_gather, "UNSPLIT_MAX_RANK", unsplit)
        bounds.clear()
        runs[name] = _run(make_engine, "triton", cases)
        # ranks 2-8 over 2-5 rows: the shrinks of steps the rank split covers take the unsplit
        # variant where it is on (the step's largest rank within it), never where it is off
        assert (16 in bounds) == (name == "unsplit_pdl"), name
    for name, got in runs.items():
        assert [t for t, _ in got] == [t for t, _ in want], name
        assert [lp for _, lps in got for lp in lps] == pytest.approx([lp for _, lps in want for lp in lps],
                                                                     abs=1e-5), name
