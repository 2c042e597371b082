"""What this machine is: host identity, CPUs and GPUs.

The agent publishes :func:`host_id` at join; the GPU collectives choose between CUDA IPC (ranks
on one host) and NCCL (across hosts) from it, and tell ranks that share one GPU apart from ranks
on different GPUs by :func:`gpu_identity` (the GPU's UUID and PCI bus id).

- :func:`host_id`: the host identity ranks compare. ``RTXNET_HOST`` overrides the hostname: set it
  when containers on different machines share a hostname, or to make ranks on one machine behave
  as if they were on several hosts (tests do this).
- :func:`local_topology`: CPUs and every GPU the driver knows, through NVML (``nvidia-ml-py``,
  imported as ``pynvml``), never CuPy: it does not create a CUDA context, so it is cheap and safe
  before a fork. It never raises; whatever went wrong is told in ``gpu_source``.
- :func:`gpu_identity`: UUID and PCI bus id of CUDA device ``device`` *as this process numbers
  it* (``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` apply), through CuPy.

PCI bus ids are given in one form everywhere, the Linux sysfs one: ``dddd:bb:dd.f`` in lower-case
hex (``0000:1b:00.0``); NVML writes ``00000000:1B:00.0`` and CUDA ``0000:1B:00.0``.
:func:`normalize_pci_bus_id` converts either. UUIDs are NVML's strings (``GPU-`` and 32 hex digits
in groups 8-4-4-4-12).
"""

from __future__ import annotations

import os
import re
import socket
from typing import Any

from transport import wire
from transport.errors import ConfigError

__all__ = ["host_id", "local_topology", "gpu_identity", "normalize_pci_bus_id", "format_uuid",
           "render_topology"]

