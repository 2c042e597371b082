"""rtxnet.topology without a GPU: host identity, the NVML-absent path, NVML and CuPy faked."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import types

import procs
import pytest

from rtxnet import cli, topology
from rtxnet.topology import (
    format_uuid,
    gpu_identity,
    host_id,
    local_topology,
    normalize_pci_bus_id,
    render_topology,
)
from transport.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UUID0 = "GPU-0123abcd-4567-89ab-cdef-0123456789ab"


def test_host_id_is_the_hostname_unless_rtxnet_host_overrides_it(monkeypatch):
    monkeypatch.delenv("RTXNET_HOST", raising=False)
    assert host_id() == socket.gethostname()
    monkeypatch.setenv("RTXNET_HOST", "  ")
    assert host_id() == socket.gethostname()
    monkeypatch.setenv("RTXNET_HOST", "sim-host-1")
    assert host_id() == "sim-host-1"
    assert local_topology()["host"] == "sim-host-1"


@pytest.mark.parametrize("text, want", [
    ("00000000:1B:00.0", "0000:1b:00.0"),       # NVML
    ("0000:1B:00.0", "0000:1b:00.0"),           # CUDA
    ("1b:00.0", "0000:1b:00.0"),                # no domain
    (b"00000001:C3:1F.7\x00", "0001:c3:1f.7"),  # bytes, NUL-terminated
])
def test_pci_bus_ids_take_one_form(text, want):
    assert normalize_pci_bus_id(text) == want


@pytest.mark.parametrize("bad", ["", "GPU-0", "0000:1b:00", "0000:1b:00.8", "zz:00.0"])
def test_a_malformed_pci_bus_id_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="not a PCI bus id"):
        normalize_pci_bus_id(bad)


def test_uuid_bytes_are_written_as_nvml_does():
    assert format_uuid(bytes.fromhex("0123abcd456789abcdef0123456789ab")) == UUID0
    assert format_uuid(UUID0) == UUID0
    assert format_uuid(UUID0.encode()) == UUID0
    with pytest.raises(ValueError, match="16 bytes"):
        format_uuid(b"\x01\x02")


def test_without_pynvml_the_topology_says_why_and_lists_no_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)   # import pynvml -> ImportError
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    topo = local_topology()
    assert topo["gpus"] == []
    assert topo["gpu_source"].startswith("none: pynvml is not importable")
    assert "nvidia-ml-py" in topo["gpu_source"]
    assert topo["cuda_visible_devices"] == "1,0"
    assert topo["cpus"] >= 1
    json.dumps(topo)                                    # plain values: publishable at join
    assert "none: pynvml is not importable" in render_topology(topo)


def _fake_nvml(*, init_error: Exception | None = None, broken_index: int | None = None):
    """A pynvml stand-in with two GPUs; records init/shutdown calls."""
    m = types.ModuleType("pynvml")
    m.calls = []

    class NVMLError(Exception):
        pass

    def init():
        m.calls.append("init")
        if init_error is not None:
            raise init_error

    def handle(i):
        if i == broken_index:
            raise NVMLError("GPU is lost")
        return i

    m.nvmlInit = init
    m.nvmlShutdown = lambda: m.calls.append("shutdown")
    m.nvmlSystemGetDriverVersion = lambda: b"580.159.04"
    m.nvmlDeviceGetCount = lambda: 2
    m.nvmlDeviceGetHandleByIndex = handle
    m.nvmlDeviceGetUUID = lambda h: [UUID0, b"GPU-ffffffff-0000-0000-0000-000000000001"][h]
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(
        busId=["00000000:1B:00.0", b"00000000:2C:00.0"][h])
    m.nvmlDeviceGetName = lambda h: [b"NVIDIA H200", "NVIDIA H200"][h]
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=150754820096)
    return m


def test_nvml_gpus_are_listed_with_uuid_pci_name_and_memory(monkeypatch):
    fake = _fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    topo = local_topology()
    assert topo["gpu_source"] == "nvml" and topo["driver_version"] == "580.159.04"
    assert topo["gpus"] == [
        {"index": 0, "uuid": UUID0, "pci_bus_id": "0000:1b:00.0", "name": "NVIDIA H200",
         "memory_bytes": 150754820096},
        {"index": 1, "uuid": "GPU-ffffffff-0000-0000-0000-000000000001",
         "pci_bus_id": "0000:2c:00.0", "name": "NVIDIA H200", "memory_bytes": 150754820096},
    ]
    assert fake.calls == ["init", "shutdown"]
    table = render_topology(topo)
    assert "2 GPU(s) from NVML, driver 580.159.04" in table
    assert "0000:2c:00.0" in table and UUID0 in table and "140.4 GiB" in table


def test_a_gpu_nvml_cannot_describe_is_listed_with_the_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(broken_index=1))
    topo = local_topology()
    assert topo["gpu_source"] == "nvml"
    assert topo["gpus"][0]["uuid"] == UUID0
    bad = topo["gpus"][1]
    assert bad["index"] == 1 and bad["uuid"] is None and "GPU is lost" in bad["error"]
    assert "(error: NVMLError: GPU is lost)" in render_topology(topo)


def test_nvml_that_does_not_initialise_is_reported_not_raised(monkeypatch):
    fake = _fake_nvml(init_error=OSError("NVML Shared Library Not Found"))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    topo = local_topology()
    assert topo["gpus"] == []
    assert topo["gpu_source"] == ("none: NVML did not initialise "
                                  "(OSError: NVML Shared Library Not Found)")
    assert "shutdown" not in fake.calls


def _fake_cupy(*, count=1, uuid=b"\x01\x23\xab\xcd\x45\x67\x89\xab\xcd\xef\x01\x23\x45\x67\x89\xab"):
    m = types.ModuleType("cupy")
    props = {} if uuid is None else {"uuid": uuid}
    runtime = types.SimpleNamespace(getDeviceCount=lambda: count,
                                    getDeviceProperties=lambda d: dict(props))
    m.cuda = types.SimpleNamespace(
        runtime=runtime,
        Device=lambda d: types.SimpleNamespace(pci_bus_id="0000:1B:00.0"))
    return m


def test_gpu_identity_from_cuda_properties(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert gpu_identity(0) == {"uuid": UUID0, "pci_bus_id": "0000:1b:00.0"}


def test_gpu_identity_falls_back_to_nvml_by_pci_bus_id(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(uuid=None))
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml())
    assert gpu_identity(0) == {"uuid": UUID0, "pci_bus_id": "0000:1b:00.0"}
    # Neither source knows it: None, not an error.
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert gpu_identity(0) == {"uuid": None, "pci_bus_id": "0000:1b:00.0"}


def test_gpu_identity_refuses_a_device_out_of_range_naming_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(count=1))
    with pytest.raises(ConfigError, match=r"device\(1\) .*device count 1"):
        gpu_identity(1)
    with pytest.raises(ConfigError, match=r"device\(-1\)"):
        gpu_identity(-1)


def test_gpu_identity_without_cupy_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(ConfigError, match=r"needs CuPy.*rtxnet\[gpu\]"):
        gpu_identity(0)


def test_cli_topology_prints_json_and_a_table(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml())
    monkeypatch.setenv("RTXNET_HOST", "sim-host-2")
    assert cli.main(["topology", "--json"]) == 0
    topo = json.loads(capsys.readouterr().out)
    assert topo["host"] == "sim-host-2" and len(topo["gpus"]) == 2
    assert cli.main(["topology"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("host sim-host-2, ") and "0000:1b:00.0" in out


def test_local_topology_never_imports_cupy():
    code = ("import sys, rtxnet.topology as t; t.local_topology(); "
            "assert 'cupy' not in sys.modules, 'cupy imported'; print('ok')")
    env = procs.env()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                       env=env, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_the_module_exports_are_pinned():
    assert sorted(topology.__all__) == sorted([
        "host_id", "local_topology", "gpu_identity", "normalize_pci_bus_id", "format_uuid",
        "render_topology"])
