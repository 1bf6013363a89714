"""``dtype="auto"`` on CPU: the flag check and the measured choice (engine/cpu_dtype.py),
with given flags, cpuinfo files and timings; nothing here measures this machine."""
from kvserve.engine.config import resolve_dtype
from kvserve.engine.cpu_dtype import choose_cpu_dtype, pick_cpu_dtype, read_cpu_flags

AVX2_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu sse2 avx fma avx2 bmi2
processor\t: 1
flags\t\t: fpu sse2 avx fma avx2 bmi2
"""
AMX_FLAGS = {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}


def no_measure(dtype_name):
    raise AssertionError("measured without native bf16")


def test_reads_the_first_cpus_flags(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(AVX2_CPUINFO)
    assert read_cpu_flags(str(path)) == {"fpu", "sse2", "avx", "fma", "avx2", "bmi2"}
    assert read_cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_without_native_bf16_fp32_and_nothing_measured(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(AVX2_CPUINFO)
    dtype, reason = choose_cpu_dtype(read_cpu_flags(str(path)), no_measure)
    assert dtype == "float32"
    assert reason == "auto: fp32 — this CPU (avx2, no avx512_bf16/amx_bf16) would emulate bf16"
    assert choose_cpu_dtype({"avx512f", "avx2"}, no_measure)[1].startswith("auto: fp32 — this CPU (avx512f,")
    assert choose_cpu_dtype(set(), no_measure)[0] == "float32"
    assert pick_cpu_dtype(str(path))[0] == "float32"                 # the picker reads the given file


def test_with_native_bf16_the_faster_wins():
    timings = {"float32": 80.0, "bfloat16": 400.0}
    dtype, reason = choose_cpu_dtype(AMX_FLAGS, timings.__getitem__)
    assert dtype == "bfloat16"
    assert "bf16 400.0 vs fp32 80.0 GFLOP/s" in reason and "avx512_bf16, amx_bf16" in reason
    slow = {"float32": 80.0, "bfloat16": 60.0}
    dtype, reason = choose_cpu_dtype({"avx512_bf16"}, slow.__getitem__)
    assert dtype == "float32" and "bf16 60.0 vs fp32 80.0 GFLOP/s" in reason
    assert choose_cpu_dtype({"amx_bf16"}, lambda name: 50.0)[0] == "float32"   # a tie keeps fp32


def test_resolve_dtype_uses_the_picker_only_for_auto_on_cpu():
    picker = lambda: ("bfloat16", "measured")                        # noqa: E731
    assert resolve_dtype("auto", "cpu", picker) == ("bfloat16", "measured")
    assert resolve_dtype("float32", "cpu", picker) == ("float32", "as configured")
    assert resolve_dtype("auto", "cuda", picker)[0] == "bfloat16"
