"""Start and stop a real `sglang.launch_server` (the demo, the tests and bench/serve.py use it).

On a machine without a GPU it adds what SGLang 0.5.23 needs to serve on the CPU
(docs/operations.md, "Serving without a GPU"): SGLANG_USE_CPU_ENGINE=1, `--device cpu
--attention-backend torch_native`, and the pure-torch `sgl_kernel` stand-in
(`cpu_shim/`) first on PYTHONPATH, for that process tree only. The server runs in its own
process group, so stopping it leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional, Sequence

from ..core.errors import EngramError

CPU_SHIM = Path(__file__).resolve().parent / "cpu_shim"
ERROR_MARK = "engram-sglang: error: "  # how every engram-sglang error line begins


def _inductor_cache_dir() -> Optional[str]:
    """Where torch's compile cache goes by default (under the temp dir, which TMPDIR moves);
    None where the user has no name (torch then picks its own)."""
    import getpass

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        return None
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")


class ServerError(EngramError):
    """The server did not start, or died."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


class Server:
    """One `python -m sglang.launch_server` process tree.

    Parameters
    ----------
    model_path : the model directory.
    engram : `--engram-*` flags without the prefix, e.g. {"placement": "disk"}.
    args : further SGLang flags.
    max_total_tokens : bounds the KV cache (SGLang would otherwise take most of the RAM).
    log_path : where the server's output goes (default: a file beside the model).
    host : the address it listens on and is reached at.
    wrap : a command the server runs under (e.g. `ip netns exec NS ...`: it must exec the rest
        in the same process, so that the server's process group is this process's).
    """

    def __init__(self, model_path: str | os.PathLike, *, engram: Optional[dict] = None, args: Sequence[str] = (),
                 max_total_tokens: int = 8192, port: Optional[int] = None, log_path: Optional[str | os.PathLike] = None,
                 env: Optional[dict] = None, host: str = "127.0.0.1", wrap: Sequence[str] = ()):
        self.model_path = str(model_path)
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.log_path = Path(log_path) if log_path else Path(self.model_path).parent / f"sglang-{self.port}.log"
        cmd = [*wrap, sys.executable, "-m", "sglang.launch_server", "--model-path", self.model_path, "--host", host,
               "--port", str(self.port), "--skip-server-warmup", "--max-total-tokens", str(max_total_tokens)]
        self.env = dict(os.environ)
        if not has_gpu():
            # An idle scheduler polls at full speed by default: on a small CPU box that
            # starves everything else (other servers, the client, the tests).
            cmd += ["--device", "cpu", "--attention-backend", "torch_native", "--sleep-on-idle"]
            self.env["SGLANG_USE_CPU_ENGINE"] = "1"
            self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CPU_SHIM), self.env.get("PYTHONPATH")]))
        for key, value in (engram or {}).items():
            cmd += [f"--engram-{key.replace('_', '-')}", str(value)]
        self.cmd = cmd + list(args)
        self.env.update(env or {})
        # SGLang names its ZMQ sockets with tempfile and never removes them (hundreds of 0-byte
        # tmpXXXXXXXX in /tmp after a test run): the server gets a TMPDIR of its own, removed at
        # stop. Torch's compile cache keeps its usual place, shared by every server.
        self._own_tmp = "TMPDIR" not in (env or {})
        if self._own_tmp and _inductor_cache_dir() is not None:
            self.env.setdefault("TORCHINDUCTOR_CACHE_DIR", _inductor_cache_dir())
        self._tmp: Optional[str] = None
        self.proc: Optional[subprocess.Popen] = None
        self._tree: Optional[_TreeRecord] = None

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 300) -> "Server":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        if self._own_tmp:
            self._tmp = self.env["TMPDIR"] = tempfile.mkdtemp(prefix="engram-sglang-server-")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        log.close()
        self._tree = _TreeRecord(self.proc.pid).watch()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise ServerError(self.failure_line())
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self._tree.record()  # the whole tree is up: what it holds is known now
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerError(f"sglang did not become ready in {timeout:.0f} s (log: {self.log_path})")

    def failure_line(self) -> str:
        """The line that says why start-up failed: engram-sglang's own, else the last error."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        lines = text.splitlines()
        # Our error lines carry ERROR_MARK; other "engram-sglang: " lines are notices
        # (e.g. "--engram-host-whole-rows auto -> on ...") that may come after the error.
        ours = [ln for ln in lines if ERROR_MARK in ln]
        if ours:
            return ours[-1][ours[-1].index(ERROR_MARK):]
        errors = [ln for ln in lines if "Error" in ln or "error" in ln]
        tail = errors[-1] if errors else (lines[-1] if lines else "no output")
        return f"sglang exited during start-up: {tail.strip()} (log: {self.log_path})"

    def stop(self, timeout: float = 30) -> None:
        """Stop as an operator's SIGTERM does, then make sure nothing is left.

        SIGTERM goes to SGLang's main process first: it drains the requests and tells its
        schedulers to exit, so their exit work runs (the last server to leave removes the
        node's shared host copy, stores/shmcopy.py). A SIGTERM to the whole group at once
        would end the schedulers undrained (they release their shared copies first, but
        nothing else). What is still alive after
        `timeout` gets SIGTERM, then SIGKILL, as a group. Then the /dev/shm files SGLang
        leaves behind even on its graceful path (`_UPSTREAM_SHM`) are removed: those any
        process of the tree held while it ran (recorded since start, so a tree that crashed
        or failed to start leaves none either), never another server's."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        tree = self._tree if self._tree is not None and self._tree.pgid == pgid else _TreeRecord(pgid)
        tree.record()  # named now: the group is gone after
        tree.close()
        self.proc.send_signal(signal.SIGTERM)  # a no-op once the process has been reaped
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _group_alive(pgid):
            self.proc.poll()
            time.sleep(0.2)
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(pgid):
                self.proc.poll()
                time.sleep(0.2)
            if not _group_alive(pgid):
                break
        self.proc.wait(timeout=10)
        self.proc = None
        self._tree = None
        tree.remove_leftovers()
        if self._tmp is not None:  # the whole tree is gone: nothing uses its sockets now
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---------------------------------------------------------------- requests
    def post(self, path: str, body: dict, timeout: float = 300) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise ServerError(f"POST {path}: HTTP {e.code}: {e.read().decode(errors='replace')[:500]}") from None

    def get(self, path: str, timeout: float = 60) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return json.loads(r.read())

    def generate(self, prompt, max_new_tokens: int = 16, **extra) -> dict:
        """Greedy completion of one prompt (text, or a list of token ids)."""
        body = {"sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}, **extra}
        body["input_ids" if isinstance(prompt, list) else "text"] = prompt
        return self.post("/generate", body)

    def engram_stats(self) -> dict:
        info = self.get("/server_info")
        states = info.get("internal_states") or [{}]
        return states[0].get("engram", {})


# /dev/shm files SGLang 0.5.23 makes and never removes on its own graceful stop: it ends its
# schedulers by SIGKILL (kill_process_tree), so the message queue of a TP group
# (sgl_shm_mq_<pid>_*, 24 MiB each, unlinked only by its creator's __del__) stays, and the
# load-snapshot file (sglang_loads_*.shm) is never unlinked at all. Upstream sweeps them
# only in its own CI (sglang/srt/utils/stale_shm_cleanup.py).
_UPSTREAM_SHM = ("sgl_shm_", "sglang_loads_")
_SHM = Path("/dev/shm")


def _upstream_shm_of(pids) -> set[Path]:
    """The upstream /dev/shm files these processes hold open or mapped: this server's own,
    never another server's (a name is removed only if one of its processes held it)."""
    held = set()
    for pid in pids:
        links = []
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
                except OSError:
                    continue
            with open(f"/proc/{pid}/maps") as f:
                links += [line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6]
        except OSError:
            continue  # gone, or not ours to read
        for link in links:
            path = Path(link.removesuffix(" (deleted)"))
            if path.parent == _SHM and path.name.startswith(_UPSTREAM_SHM):
                held.add(path)
    return held


class _TreeRecord:
    """Every PID of one server's process group and every upstream /dev/shm file they held,
    sampled from start to stop by a daemon thread: by the time a crashed or failed tree is
    stopped its processes are gone, and with them what /proc said they held. A tree that
    ends on its own (a crash with no stop after it) is cleaned up by the thread itself."""

    INTERVAL = 0.5  # s; SGLang's files live as long as their scheduler, so one sample finds them

    def __init__(self, pgid: int):
        self.pgid = pgid
        self.pids: set[int] = set()
        self.held: set[Path] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def watch(self) -> "_TreeRecord":
        self.record()
        self._thread = threading.Thread(target=self._run, name=f"engram-sglang-tree-{self.pgid}", daemon=True)
        self._thread.start()
        return self

    def record(self) -> None:
        members = _group_members(self.pgid)
        held = _upstream_shm_of(members)
        with self._lock:
            self.pids.update(members)
            self.held |= held

    def close(self) -> None:
        """Stop sampling (stop() takes over the cleanup)."""
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def remove_leftovers(self) -> None:
        with self._lock:
            paths = self.held | _pid_stamped_shm(self.pids, self.pgid)
        _remove_upstream_shm(paths)

    def _run(self) -> None:
        while not self._closed.wait(self.INTERVAL):
            self.record()
            if not _group_alive(self.pgid):
                self.remove_leftovers()  # crashed with nobody stopping it yet; stop() repeats it harmlessly
                return


def _pid_stamped_shm(pids, pgid: int) -> set[Path]:
    """sgl_shm_<kind>_<pid>_<rand> files made by these (now dead) processes, also ones never
    seen held; a PID since reused by a live process outside the group is skipped."""
    out = set()
    try:
        names = os.listdir(_SHM)
    except OSError:
        return out
    for name in names:
        parts = name.split("_")
        if not name.startswith("sgl_shm_") or len(parts) < 5 or not parts[-2].isdigit():
            continue
        pid = int(parts[-2])
        if pid in pids and not _alive_outside(pid, pgid):
            out.add(_SHM / name)
    return out


def _alive_outside(pid: int, pgid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[2]) != pgid
    except (OSError, ValueError, IndexError):
        return False


def _remove_upstream_shm(paths) -> None:
    for path in paths:
        try:
            path.unlink()
        except FileNotFoundError:
            pass  # its creator removed it after all


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # Zombies count as gone: only the group's live members matter.
    for pid in _group_members(pgid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    return True
        except OSError:
            continue
    return False


def _group_members(pgid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            out.append(int(entry))
    return out
