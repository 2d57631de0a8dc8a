"""Real Prometheus for tests and the dashboard picture: start it on a scrape target with the project's config
and alert rules (docker/prometheus/), query its HTTP API, and list the PromQL of the Grafana dashboard's
panels (docker/grafana/dashboards/) and of the alert rules. Used by tests/deploy/test_dashboard.py and
perf/bench/dashboard_snapshot.py. Needs the `prometheus` binary (Debian's package: scripts/setup_docker.sh).
"""
from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import yaml

# The dashboard's template variables as "All" selects them.
ALL_VARIABLES = {"model": ".*", "engine": ".*", "server": ".*"}


@dataclass(frozen=True)
class Query:
    title: str  # panel title or alert name
    legend: str  # Grafana legendFormat ("" for alerts)
    expr: str  # as written, with Grafana variables


def panel_queries(dashboard: Path) -> list[Query]:
    panels = json.loads(dashboard.read_text())["panels"]
    return [Query(p["title"], t.get("legendFormat", ""), t["expr"])
            for p in panels if p.get("type") != "row" for t in p["targets"]]


def alert_queries(rules: Path) -> list[Query]:
    groups = yaml.safe_load(rules.read_text())["groups"]
    return [Query(r["alert"], "", r["expr"]) for g in groups for r in g["rules"] if "alert" in r]


def resolve(expr: str, rate_interval: str, variables: dict[str, str] | None = None) -> str:
    """Grafana's variables replaced: $__rate_interval (at least four scrape intervals in Grafana; a short
    test run needs a window that covers it) and $name by its value."""
    values = {**ALL_VARIABLES, **(variables or {})}
    expr = expr.replace("$__rate_interval", rate_interval)
    return re.sub(r"\$(\w+)", lambda m: values[m.group(1)], expr)


def as_bool(expr: str) -> str:
    """An alert condition with its comparisons made `bool`: 0 or 1 per series instead of dropping the series
    on the quiet side of the threshold, so evaluating it shows whether its inputs exist at all."""
    return re.sub(r"(==|!=|>=|<=|>|<)\s*(?!bool\b)(?=[0-9.])", r"\1 bool ", " ".join(expr.split()))


class Prometheus:
    """Prometheus' HTTP API at base_url."""

    def __init__(self, base_url: str):
        self.base_url = base_url.rstrip("/")

    def _get(self, path: str, **params) -> dict:
        url = f"{self.base_url}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=30) as resp:
            body = json.loads(resp.read())
        if body.get("status") != "success":
            raise RuntimeError(f"{url}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """Instant vector now: [{"metric": {label: value}, "value": [time, "number"]}]."""
        return self._get("/api/v1/query", query=expr)["result"]

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict]:
        """[{"metric": {...}, "values": [[time, "number"], ...]}]."""
        return self._get("/api/v1/query_range", query=expr, start=start, end=end, step=step_s)["result"]

    def rules(self) -> list[dict]:
        return [r for g in self._get("/api/v1/rules")["groups"] for r in g["rules"]]

    def targets(self) -> list[dict]:
        return self._get("/api/v1/targets")["activeTargets"]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/-/ready", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False


def scrape_config(template: Path, rules: Path, targets: list[str], scrape_interval: str,
                  evaluation_interval: str) -> dict:
    """A Prometheus config from template (docker/prometheus/prometheus.yml: one job, its relabelling kept)
    with its targets, intervals and rule file replaced."""
    config = yaml.safe_load(template.read_text())
    config["global"].update(scrape_interval=scrape_interval, evaluation_interval=evaluation_interval)
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": targets}]
    config["rule_files"] = [str(rules)]
    return config


@contextlib.contextmanager
def run_prometheus(workdir: Path, port: int, config: dict, binary: str = "prometheus") -> Iterator[Prometheus]:
    """Prometheus on 127.0.0.1:port with `config`, data and log under workdir; stopped by its own pid."""
    exe = shutil.which(binary)
    if exe is None:
        raise RuntimeError(f"{binary} not found: run scripts/setup_docker.sh (Debian's prometheus package)")
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = workdir / "prometheus.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([exe, f"--config.file={config_path}", f"--storage.tsdb.path={workdir / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    prom = Prometheus(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 60
        while not prom.ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.2)
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
