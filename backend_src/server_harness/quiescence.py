"""The after-every-case check: nothing leaked, nothing pending, the server still serving.

Read from the real server only: the llm model's gauges on /metrics (exported every metrics_interval_ms,
so the check polls) and Triton's health endpoints. Quiescent means, for one model:
  inflight:kv_blocks_used == 0 and inflight:kv_blocks_free == the pool size (every ref count is 0:
      a referenced block counts as used), vllm:kv_cache_usage_perc == 0;
  vllm:num_requests_running == vllm:num_requests_waiting == inflight:num_requests_preempted == 0;
  inflight:num_requests_inflight == 0 (every accepted request has had its final response);
  /v2/health/live and /v2/models/<model>/ready answer 200.
"""
from __future__ import annotations

import re
import time
import urllib.error
import urllib.request
from typing import Protocol

_SAMPLE = re.compile(r"^((?:vllm|inflight):[a-zA-Z0-9_:]+)\{([^}]*)\} (\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')

ENGINE_ZERO_GAUGES = ("inflight:kv_blocks_used", "vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                      "vllm:num_requests_waiting", "inflight:num_requests_preempted")
# llm's and llm_iterative's frontends add this one; llm_dynamic has no frontend (execute runs each batch to its
# end), so its checks pass ENGINE_ZERO_GAUGES.
ZERO_GAUGES = ENGINE_ZERO_GAUGES + ("inflight:num_requests_inflight",)


class Endpoints(Protocol):
    http_base: str  # http://host:port
    metrics_url: str  # http://host:port/metrics


def scrape(metrics_url: str, model: str) -> dict[str, float]:
    """One model's vllm:/inflight: samples: 'name' or 'name{k=v,...}' (model/version labels dropped, and the
    instance label: a model's instances are summed)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = dict(_LABEL.findall(m.group(2)))
        if labels.pop("model", None) != model:
            continue
        labels.pop("version", None)
        labels.pop("instance", None)
        key = m.group(1) + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else "")
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def http_status(url: str, timeout_s: float = 5.0) -> int:
    """The HTTP status `url` answers with; 0 when nothing answers (refused, timed out)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError, OSError):
        return 0


def quiescence_problems(server: Endpoints, model: str, num_blocks: int,
                        gauges: tuple[str, ...] = ZERO_GAUGES) -> list[str]:
    """What is wrong right now (empty when quiescent)."""
    problems = []
    live = http_status(f"{server.http_base}/v2/health/live")
    if live != 200:
        problems.append(f"server not live (HTTP {live})")
    ready = http_status(f"{server.http_base}/v2/models/{model}/ready")
    if ready != 200:
        problems.append(f"model {model} not ready (HTTP {ready})")
    try:
        m = scrape(server.metrics_url, model)
    except (urllib.error.URLError, ConnectionError, OSError) as e:
        return problems + [f"/metrics unreadable: {e}"]
    for name in gauges:
        if name not in m:
            problems.append(f"{name} not exported")
        elif m[name] != 0:
            problems.append(f"{name} = {m[name]:g}, want 0")
    free = m.get("inflight:kv_blocks_free")
    if free != num_blocks:
        problems.append(f"inflight:kv_blocks_free = {free}, want the whole pool {num_blocks}")
    return problems


def assert_quiescent(server: Endpoints, model: str, num_blocks: int, timeout_s: float = 15.0,
                     settle_s: float = 0.5) -> None:
    """Poll until the model is quiescent and stays so for settle_s (longer than one export period, so a
    stale 0 exported before the work began cannot pass); AssertionError with what is still wrong."""
    deadline = time.monotonic() + timeout_s
    good_since = None
    while True:
        problems = quiescence_problems(server, model, num_blocks)
        now = time.monotonic()
        if problems:
            good_since = None
        elif good_since is None:
            good_since = now
        elif now - good_since >= settle_s:
            return
        if now > deadline:
            raise AssertionError(f"{model} not quiescent after {timeout_s:.0f} s: " + "; ".join(problems or
                                 ["flapping"]))
        time.sleep(0.05)
