"""The reduction kernels compile with NVRTC and assemble with ptxas for sm_80 and sm_90 without
spilling (no device needed), and the bfloat16 rounding routine they carry agrees with ml_dtypes bit
for bit.

The NVRTC tests need CuPy and a working NVRTC, the ptxas tests the CUDA toolkit's nvcc; each is
skipped, with the reason, where it is missing. The rounding tests need only NumPy and ml_dtypes.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import ml_dtypes
import numpy as np
import pytest

from rtxnet.collectives.gpu import kernels
from rtxnet.collectives.reduce_ops import SUPPORTED_DTYPES, ReduceOp, accepted_pairs

from . import hostexec

PAIRS = accepted_pairs()
_VEC_LOAD = re.compile(r"ld\.global\.v[24]\.[a-z]+(32|64)")  # 16 bytes: v4 x 32 bit or v2 x 64


@pytest.fixture(scope="module")
def nvrtc():
    """``cupy.cuda.nvrtc``, or a skip naming why NVRTC cannot compile here."""
    pytest.importorskip("cupy", reason="CuPy is not installed; NVRTC compile tests need it")
    try:
        from cupy.cuda import nvrtc as mod

        prog = mod.createProgram('extern "C" __global__ void k() {}', "probe.cu", [], [])
        mod.compileProgram(prog, ["-arch=compute_80"])
    except Exception as exc:  # noqa: BLE001 - missing libnvrtc surfaces as several error types
        pytest.skip(f"NVRTC cannot compile here: {exc}")
    return mod


def _ptx(nvrtc, src: str, arch: str) -> str:
    prog = nvrtc.createProgram(src, "rtx_reduce.cu", [], [])
    try:
        nvrtc.compileProgram(prog, [f"-arch={arch}", *kernels._COMPILE_OPTIONS])
    except Exception as exc:  # noqa: BLE001 - NVRTCError; show the compiler's log
        pytest.fail(f"NVRTC failed: {exc}\n{nvrtc.getProgramLog(prog)}")
    ptx = nvrtc.getPTX(prog)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


@pytest.mark.timeout(60)
@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
@pytest.mark.parametrize(("name", "op"), PAIRS, ids=[f"{n}-{o.value}" for n, o in PAIRS])
def test_kernel_compiles(nvrtc, name, op, arch):
    dtype = SUPPORTED_DTYPES[name]
    src = kernels.kernel_source(dtype, op)
    assert "#include" not in src
    ptx = _ptx(nvrtc, src, arch)
    assert f".entry {kernels.kernel_name(dtype, op)}(" in ptx
    assert _VEC_LOAD.search(ptx), "the vector path lost its 16-byte loads"
    assert "__local_depot" not in ptx, "per-thread arrays went to local memory"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("max_srcs", kernels.SRC_BUCKETS)
def test_every_source_bucket_compiles(nvrtc, max_srcs):
    for name, op in [("bfloat16", ReduceOp.AVG), ("float32", ReduceOp.MAX), ("bool", ReduceOp.SUM),
                     ("int64", ReduceOp.PROD)]:
        dtype = SUPPORTED_DTYPES[name]
        ptx = _ptx(nvrtc, kernels.kernel_source(dtype, op, max_srcs), "compute_90")
        assert f".entry {kernels.kernel_name(dtype, op, max_srcs)}(" in ptx
        assert _VEC_LOAD.search(ptx)


_PTXAS_FN = re.compile(r"Function properties for (\w+)\n\s*(\d+) bytes stack frame, (\d+) bytes "
                       r"spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Compiling entry function '(\w+)'.*?\n.*?Used (\d+) registers", re.S)
# kernel: bytes (stored + loaded) ptxas of CUDA 13.0 spills for sm_90; a few, left as they are
_SPILL_ALLOWED = {"rtx_reduce_float64_avg_s8": 32}


@pytest.mark.timeout(240)
# sm_90: the bucket with the one allowed spill and the one with the most registers (2 and 4
# need fewer: ptxas spilled nothing there when they were checked, and the suite's time is
# bounded); sm_80: the float16 PTX and the most registers
@pytest.mark.parametrize(("arch", "bucket"), [("sm_90", 8), ("sm_90", 16), ("sm_80", 16)])
def test_every_kernel_assembles_without_spills(tmp_path, arch, bucket):
    """nvcc (NVRTC's front end, then ptxas, as the driver's JIT would) builds every (dtype, op)
    kernel of a source bucket: the inline PTX of float16 is valid for the architecture, the
    launch bound holds (at most 65536 / BLOCK registers a thread) and nothing spills to local
    memory beyond :data:`_SPILL_ALLOWED`."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc (the CUDA toolkit) is not on PATH; ptxas checks need it")
    keys = [(SUPPORTED_DTYPES[n], op, bucket) for n, op in PAIRS]
    cu = tmp_path / "kernels.cu"
    cu.write_text(hostexec.translation_unit(keys, host=False))
    run = subprocess.run([nvcc, "-cubin", f"-arch={arch}", *kernels._COMPILE_OPTIONS, "-Xptxas",
                          "-v", "-o", str(tmp_path / "kernels.cubin"), str(cu)],
                         capture_output=True, text=True, timeout=220)
    assert run.returncode == 0, run.stderr[-4000:]
    names = {kernels.kernel_name(*k) for k in keys}
    spills = {m[1]: int(m[3]) + int(m[4]) for m in _PTXAS_FN.finditer(run.stderr)}
    assert set(spills) == names, run.stderr[-2000:]
    over = {k: b for k, b in spills.items() if b > _SPILL_ALLOWED.get(k, 0)}
    assert not over, f"kernels spilling to local memory (bytes stored + loaded): {over}"
    regs = {m[1]: int(m[2]) for m in _PTXAS_REGS.finditer(run.stderr)}
    assert max(regs.values()) <= 65536 // kernels.BLOCK, regs


