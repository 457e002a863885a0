"""benchmarks/build_llamacpp.py names the CPU's instruction sets to llama.cpp's CMake and never turns AMX on."""
from benchmarks.build_llamacpp import cpu_isa

AMX_XEON = ("flags\t\t: fpu sse4_2 avx avx2 bmi2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16 "
            "avx512vbmi avx_vnni amx_bf16 amx_tile amx_int8")
AVX2_EPYC = "flags\t\t: fpu sse4_2 avx avx2 bmi2 fma f16c"


def options(cpuinfo: str) -> dict[str, str]:
    return dict(o.removeprefix("-D").split("=") for o in cpu_isa(cpuinfo).cmake_options())


def test_amx_cpu_gets_its_avx512_build_without_amx():
    isa = cpu_isa(AMX_XEON)
    got = options(AMX_XEON)
    assert got["GGML_NATIVE"] == "OFF"
    assert all(got[o] == "ON" for o in ("GGML_AVX2", "GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AVX512_BF16",
                                        "GGML_AVX_VNNI", "GGML_AVX512_VBMI"))
    assert all(got[o] == "OFF" for o in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"))
    assert isa.key.startswith("avx512") and isa.key.endswith("amxoff")
    assert "AMX present but left out" in isa.note()


def test_avx2_cpu_gets_no_avx512():
    got = options(AVX2_EPYC)
    assert got["GGML_AVX2"] == got["GGML_FMA"] == got["GGML_F16C"] == "ON"
    assert got["GGML_AVX512"] == got["GGML_AVX_VNNI"] == got["GGML_AVX512_VNNI"] == "OFF"
    assert cpu_isa(AVX2_EPYC).key == "avx2-fma"
