"""Is this model still served? Asked over the server's own HTTP endpoint on loopback.

Why not pb_utils.is_model_ready: in Triton 2.51 that call can block for good while the server unloads the
model (it waits on the model, which waits on our in-flight requests), and with it every later stub-to-server
message, responses included. The HTTP endpoint answers at once: on SIGTERM Triton closes it (connection
refused), and during an explicit unload the model's ready endpoint says 400 "not ready".

The address comes from INFLIGHT_HEALTH_URL ("off" disables the probe; read by inflight/env_overrides.py), else
from the parent tritonserver's command line (--http-address / --http-port; defaults 0.0.0.0:8000, asked on
127.0.0.1).
"""
from __future__ import annotations

import logging
import os
import urllib.error
import urllib.request
from pathlib import Path

from inflight.env_overrides import health_url

log = logging.getLogger(__name__)

def _flag(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
        if arg == name and i + 1 < len(args):
            return args[i + 1]
    return None


def base_url_from_cmdline(args: list[str]) -> str | None:
    """http://host:port of a tritonserver started with `args`; None when its HTTP endpoint is off."""
    if (_flag(args, "--allow-http") or "true").lower() in ("false", "0", "no"):
        return None
    host = _flag(args, "--http-address") or "0.0.0.0"
    if host in ("0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    port = _flag(args, "--http-port") or "8000"
    return f"http://{host}:{port}"


def discover_base_url() -> str | None:
    override = health_url()
    if override:
        return None if override.lower() == "off" else override.rstrip("/")
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return None
    args = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    if not args or "tritonserver" not in os.path.basename(args[0]):
        return None
    return base_url_from_cmdline(args[1:])


class HealthProbe:
    """Callable: True (ready), False (not ready, or the endpoint is gone), None (no answer worth counting)."""

    @classmethod
    def for_model(cls, base_url: str | None, model: str, version: str = "") -> "HealthProbe | None":
        """A probe of this server's own endpoint (discover_base_url()), or None, said in the log, without one."""
        if base_url is None:
            log.warning("no HTTP endpoint to ask whether %s is still served: requests in flight at shutdown will "
                        "wait for --exit-timeout-secs", model)
            return None
        return cls(base_url, model, version)

    def __init__(self, base_url: str, model: str, version: str = "", timeout_s: float = 0.5):
        path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/ready"
        self.url = base_url + path
        self.timeout_s = timeout_s
        self.disabled = False
        # Loopback only: never through a proxy from the environment.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def __call__(self) -> bool | None:
        if self.disabled:
            return None
        try:
            with self._opener.open(self.url, timeout=self.timeout_s) as resp:
                return resp.status == 200
        except urllib.error.HTTPError as e:
            if e.code in (400, 404, 503):  # Triton: "Model version not ready", unknown model, unavailable
                return False
            log.warning("health probe %s answered HTTP %d (restricted?): probe disabled", self.url, e.code)
            self.disabled = True
            return None
        except urllib.error.URLError as e:
            if isinstance(e.reason, ConnectionRefusedError):
                return False  # the server closed its endpoints: it is stopping
            return None
        except (TimeoutError, OSError):
            return None