@pytest.mark.timeout(10)
def test_kernel_source_rejects_what_reduce_ops_rejects():
    with pytest.raises(ValueError, match="bool"):
        kernels.kernel_source(np.dtype(np.bool_), ReduceOp.PROD)
    with pytest.raises(ValueError, match="floating"):
        kernels.kernel_source(np.dtype(np.int32), ReduceOp.AVG)
    with pytest.raises(ValueError, match="max_srcs"):
        kernels.kernel_source(np.dtype(np.float32), ReduceOp.SUM, 3)


# --- the bfloat16 rounding routine of the kernels (kernels._BF16_ST), in uint32 arithmetic ---

def _bf16_like_kernel(u: np.ndarray) -> np.ndarray:
    """float32 bits -> bfloat16 bits, step for step as the CUDA ``st`` of bfloat16."""
    u = u.astype(np.uint32)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    quiet = ((u >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.where(nan, quiet, rounded).astype(np.uint16)


def _bf16_ml_dtypes(u: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return u.astype(np.uint32).view(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


@pytest.mark.timeout(30)
def test_bf16_rounding_matches_ml_dtypes_near_every_bf16_value():
    high = np.arange(2**16, dtype=np.uint32) << np.uint32(16)
    rng = np.random.default_rng(0)
    lows = [0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF]  # exact, ties (odd and even) and either side
    u = np.concatenate([high | np.uint32(lo) for lo in lows]
                       + [high | rng.integers(0, 2**16, high.size, dtype=np.uint32)])
    got, want = _bf16_like_kernel(u), _bf16_ml_dtypes(u)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(hex(int(u[i])), hex(int(got[i])), hex(int(want[i]))) for i in bad[:5]]


@pytest.mark.timeout(30)
def test_bf16_rounding_matches_ml_dtypes_on_random_floats():
    rng = np.random.default_rng(1)
    special = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 3.4028235e38, -3.4028235e38,
                        1e-45, -1e-45, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8], dtype=np.float32)
    u = np.concatenate([special.view(np.uint32), rng.integers(0, 2**32, 5000, dtype=np.uint32),
                        rng.standard_normal(5000).astype(np.float32).view(np.uint32)])
    np.testing.assert_array_equal(_bf16_like_kernel(u), _bf16_ml_dtypes(u))


@pytest.mark.timeout(10)
def test_bf16_widening_is_a_16_bit_shift():
    b = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    widened = b.view(ml_dtypes.bfloat16).astype(np.float32).view(np.uint32)
    np.testing.assert_array_equal(widened, b.astype(np.uint32) << np.uint32(16))