_PCI_RE = re.compile(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")


MAX_HOST_BYTES = wire.MAX_HOST_BYTES   # 128; the coordinator refuses a join with a longer one


def host_id() -> str:
    """The identity of this host as ranks compare it.

    ``RTXNET_HOST`` when set and not empty (for containers on different machines that share a
    hostname, and for tests that simulate several hosts on one machine), else
    ``socket.gethostname()``.

    Raises:
        ConfigError: the name is longer than ``MAX_HOST_BYTES`` bytes (UTF-8).
    """
    override = os.environ.get("RTXNET_HOST", "").strip()
    host = override or socket.gethostname()
    if len(host.encode()) > MAX_HOST_BYTES:
        raise ConfigError(f"RTXNET_HOST/hostname {host[:40]!r}... is {len(host.encode())} bytes; "
                          f"at most {MAX_HOST_BYTES} (it is part of the rank's ZeroMQ identity)")
    return host


def gone_from_this_host(proc: dict) -> bool:
    """Whether ``proc`` (``{"host", "pid"}``, as the coordinator lists processes) is a process
    of this host (``host_id()``) that has exited: no such pid, or a zombie (read from
    ``/proc`` where there is one, else ``os.kill(pid, 0)``). False when it runs, when it is
    another host's, or when that cannot be told."""
    try:
        if proc.get("host") != host_id():
            return False
    except ConfigError:   # RTXNET_HOST too long: no host to compare
        return False
    pid = proc.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    if os.path.isdir("/proc/self"):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
            return state in (b"Z", b"X")
        except FileNotFoundError:
            return True
        except (OSError, IndexError):
            pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:   # PermissionError: it runs, as another user
        pass
    return False


def normalize_pci_bus_id(bus_id: str | bytes) -> str:
    """``dddd:bb:dd.f`` in lower-case hex from NVML's or CUDA's form.

    Args:
        bus_id: ``00000000:1B:00.0`` (NVML), ``0000:1B:00.0`` (CUDA) or ``1b:00.0`` (domain 0).

    Raises:
        ValueError: not a PCI bus id (names it).
    """
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode("ascii", "replace")
    m = _PCI_RE.match(bus_id.strip().rstrip("\x00"))
    if m is None:
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    domain, bus, dev, fn = m.groups()
    return f"{int(domain or '0', 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{int(fn, 16):x}"


def format_uuid(raw: bytes | str) -> str:
    """NVML's UUID string (``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``) from the 16 bytes of
    ``cudaDeviceProp.uuid``, or an NVML string (returned as it is, decoded if bytes).

    Raises:
        ValueError: ``raw`` is neither 16 bytes nor a UUID string.
    """
    if isinstance(raw, str):
        return raw
    if len(raw) == 16:
        h = bytes(raw).hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
    text = bytes(raw).decode("ascii", "replace").rstrip("\x00")
    if text.startswith(("GPU-", "MIG-")):
        return text
    raise ValueError(f"a CUDA UUID has 16 bytes, got {len(raw)}: {bytes(raw)!r}")


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))   # what this process may run on (containers, taskset)
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _text(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def _nvml_gpus() -> tuple[list[dict[str, Any]], str, str | None]:
    """``(gpus, source, driver_version)`` from NVML; never raises."""
    try:
        import pynvml
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install
        return [], f"none: pynvml is not importable ({type(exc).__name__}: {exc}); install nvidia-ml-py", None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        return [], f"none: NVML did not initialise ({type(exc).__name__}: {exc})", None
    try:
        try:
            driver = _text(pynvml.nvmlSystemGetDriverVersion())
        except Exception:  # noqa: BLE001 - optional fact
            driver = None
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        except Exception as exc:  # noqa: BLE001
            return [], f"none: NVML could not count GPUs ({type(exc).__name__}: {exc})", driver
        gpus = []
        for i in range(count):
            g: dict[str, Any] = {"index": i, "uuid": None, "pci_bus_id": None, "name": None,
                                 "memory_bytes": None}
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                g["uuid"] = _text(pynvml.nvmlDeviceGetUUID(h))
                g["pci_bus_id"] = normalize_pci_bus_id(_text(pynvml.nvmlDeviceGetPciInfo(h).busId))
                g["name"] = _text(pynvml.nvmlDeviceGetName(h))
                g["memory_bytes"] = int(pynvml.nvmlDeviceGetMemoryInfo(h).total)
            except Exception as exc:  # noqa: BLE001 - one GPU in a bad state: say so, go on
                g["error"] = f"{type(exc).__name__}: {exc}"
            gpus.append(g)
        return gpus, "nvml", driver
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001, S110 - shutting down is best effort
            pass


def local_topology() -> dict[str, Any]:
    """This machine as the agents publish it at join; never raises, never imports CuPy.

    Returns:
        ``{"host": host_id(), "cpus": CPUs this process may run on, "gpus": [...],
        "gpu_source": "nvml" or "none: <why>", "driver_version": str or None,
        "cuda_visible_devices": the variable's value or None}``. Each GPU is
        ``{"index", "uuid", "pci_bus_id", "name", "memory_bytes"}`` (plus ``"error"`` when NVML
        could not describe it; the missing facts are then None). ``index`` is NVML's order (PCI bus
        order), which ignores ``CUDA_VISIBLE_DEVICES`` and may differ from CUDA ordinals: match
        devices by ``uuid`` or ``pci_bus_id`` (see :func:`gpu_identity`).
    """
    try:
        gpus, source, driver = _nvml_gpus()
    except Exception as exc:  # noqa: BLE001 - never raise, whatever NVML does
        gpus, source, driver = [], f"none: {type(exc).__name__}: {exc}", None
    return {
        "host": host_id(),
        "cpus": _cpus(),
        "gpus": gpus,
        "gpu_source": source,
        "driver_version": driver,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def agent_info() -> dict[str, Any]:
    """What an agent publishes at join (``rtxnet status --json`` shows it per member): CPUs,
    the GPUs visible on this host (UUID and PCI bus id, from NVML; empty without it) and
    ``CUDA_VISIBLE_DEVICES``. Never raises for a missing NVML or GPU."""
    t = local_topology()
    return {"cpus": t["cpus"],
            "gpus": [{"uuid": g.get("uuid"), "pci_bus_id": g.get("pci_bus_id")} for g in t["gpus"]],
            "cuda_visible_devices": t["cuda_visible_devices"]}


def _uuid_by_pci(pci_bus_id: str) -> str | None:
    gpus, _, _ = _nvml_gpus()
    for g in gpus:
        if g.get("pci_bus_id") == pci_bus_id and g.get("uuid"):
            return g["uuid"]
    return None


def gpu_identity(device: int) -> dict[str, str | None]:
    """UUID and PCI bus id of CUDA device ``device`` as this process numbers it.

    The PCI bus id comes from CUDA (``cupy.cuda.Device(device).pci_bus_id``), the UUID from
    ``cudaGetDeviceProperties`` (its 16 bytes written as NVML does), or from NVML by PCI bus id
    when the properties lack it. Two ranks use the same physical GPU exactly when their UUIDs (or
    PCI bus ids, on one host) are equal.

    Args:
        device: CUDA ordinal in this process, ``0 <= device < cudaGetDeviceCount()``.

    Returns:
        ``{"uuid": "GPU-..." or None when neither source knows it, "pci_bus_id": "dddd:bb:dd.f"}``.

    Raises:
        ConfigError: CuPy is not importable, there is no usable CUDA driver, or ``device`` is out
            of range (names the value and the count).
    """
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - ImportError or a broken CUDA install
        raise ConfigError(f"gpu_identity({device}) needs CuPy ({exc}); install rtxnet[gpu] "
                          "or rtxnet[cuda13]") from exc
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # noqa: BLE001 - CUDARuntimeError: no driver, no device
        raise ConfigError(f"gpu_identity({device}): no usable CUDA driver ({exc})") from exc
    if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < count:
        raise ConfigError(f"gpu_identity: device({device!r}) is not a CUDA ordinal of this "
                          f"process (device count {count})")
    pci = normalize_pci_bus_id(cupy.cuda.Device(device).pci_bus_id)
    uuid = None
    try:
        raw = cupy.cuda.runtime.getDeviceProperties(device).get("uuid")
        if raw:
            uuid = format_uuid(raw)
    except Exception:  # noqa: BLE001 - older CuPy without the field: ask NVML below
        uuid = None
    if uuid is None:
        uuid = _uuid_by_pci(pci)
    return {"uuid": uuid, "pci_bus_id": pci}


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 30):.1f} GiB"


def render_topology(topo: dict[str, Any]) -> str:
    """The table ``rtxnet topology`` prints for a :func:`local_topology` result."""
    cvd = topo.get("cuda_visible_devices")
    lines = [
        f"host {topo['host']}, {topo['cpus']} CPUs, CUDA_VISIBLE_DEVICES="
        f"{'(unset)' if cvd is None else repr(cvd)}",
    ]
    src = topo["gpu_source"]
    if src == "nvml":
        drv = topo.get("driver_version")
        lines.append(f"{len(topo['gpus'])} GPU(s) from NVML" + (f", driver {drv}" if drv else ""))
    else:
        lines.append(f"GPUs: {src}")
    if topo["gpus"]:
        lines.append(f"  {'index':>5}  {'name':<28} {'memory':>10}  {'pci_bus_id':<12}  uuid")
        for g in topo["gpus"]:
            line = (f"  {g['index']:>5}  {str(g.get('name') or '-'):<28} "
                    f"{_gib(g.get('memory_bytes')):>10}  {str(g.get('pci_bus_id') or '-'):<12}  "
                    f"{g.get('uuid') or '-'}")
            if g.get("error"):
                line += f"  (error: {g['error']})"
            lines.append(line)
    return "\n".join(lines)
