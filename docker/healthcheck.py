"""Docker HEALTHCHECK of the engram-sglang images: GET SGLang's /health.

SGLang answers 503 while it loads (tables included) and 200 once it serves, so the image's
HEALTHCHECK start period must cover loading; this script only asks once. The URL comes from
ENGRAM_HEALTH_URL (default http://127.0.0.1:30000/health, SGLang's default port); a server
started with --port P needs ENGRAM_HEALTH_URL=http://127.0.0.1:P/health. Exit 0: healthy,
1: not (with one line saying why, which `docker inspect` shows).
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

DEFAULT_URL = "http://127.0.0.1:30000/health"


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
    timeout = float(os.environ.get("ENGRAM_HEALTH_TIMEOUT", "8"))
    ok, msg = check(url, timeout)
    print(("healthy: " if ok else "unhealthy: ") + msg)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
