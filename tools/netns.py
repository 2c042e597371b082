"""Two "hosts" on one machine: Linux network namespaces joined by a veth pair (``ip netns``).

    with two_hosts(rate="1gbit") as hosts:
        hosts.run(0, ["python", "-m", "coordinator", ...])      # a process on host 0

Host ``k`` has address ``ADDRS[k]`` on its end of the veth pair and its own loopback; the two
namespaces, the pair and the addresses exist only inside the namespaces (no route, no address or
firewall rule of the machine is touched) and are removed when the block ends. ``rate`` limits each
direction of the link with a token bucket filter (``tc qdisc ... tbf``), as a NIC's line rate
would, so traffic that crosses hosts costs what it costs between real machines. Processes in the
namespaces share the machine's file systems (``/dev/shm`` too) and hostname: give each host's
ranks its own ``RTXNET_HOST``. Used by tests/process/test_multinode.py and
tools/bench/multihost.py. Needs root and iproute2.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

ADDRS = ("10.201.0.1", "10.201.0.2")


class Unavailable(RuntimeError):
    """This machine cannot make the namespaces (not root, no iproute2, no netns support)."""


def ip(*args: str) -> subprocess.CompletedProcess:
    """``ip ARGS`` (iproute2), output captured, 20 s at most."""
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)


@dataclass
class Hosts:
    ns: tuple[str, str]       # namespace names
    veth: tuple[str, str]     # each host's end of the link
    addrs: tuple[str, str] = ADDRS

    def prefix(self, host: int) -> list[str]:
        """The command prefix that runs a program on ``host`` (``ip netns exec NS``; the pid of
        the ``Popen`` is the program's: ``ip`` execs it)."""
        return ["ip", "netns", "exec", self.ns[host]]

    def popen(self, host: int, argv: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen([*self.prefix(host), *argv], **kw)

    def add_addr(self, host: int, addr: str) -> None:
        """Give ``host``'s end of the link a second address ``addr`` (/24, inside its namespace)."""
        r = ip("-n", self.ns[host], "addr", "add", f"{addr}/24", "dev", self.veth[host])
        if r.returncode != 0:
            raise RuntimeError(f"ip addr add {addr}: {r.stderr.strip()}")

    def blackhole(self, host: int, addr: str) -> None:
        """Make ``host`` send what it sends to ``addr`` to a MAC address no interface has (a
        static ARP entry): ``addr`` is unreachable from ``host`` while every other address of
        the other host stays reachable. Ranks bound to a second address of each host (their data
        ports) are so cut from each other while both still reach a coordinator on a first one,
        as hosts behind a firewall on the data ports are."""
        dead = "02:00:00:00:de:" + f"{int(addr.rsplit('.', 1)[1]) % 256:02x}"
        r = ip("-n", self.ns[host], "neigh", "replace", addr, "lladdr", dead, "dev", self.veth[host],
               "nud", "permanent")
        if r.returncode != 0:
            raise RuntimeError(f"ip neigh replace {addr}: {r.stderr.strip()}")

    def unblackhole(self, host: int, addr: str) -> None:
        """Undo :meth:`blackhole`: ``host`` learns ``addr``'s real MAC address again by ARP."""
        r = ip("-n", self.ns[host], "neigh", "del", addr, "dev", self.veth[host])
        if r.returncode != 0:
            raise RuntimeError(f"ip neigh del {addr}: {r.stderr.strip()}")

    def link(self, host: int, up: bool) -> None:
        """Set ``host``'s end of the link up or down (down: a real partition of the two)."""
        r = ip("-n", self.ns[host], "link", "set", self.veth[host], "up" if up else "down")
        if r.returncode != 0:
            raise RuntimeError(f"ip link set {self.veth[host]}: {r.stderr.strip()}")


@contextlib.contextmanager
def two_hosts(rate: str | None = None) -> Iterator[Hosts]:
    """Make the two namespaces for the block (see the module docstring).

    Args:
        rate: ``tc`` rate of each direction of the link (``"1gbit"``), or None for no limit.

    Raises:
        Unavailable: not root, no ``ip``, or the kernel refused a namespace (names why).
        RuntimeError: a later ``ip``/``tc`` step failed (names it).
    """
    if shutil.which("ip") is None or os.geteuid() != 0:
        raise Unavailable("needs root and iproute2 (ip netns) to make two hosts")
    tag = f"{os.getpid()}{time.monotonic_ns() % 10000}"
    hosts = Hosts(ns=(f"rtx{tag}a", f"rtx{tag}b"), veth=(f"rv{tag}"[:13] + "a", f"rv{tag}"[:13] + "b"))
    made = []
    try:
        for n in hosts.ns:
            r = ip("netns", "add", n)
            if r.returncode != 0:
                raise Unavailable(f"cannot create a network namespace: {r.stderr.strip()}")
            made.append(n)
        steps = [("link", "add", hosts.veth[0], "netns", hosts.ns[0], "type", "veth", "peer", "name",
                  hosts.veth[1], "netns", hosts.ns[1])]
        for n, v, a in zip(hosts.ns, hosts.veth, hosts.addrs, strict=True):
            steps += [("-n", n, "addr", "add", f"{a}/24", "dev", v), ("-n", n, "link", "set", v, "up"),
                      ("-n", n, "link", "set", "lo", "up")]
        for st in steps:
            r = ip(*st)
            if r.returncode != 0:
                raise RuntimeError(f"ip {' '.join(st)}: {r.stderr.strip()}")
        if rate is not None:
            for n, v in zip(hosts.ns, hosts.veth, strict=True):
                # burst: at least rate * 1 ms and a few full-size segments (64 KiB GSO packets)
                cmd = ["tc", "-n", n, "qdisc", "add", "dev", v, "root", "tbf", "rate", rate,
                       "burst", "1mb", "latency", "50ms"]
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
                if r.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
        yield hosts
    finally:
        for n in made:
            ip("netns", "del", n)
