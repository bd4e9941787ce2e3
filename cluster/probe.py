"""The readiness probe of a pod that hosts the Serve HTTP proxy (``python -m cluster.probe``; deploy/rayservice.yaml).

Exit status 0 (ready) when the application's ``/health`` answers 200, i.e. a completion can be served end to end
(:meth:`scheduler.hub.SchedulerHub.readiness`); 1 (not ready) when it answers anything else (503 while the
replicas are starting or gone) or not within the timeout. Two answers also count as ready because they mean the
application is not deployed *yet*: nothing listening on the port (Serve not started) and 404 (the proxy runs but
routes no application). KubeRay deploys the Serve application only once the head pod is Ready, so a probe that
failed before the deployment would hold it back forever. While not ready, Kubernetes keeps the pod out of the
serve Service's endpoints: clients are not sent to a proxy that could only answer 503.

Standard library only: the probe runs every few seconds and must start fast.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence

DEFAULT_URL = "http://127.0.0.1:8000/health"


def probe(url: str, timeout_s: float) -> tuple[bool, str]:
    """(ready, what was seen) for one GET of ``url``."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200, f"HTTP {response.status}"
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return True, "HTTP 404: no application routed yet"
        return False, f"HTTP {error.code}: {error.read(500).decode('utf-8', 'replace')}"
    except urllib.error.URLError as error:
        if isinstance(error.reason, ConnectionRefusedError):
            return True, "nothing listening: the Serve application is not deployed yet"
        return False, f"no answer: {error.reason}"
    except TimeoutError:
        return False, f"no answer within {timeout_s:g} s"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=DEFAULT_URL, help=f"the application's health URL (default {DEFAULT_URL})")
    parser.add_argument("--timeout", type=float, default=4.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    ready, seen = probe(args.url, args.timeout)
    print(("ready: " if ready else "not ready: ") + seen)
    return 0 if ready else 1


if __name__ == "__main__":
    sys.exit(main())
