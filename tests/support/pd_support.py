"""PD disaggregation on the CPU: a prefill server, a decode server and SGLang's router, inside a
network namespace of the test's own.

SGLang 0.5.23 moves the KV with Mooncake's transfer engine forced to TCP
(`--disaggregation-transfer-backend mooncake_tcp`). On the CPU it takes: the tests-only
plugin of `cpu_pd_shim/` (the sender's host-index path), `--disable-radix-cache
--disable-overlap-schedule` on prefill (with overlap, a prefix already computed, by a radix
hit or an earlier chunk, records a `torch.cuda.Event` in `maybe_send_cached_prefix_chunk`),
`--disaggregation-decode-retraction-backup cpu_tensor` on decode (the default builds a pinned
host pool through `torch.cuda.cudart()`) and `SGLANG_HOST_IP=127.0.0.1` (else Mooncake
advertises the host's own address). Mooncake and the `--nccl-port` store still listen on all
interfaces: the servers run in a network namespace with only the loopback up, which the
calling thread enters (`own_network_namespace`) and every process it starts inherits.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, Optional

from engram_sglang.serving.launch import Server, free_port

PD_SHIM_DIR = Path(__file__).resolve().parent / "cpu_pd_shim"
CLONE_NEWNET = 0x40000000
BACKEND = "mooncake_tcp"


class NoNamespace(Exception):
    """The kernel or this process's permissions give no network namespace (the test skips)."""


@contextlib.contextmanager
def own_network_namespace() -> Iterator[None]:
    """The calling thread in a new network namespace with only `lo` up, until the block ends
    (then back in its own): what it starts (processes, threads) stays in it. The namespace
    goes when its last process does, so nothing is left to remove."""
    if shutil.which("ip") is None:
        raise NoNamespace("iproute2's `ip` is not installed (apt-get install iproute2)")
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)
    try:
        if libc.unshare(CLONE_NEWNET) != 0:
            raise NoNamespace(f"unshare(CLONE_NEWNET) failed: {os.strerror(ctypes.get_errno())}")
        try:
            subprocess.run(["ip", "link", "set", "lo", "up"], check=True, capture_output=True, timeout=30)
            yield
        finally:
            if libc.setns(home, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to the test's own network namespace failed")
    finally:
        os.close(home)


def pd_server(model_dir, role: str, *, engram: dict, log_path: Path, bootstrap_port: Optional[int] = None,
              args: tuple = (), max_total_tokens: int = 4096) -> Server:
    """One side of a PD pair (`role` prefill or decode) with the CPU's flags (module docstring)."""
    extra = ["--disaggregation-mode", role, "--disaggregation-transfer-backend", BACKEND]
    if role == "prefill":
        extra += ["--disaggregation-bootstrap-port", str(bootstrap_port), "--disable-radix-cache",
                  "--disable-overlap-schedule"]
    else:
        extra += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
    server = Server(model_dir, engram=engram, args=tuple(extra) + tuple(args), log_path=log_path,
                    max_total_tokens=max_total_tokens)
    server.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PD_SHIM_DIR), server.env.get("PYTHONPATH")]))
    server.env["SGLANG_HOST_IP"] = "127.0.0.1"
    return server


class Router:
    """`python -m sglang_router.launch_router --pd-disaggregation --mini-lb` over one pair."""

    def __init__(self, prefill: Server, bootstrap_port: int, decode: Server, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--mini-lb",
                    "--host", "127.0.0.1", "--port", str(self.port),
                    "--prefill", prefill.url, str(bootstrap_port), "--decode", decode.url]
        self.proc: Optional[subprocess.Popen] = None

    def start(self, timeout: float = 120) -> "Router":
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the router exited: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return self
            except urllib.error.HTTPError:
                return self  # it answers
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"the router did not answer in {timeout:.0f} s (log: {self.log_path})")

    def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(timeout=10)
            self.proc = None

    def post(self, path: str, body: dict, timeout: float = 300) -> dict:
        return Server.post(self, path, body, timeout)  # the same JSON POST as a server's
