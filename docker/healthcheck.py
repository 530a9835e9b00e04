"""Docker HEALTHCHECK of the engram-sglang images: GET SGLang's /health_generate.

/health_generate runs a one-token generation through the scheduler (and so through the
Engram stores) unless the server is already producing output; plain /health answers 200 from
the HTTP process alone, so a hung scheduler or a failed table read would still look healthy.
SGLang answers 503 while it loads (tables included), and after 20 s without any output
(SGLANG_HEALTH_CHECK_TIMEOUT), so the image's HEALTHCHECK start period must cover loading and
its timeout those 20 s; this script only asks once. The URL comes from ENGRAM_HEALTH_URL
(default http://127.0.0.1:30000/health_generate, SGLang's default port); a server started
with --port P needs ENGRAM_HEALTH_URL=http://127.0.0.1:P/health_generate. Exit 0: healthy, 1:
not (with one line saying why, which `docker inspect` shows).
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

DEFAULT_URL = "http://127.0.0.1:30000/health_generate"


def check(url: str, timeout: float) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200, f"{url}: HTTP {r.status}"
    except urllib.error.HTTPError as e:
        return False, f"{url}: HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        return False, f"{url}: {reason}"


def main() -> int:
    url = os.environ.get("ENGRAM_HEALTH_URL", DEFAULT_URL)
    timeout = float(os.environ.get("ENGRAM_HEALTH_TIMEOUT", "22"))  # past SGLang's own 20 s verdict
    ok, msg = check(url, timeout)
    print(("healthy: " if ok else "unhealthy: ") + msg)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
