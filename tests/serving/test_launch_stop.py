"""Server.stop leaves no /dev/shm file of SGLang's behind (seconds, no SGLang).

SGLang 0.5.23's graceful stop ends its schedulers by SIGKILL: a TP group's message queue
(sgl_shm_mq_<pid>_*) stays, and the load-snapshot file (sglang_loads_*.shm) is never
unlinked; 244 of them had piled up after one session's tests. A stand-in process group
(a main process and a "scheduler" child) makes such files, holds them mapped or open and
dies without removing them; stop removes those, and only those."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from engram_sglang.serving.launch import Server

SHM = Path("/dev/shm")

# One process of the group: makes `name` (formatted with its pid), holds it mapped and open
# (as SGLang's MessageQueue and ShmLoadSnapshotWriter do), says so, then waits; SIGTERM kills
# it where it stands (as SIGKILL does a scheduler), so nothing is unlinked.
HOLDER = """
import mmap, os, sys, time
path = "/dev/shm/" + sys.argv[1].format(pid=os.getpid())
fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
m = mmap.mmap(fd, 4096)
if sys.argv[2] == "closed":
    os.close(fd)  # mapped only: found in /proc/PID/maps
print(path, flush=True)
if len(sys.argv) > 3:
    import subprocess
    child = subprocess.Popen([sys.executable, "-c", sys.argv[3], *sys.argv[4:]], stdout=sys.stdout)
time.sleep(600)
"""


@pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm")
def test_stop_removes_the_shm_files_sglang_leaves_and_no_other(tmp_path):
    tag = uuid.uuid4().hex[:8]
    loads = f"sglang_loads_test{tag}_{{pid}}.shm"
    mq = "sgl_shm_mq_{pid}_" + tag
    # Same families, not held by the server's processes: another server's, which stay.
    others = [SHM / f"sgl_shm_mq_{os.getpid()}_{tag}x", SHM / f"sglang_loads_test{tag}_other.shm"]
    for path in others:
        path.write_bytes(b"x")
    server = Server(tmp_path, log_path=tmp_path / "unused.log")  # only its stop is used
    server.proc = subprocess.Popen([sys.executable, "-c", HOLDER, loads, "open", HOLDER, mq, "closed"],
                                   stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        made = [Path(server.proc.stdout.readline().strip()) for _ in range(2)]
        assert all(p.exists() for p in made), made
        server.stop(timeout=5)
        left = [p for p in made if p.exists()]
        assert left == [], f"left in /dev/shm after stop: {left}"
        assert all(p.exists() for p in others)  # never another server's
    finally:
        if server.proc is not None:
            os.killpg(server.proc.pid, 9)
            server.proc.wait()
        for path in others + [p for p in SHM.glob(f"*{tag}*")]:
            path.unlink(missing_ok=True)


def test_failure_line_is_the_error_not_a_later_notice(tmp_path):
    server = Server.__new__(Server)
    server.log_path = tmp_path / "sglang.log"
    server.log_path.write_text(
        "[2026-12-03 17:00:00 TP0] engram-sglang: error: --engram-placement disk needs a table directory\n"
        "[2026-12-03 17:00:01 TP1] engram-sglang: --engram-host-whole-rows auto -> on: 2 GiB fit\n"
        "[2026-12-03 17:00:02] Received sigquit from a child process. It usually means the child failed.\n")
    assert server.failure_line() == "engram-sglang: error: --engram-placement disk needs a table directory"
    # Negative control: a log with notices only names SGLang's last error, not a notice.
    server.log_path.write_text("[TP0] engram-sglang: --engram-host-whole-rows auto -> on: 2 GiB fit\n"
                               "[TP0] RuntimeError: CUDA out of memory\n")
    assert server.failure_line().startswith("sglang exited during start-up: [TP0] RuntimeError: CUDA out of memory")


# A stand-in `sglang.launch_server` for Server.start: its "scheduler" child makes the two
# files (as HOLDER does), holds them a moment, then the tree fails its start (an error line,
# then SIGKILL to the whole group) or, with "serve", answers /health until it is killed (a crash, no stop path).
FAKE_LAUNCH = """
import http.server, os, subprocess, sys, threading, time
loads, mq, how, holder = sys.argv[1:5]
child = subprocess.Popen([sys.executable, "-c", holder, loads, "open", holder, mq, "closed"],
                         stdout=subprocess.PIPE, text=True)
made = [child.stdout.readline().strip() for _ in range(2)]
import tempfile
sock = tempfile.NamedTemporaryFile(delete=False).name  # as SGLang names its ZMQ sockets: never removed
open(os.environ["FAKE_MADE"], "w").write("\\n".join(made + [sock]))
if how == "fail":
    time.sleep(1.5)  # the scheduler lived a moment, then died without unlinking
    print("engram-sglang: error: fake start failure", flush=True)
    os.killpg(0, 9)  # as SGLang's kill_process_tree on a failed start: nothing unlinks anything
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
port = int(sys.argv[sys.argv.index("--port") + 1])
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def _fake_server(tmp_path, how: str, tag: str) -> Server:
    server = Server(tmp_path, log_path=tmp_path / "fake.log", env={"FAKE_MADE": str(tmp_path / "made")})
    server.cmd = [sys.executable, "-c", FAKE_LAUNCH, f"sglang_loads_test{tag}_{{pid}}.shm", "sgl_shm_mq_{pid}_" + tag,
                  how, HOLDER, "--port", str(server.port)]
    return server


@pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm")
@pytest.mark.parametrize("how", ["fail", "crash"])
def test_a_failed_or_crashed_start_leaves_no_shm_file(tmp_path, how):
    tag = uuid.uuid4().hex[:8]
    other = SHM / f"sglang_loads_test{tag}_other.shm"  # another server's: stays
    other.write_bytes(b"x")
    server = _fake_server(tmp_path, "fail" if how == "fail" else "serve", tag)
    try:
        if how == "fail":
            with pytest.raises(Exception, match="fake start failure"):
                server.start(timeout=30)
        else:
            server.start(timeout=30)
            os.killpg(server.proc.pid, 9)  # crashes: nothing of its own unlinks anything
            server.proc.wait()
            server.stop(timeout=5)
        *made, sock = [Path(p) for p in (tmp_path / "made").read_text().split("\n")]
        assert len(made) == 2 and all(p.name.startswith(("sglang_loads_", "sgl_shm_")) for p in made)
        left = [p for p in made if p.exists()]
        assert left == [], f"left in /dev/shm after a {how}: {left}"
        # Its temp files were made in a TMPDIR of its own, which is gone with it.
        assert sock.parent.name.startswith("engram-sglang-server-") and not sock.parent.exists(), sock
        assert other.exists()
    finally:
        if server.proc is not None:
            os.killpg(server.proc.pid, 9)
            server.proc.wait()
        for path in [other] + list(SHM.glob(f"*{tag}*")):
            path.unlink(missing_ok=True)
