"""Progress of a table write: a tqdm bar on a terminal; off one (a Kubernetes Job's log,
`docker run -d`, a pipe) an INFO line on this module's logger every 5% or 30 s, whichever
comes first, with the rate and the ETA, and one line when done; none for a write done within
QUIET_S (a small table's write, a test's). A bar's carriage returns would be one endless
line in such a log, and no output at all looks like a hang."""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Optional

from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

EVERY_S, EVERY_FRACTION = 30.0, 0.05
QUIET_S = 3.0


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """Bytes done of `total`; update() may be called from any thread.

    `progress`: True a bar, False nothing, None a bar when stderr is a terminal, else lines."""

    def __init__(self, total: int, what: str, progress: Optional[bool] = None, *,
                 every_s: float = EVERY_S, every_fraction: float = EVERY_FRACTION):
        self.total, self.what, self.done = max(int(total), 1), what, 0
        self.every_s, self.step = every_s, max(1, int(self.total * every_fraction))
        tty = progress is None and sys.stderr.isatty()
        self.bar = tqdm(total=self.total, unit="B", unit_scale=True, desc=what) if progress or tty else None
        self.lines = progress is None and not tty
        self.t0 = self.last_t = time.monotonic()
        self.quiet_s, self.printed = QUIET_S, False
        self.next_done = self.step
        self.lock = threading.Lock()

    def update(self, nbytes: int) -> None:
        with self.lock:
            self.done += nbytes
            if self.bar is not None:
                self.bar.update(nbytes)
            now = time.monotonic()
            due = self.done >= self.next_done or now - self.last_t >= self.every_s
            if self.lines and self.done < self.total and due and now - self.t0 >= self.quiet_s:
                rate = self.done / max(now - self.t0, 1e-9)
                logger.info(f"{self.what}: {self.done / 2**30:.2f} of {self.total / 2**30:.2f} GiB "
                            f"({100 * self.done / self.total:.0f}%), {rate / 1e6:,.0f} MB/s, "
                            f"ETA {_duration((self.total - self.done) / max(rate, 1e-9))}")
                self.last_t, self.printed = now, True
                self.next_done = (self.done // self.step + 1) * self.step

    def close(self, ok: bool = True) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.lines and ok and (self.printed or time.monotonic() - self.t0 >= self.quiet_s):
            took = time.monotonic() - self.t0
            logger.info(f"{self.what}: {self.done / 2**30:.2f} GiB written in {_duration(took)}, "
                        f"{self.done / max(took, 1e-9) / 1e6:,.0f} MB/s")
