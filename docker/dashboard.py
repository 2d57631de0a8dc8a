#!/usr/bin/env python3
"""The Grafana dashboard and alert rules as PromQL, run against a real Prometheus: list every query,
start Prometheus on a scrape target, evaluate queries, and render the dashboard's panels to a PNG.

    python docker/dashboard.py queries                      # every panel and alert query
    python docker/dashboard.py render --prometheus http://127.0.0.1:9090 --minutes 15 --out dashboard.png

Used by tests/deploy/test_dashboard.py (every query must return data from a live server) and
perf/dashboard_snapshot.py (the picture in docker/README.md). Grafana is not needed for either: the panels
are drawn with matplotlib from the same queries Grafana would send.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import yaml

HERE = Path(__file__).resolve().parent
DASHBOARD = HERE / "grafana" / "dashboards" / "llm-serving.json"
ALERTS = HERE / "prometheus" / "alerts.yml"
PROMETHEUS_CONFIG = HERE / "prometheus" / "prometheus.yml"
# Template variables of the dashboard, as "All" selects them; Grafana's $__rate_interval is at least four
# scrape intervals, which over a short test run needs a fixed window instead.
DEFAULT_VARIABLES = {"model": ".*", "engine": ".*", "server": ".*"}


@dataclass(frozen=True)
class Query:
    title: str  # panel title or alert name
    legend: str
    expr: str  # as written, with Grafana variables


def panel_queries(path: Path = DASHBOARD) -> list[Query]:
    dashboard = json.loads(path.read_text())
    return [Query(p["title"], t.get("legendFormat", ""), t["expr"])
            for p in dashboard["panels"] if p.get("type") != "row" for t in p["targets"]]


def alert_queries(path: Path = ALERTS) -> list[Query]:
    rules = yaml.safe_load(path.read_text())
    return [Query(r["alert"], "", r["expr"]) for g in rules["groups"] for r in g["rules"] if "alert" in r]


def resolve(expr: str, rate_interval: str = "1m", variables: dict[str, str] | None = None) -> str:
    """Grafana's variables replaced: $__rate_interval by rate_interval, $name by its value (All: .*)."""
    values = {**DEFAULT_VARIABLES, **(variables or {})}
    expr = expr.replace("$__rate_interval", rate_interval)
    return re.sub(r"\$(\w+)", lambda m: values[m.group(1)], expr)


def as_bool(expr: str) -> str:
    """An alert condition with its comparisons made `bool` (0 or 1 per series instead of dropping the series
    below the threshold), so evaluating it shows whether its inputs exist whatever their values."""
    return re.sub(r"(==|!=|>=|<=|>|<)\s*(?!bool\b)(?=[0-9.])", r"\1 bool ", " ".join(expr.split()))


# ---- a real Prometheus ------------------------------------------------------------------------------------

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
        """Instant vector at now: [{"metric": {...}, "value": [t, "v"]}]."""
        return self._get("/api/v1/query", query=expr)["result"]

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict]:
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


def scrape_config(targets: list[str], scrape_interval: str, evaluation_interval: str) -> dict:
    """docker/prometheus/prometheus.yml with its targets and intervals replaced (relabelling kept)."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"].update(scrape_interval=scrape_interval, evaluation_interval=evaluation_interval)
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": targets}]
    config["rule_files"] = [str(ALERTS)]
    return config


@contextlib.contextmanager
def run_prometheus(workdir: Path, port: int, targets: list[str], scrape_interval: str = "1s",
                   evaluation_interval: str = "1s", binary: str = "prometheus") -> Iterator[Prometheus]:
    """Real Prometheus on 127.0.0.1:port scraping targets, with docker/prometheus/alerts.yml loaded;
    stopped by its own pid on exit."""
    exe = shutil.which(binary)
    if exe is None:
        raise RuntimeError(f"{binary} not found: run scripts/setup_docker.sh (Debian's prometheus package)")
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump(scrape_config(targets, scrape_interval, evaluation_interval)))
    log = open(workdir / "prometheus.log", "wb")
    proc = subprocess.Popen([exe, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    prom = Prometheus(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 60
        while not prom.ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start: {(workdir / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


# ---- the panels as a picture --------------------------------------------------------------------------------

def render(prom: Prometheus, out: Path, minutes: float, rate_interval: str = "1m", columns: int = 4) -> Path:
    """Each dashboard panel as a small chart of its queries over the last `minutes`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p.get("type") != "row"]
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.1 * rows), squeeze=False)
    end = time.time()
    start = end - minutes * 60
    step = max(2.0, minutes * 60 / 300)
    for ax, panel in zip(axes.flat, panels):
        for target in panel["targets"]:
            for series in prom.query_range(resolve(target["expr"], rate_interval), start, end, step):
                points = [(float(t) - end, float(v)) for t, v in series["values"]]
                legend = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: series["metric"].get(m.group(1), ""),
                                target.get("legendFormat", ""))
                xs, ys = zip(*points)
                ax.plot([x / 60 for x in xs], ys, linewidth=1,
                        linestyle="--" if legend.endswith("p99") else "-", label=" ".join(legend.split()))
        ax.set_title(panel["title"], fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("minutes", fontsize=7)
        unit = panel["fieldConfig"]["defaults"].get("unit", "")
        ax.set_ylabel({"s": "seconds", "percentunit": "fraction", "reqps": "requests/s"}.get(unit, ""), fontsize=7)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=5, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(dashboard["title"] + " (rendered from Prometheus query_range)", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("queries", help="print every panel and alert query")
    r = sub.add_parser("render", help="draw the panels from a Prometheus")
    r.add_argument("--prometheus", default="http://127.0.0.1:9090")
    r.add_argument("--minutes", type=float, default=15)
    r.add_argument("--rate-interval", default="1m")
    r.add_argument("--out", type=Path, default=Path("dashboard.png"))
    args = parser.parse_args(argv)
    if args.command == "queries":
        for q in panel_queries() + alert_queries():
            print(f"{q.title}: {' '.join(q.expr.split())}")
        return 0
    print(render(Prometheus(args.prometheus), args.out, args.minutes, args.rate_interval))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
