"""scripts/compile_decode_lora.py: its launches name every constexpr their kernels need (so the
compile report stays in step with the kernels), and it refuses to run under the interpreter."""

import inspect

import pytest

from _script_loader import load_script


def test_every_variant_gives_its_kernel_all_constexprs_without_a_default():
    script = load_script("compile_decode_lora")
    kernels = script.kernels()
    for name, (kernel, pointers, consts) in script.VARIANTS.items():
        params = inspect.signature(kernels[kernel].fn).parameters
        given = set(script.COMMON) | set(consts) | {"HYBRID", "GROUP_N"}
        needed = {n for n, p in params.items() if "constexpr" in str(p.annotation) and p.default is p.empty}
        assert needed and needed <= given, (name, needed - given)
        assert set(consts) <= set(params), (name, set(consts) - set(params))
        assert all(n in params for n in pointers), name


def test_refuses_the_interpreter(monkeypatch):
    script = load_script("compile_decode_lora")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(SystemExit):
        script.main(["--variants", "expand"])
