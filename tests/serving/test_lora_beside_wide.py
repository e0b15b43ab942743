"""The decode rows' LoRA shrinks beside the frozen GEMMs in every decode step and in mixed steps
(``EngineTuning.decode_lora_beside`` "wide", against "few": decode steps of at most
``lora_gather.BESIDE_MAX_ROWS`` rows): the setting, where the second stream is taken, and on a
GPU the same logits (decode graphs, eager) and the same tokens and logprobs (mixed steps as
captured pieces) as the shrinks in stream order. The kernels' side is
tests/kernels/test_lora_beside.py (the grouped shrink beside, the same bits)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_lorafusion.serving.config import EngineTuning
from lightning_lorafusion.serving.paged_forward import lora_stream
from lightning_lorafusion.specs import ConfigError

from test_pad_mixed import _run


def test_decode_lora_beside_setting(make_engine):
    with pytest.raises(ConfigError, match="decode_lora_beside"):
        EngineTuning(decode_lora_beside="all")
    assert EngineTuning().decode_lora_beside in ("wide", "few")
    engine = make_engine(num_pages=32, page_size=4, decode_lora_beside="few")
    runner = engine.runner
    assert runner.decode_lora_beside == "few" and not runner.model.wide_beside
    runner.decode_lora_beside = "wide"
    assert runner.decode_lora_beside == "wide" and runner.model.wide_beside
    with pytest.raises(ValueError, match="decode_lora_beside"):
        runner.decode_lora_beside = "all"


def test_mixed_steps_take_the_second_stream_only_when_wide():
    decode, mixed = SimpleNamespace(num_prefill_rows=0), SimpleNamespace(num_prefill_rows=5)
    few, wide = SimpleNamespace(lora_stream="s", wide_beside=False), SimpleNamespace(lora_stream="s", wide_beside=True)
    assert lora_stream(few, decode) == lora_stream(wide, decode) == "s"
    assert lora_stream(few, mixed) is None and lora_stream(wide, mixed) == "s"
    assert lora_stream(SimpleNamespace(lora_stream=None, wide_beside=True), mixed) is None  # (CPU: no stream)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a second CUDA stream needs a GPU")
def test_wide_beside_gives_the_tokens_of_few(make_engine):
    """fp32, Triton kernels, mixed steps as CUDA graphs and decode graphs, decode rows of up to 8
    (``BESIDE_MAX_ROWS`` 64: "few" runs every mixed step's shrinks in stream order): the same
    tokens and logprobs, step by step, with the shrinks beside in every step."""
    config = dict(num_pages=128, page_size=4, backend="triton", max_num_batched_tokens=64, max_num_seqs=8,
                  prefix_caching=False, mixed_graphs="on", cuda_graphs="on", async_decode="off")
    got = {}
    for mode in ("few", "wide"):
        engine = make_engine(**config, decode_lora_beside=mode)
        assert engine.runner.model.wide_beside == (mode == "wide")
        got[mode], _ = _run(engine, True)
    assert [(r, t) for r, t, _ in got["few"]] == [(r, t) for r, t, _ in got["wide"]]
    assert [lp for *_, lp in got["few"]] == pytest.approx([lp for *_, lp in got["wide"]], abs=1e-6)
