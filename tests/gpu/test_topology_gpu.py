"""rtxnet.topology on a GPU host: CUDA's view of a device matches NVML's."""

from __future__ import annotations

import pytest

from rtxnet.topology import gpu_identity, local_topology

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(60)]


def test_gpu_identity_of_device_0_is_one_of_the_gpus_nvml_lists():
    topo = local_topology()
    ident = gpu_identity(0)
    assert ident["pci_bus_id"] and ident["uuid"], ident
    assert ident["uuid"].startswith(("GPU-", "MIG-")), ident
    if topo["gpu_source"] != "nvml":
        pytest.skip(f"NVML unavailable: {topo['gpu_source']}")
    by_pci = {g["pci_bus_id"]: g for g in topo["gpus"]}
    assert ident["pci_bus_id"] in by_pci, (ident, topo)
    assert by_pci[ident["pci_bus_id"]]["uuid"] == ident["uuid"], (ident, topo)
    assert by_pci[ident["pci_bus_id"]]["memory_bytes"] > 0
