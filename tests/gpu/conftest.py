"""GPU tests: marked ``gpu`` and skipped, with the reason, where CuPy or a CUDA device is absent.

``tests/gpu/test_kernels_compile.py`` only needs CuPy and NVRTC (it compiles, does not run), so it
runs on a CPU machine that has them and is skipped elsewhere.
"""

from __future__ import annotations

import pytest

from rtxnet.collectives.gpu import cupy_available

CUDA_OK, CUDA_WHY = cupy_available()


def pytest_collection_modifyitems(config, items):
    if CUDA_OK:
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA device: {CUDA_WHY}")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
