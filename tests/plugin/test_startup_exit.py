"""A scheduler's EngramError at start-up ends the server with its one line, last, and exit
status 2 (serving/startup_exit.py), not inside SGLang's traceback with status 137.

The launcher's side is SGLang 0.5.23's real `_wait_for_scheduler_ready` wrapped by the
plugin's hook, waiting on a real spawned process as SGLang spawns its schedulers; that
process runs the plugin's `Scheduler.__init__` hook around a stand-in constructor that raises
(a real Scheduler needs a whole server: tests/e2e/test_e2e_serving.py starts one on bad tables)."""

from __future__ import annotations

import multiprocessing as mp
import sys

import pytest

from engram_sglang.core.errors import EngramError

LINE = "/tables/layer-3.rows: truncated: 41 rows, the config's layout has 42"


def _failing_constructor(self, *args, **kwargs):
    raise EngramError(LINE)


def _scheduler(pipe_writer, error: bool) -> None:
    """The child: as SGLang's run_scheduler_process, which catches Exception (not SystemExit)."""
    from engram_sglang.plugin.scheduler import scheduler_init

    def other(self, *args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    try:
        scheduler_init(_failing_constructor if error else other, object())
        pipe_writer.send({"status": "ready"})
    except Exception:  # SGLang's own path: traceback, SIGQUIT to the parent (not needed here)
        sys.exit(1)


def _start(error: bool):
    ctx = mp.get_context("spawn")  # SGLang's start method for its schedulers
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_scheduler, args=(writer, error))
    proc.start()
    writer.close()  # the child holds the only writer: its death is EOF here
    return reader, proc


@pytest.fixture
def wait():
    engine = pytest.importorskip("sglang.srt.entrypoints.engine")
    from engram_sglang.plugin.engine import wait_for_scheduler_ready

    return wait_for_scheduler_ready(engine._wait_for_scheduler_ready)  # the real one, wrapped (not patched)


def test_the_scheduler_exits_2_quietly_and_the_command_line_ends_on_its_line(wait, monkeypatch, capfd, tmp_path):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the child's temporary directory too
    reader, proc = _start(error=True)
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/sglang", "serve"])  # SGLang's command line
    with pytest.raises(SystemExit) as e:
        wait([reader], [proc])
    assert e.value.code == 2 and proc.exitcode == 2
    err = capfd.readouterr().err
    assert err.splitlines()[-1] == f"engram-sglang: error: {LINE}", err
    assert "Traceback" not in err, err
    assert list(tmp_path.glob("engram-sglang-start-up-*")) == []  # the line's file is gone


def test_an_embedding_program_gets_the_engram_error(wait, monkeypatch, tmp_path):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    reader, proc = _start(error=True)
    monkeypatch.setattr(sys, "argv", ["my_program.py"])
    with pytest.raises(EngramError, match=f"^{LINE}$"):
        wait([reader], [proc])


def test_another_scheduler_death_is_sglangs_as_before(wait, monkeypatch, tmp_path):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    reader, proc = _start(error=False)
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/sglang", "serve"])
    with pytest.raises(RuntimeError, match="scheduler died during initialization .exit code: 1"):
        wait([reader], [proc])


def test_a_scheduler_built_in_process_raises_to_its_caller():
    from engram_sglang.plugin.scheduler import scheduler_init

    with pytest.raises(EngramError, match=LINE):
        scheduler_init(_failing_constructor, object())
