"""Tests only: several hosts on one machine, for the multi-node e2e tests.

Each simulated host is a network namespace on a bridge of its own (a LAN only the test
reaches: the servers' ports, SGLang's `--dist-init-addr` store and gloo listen on nothing
else), and each sees a directory of its own as /dev/shm (a bind mount in a mount namespace
of its server's process), so that every node fills, serves and frees its own shared copy,
as on separate machines. The test sees every host's /dev/shm from outside. Everything is
removed in a `finally`; `leftovers` says what is not.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional


@dataclass(frozen=True)
class Host:
    name: str  # its network namespace
    address: str  # on the test's bridge
    ifname: str  # its interface, inside the namespace (GLOO_SOCKET_IFNAME)
    shm: Path  # what it sees as /dev/shm, seen from here

    def wrap(self) -> list[str]:
        """The command prefix that runs a program on this host: in its network namespace, in a
        mount namespace of its own with `shm` as /dev/shm. Each step execs the next: the
        program keeps the prefix's PID (a Server's process group stays its own)."""
        return ["ip", "netns", "exec", self.name, "unshare", "--mount", "--propagation", "private",
                "sh", "-c", 'mount --bind "$0" /dev/shm && exec "$@"', str(self.shm)]


def unavailable() -> Optional[str]:
    """Why simulated hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network and mount namespaces)"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "simulated hosts need iproute2's ip and util-linux's unshare"
    probe = subprocess.run(["unshare", "--net", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"this kernel or container refuses network/mount namespaces: {probe.stderr.strip()[:200]}"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _prefix() -> str:
    return f"egt{os.getpid() % 100_000}"  # <= 8 characters: interface names end "NNh" (15 at most)


@contextlib.contextmanager
def simulated_hosts(n: int) -> Iterator[list[Host]]:
    """`n` hosts on one bridge, 10.231.S.1 ... 10.231.S.n (S from this process's PID), with
    the bridge itself at .254 (where the test reaches them)."""
    prefix = _prefix()
    subnet = f"10.231.{os.getpid() % 250}"
    bridge = f"{prefix}br"
    shm_root = Path(tempfile.mkdtemp(prefix=f"{prefix}-hosts-", dir="/dev/shm"))
    hosts = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{subnet}.254/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i in range(n):
            host = Host(f"{prefix}n{i}", f"{subnet}.{i + 1}", f"{prefix}{i}n", shm_root / f"host{i}")
            host.shm.mkdir()
            _ip("netns", "add", host.name)
            hosts.append(host)
            outside = f"{prefix}{i}h"
            _ip("link", "add", outside, "type", "veth", "peer", "name", host.ifname)
            _ip("link", "set", host.ifname, "netns", host.name)
            _ip("link", "set", outside, "master", bridge)
            _ip("link", "set", outside, "up")
            _ip("-n", host.name, "addr", "add", f"{host.address}/24", "dev", host.ifname)
            _ip("-n", host.name, "link", "set", host.ifname, "up")
            _ip("-n", host.name, "link", "set", "lo", "up")
        yield hosts
    finally:
        for i, host in enumerate(hosts):
            # The outside end explicitly: a namespace a dying process still holds keeps its end.
            _ip("link", "del", f"{prefix}{i}h", check=False)
            _ip("netns", "del", host.name, check=False)
        _ip("link", "del", bridge, check=False)
        shutil.rmtree(shm_root, ignore_errors=True)


def leftovers() -> list[str]:
    """This process's namespaces, links, mounts and /dev/shm directories still there."""
    prefix = _prefix()
    found = [f"netns {line.split()[0]}" for line in _ip("netns", "list").stdout.splitlines()
             if line.startswith(prefix)]
    found += [f"link {line.split(':')[1].strip()}" for line in _ip("-o", "link").stdout.splitlines()
              if line.split(":")[1].strip().startswith(prefix)]
    found += [f"mount {line.split()[1]}" for line in Path("/proc/mounts").read_text().splitlines()
              if f"/{prefix}" in line]
    found += [f"shm {p}" for p in Path("/dev/shm").glob(f"{prefix}-hosts-*")]
    return found
