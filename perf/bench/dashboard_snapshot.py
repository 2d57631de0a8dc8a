"""The Grafana dashboard without Grafana: its panels drawn with matplotlib from real Prometheus answers to
the same queries. Either start everything (a tritonserver with both A/B arms, Debian's Prometheus with
docker/prometheus/, load through both arms), or draw from a Prometheus already running.

    .venv/bin/python -m perf.bench.dashboard_snapshot --minutes 6 --out docker/dashboard.png  # SmolLM2, 2 llm
    .venv/bin/python -m perf.bench.dashboard_snapshot --tiny --minutes 1 --out /tmp/dash.png    # tiny-llama, quick
    .venv/bin/python -m perf.bench.dashboard_snapshot --prometheus http://127.0.0.1:9090 --minutes 30 --out now.png
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

from server_harness.load import traffic
from server_harness.prometheus import Prometheus, resolve, run_prometheus, scrape_config
from server_harness.repository import build_repository, copy_model
from server_harness.server import TritonServer, free_ports

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "llm-serving.json"
PROMETHEUS_YML = ROOT / "docker" / "prometheus" / "prometheus.yml"
ALERTS = ROOT / "docker" / "prometheus" / "alerts.yml"
UNITS = {"s": "seconds", "percentunit": "fraction", "reqps": "requests/s"}


def legend_of(legend_format: str, labels: dict[str, str]) -> str:
    """Grafana's legendFormat with {{label}} filled in."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), legend_format)


def render(prom: Prometheus, out: Path, minutes: float, rate_interval: str = "30s", columns: int = 4) -> Path:
    """Each dashboard panel as one small chart of its queries over the last `minutes` (p99 dashed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p.get("type") != "row"]
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.8 * columns, 3.2 * rows), squeeze=False)
    end = time.time()
    start = end - minutes * 60
    step = max(2.0, minutes * 60 / 300)
    for ax, panel in zip(axes.flat, panels):
        for target in panel["targets"]:
            for series in prom.query_range(resolve(target["expr"], rate_interval), start, end, step):
                legend = legend_of(target.get("legendFormat", ""), series["metric"])
                xs = [(float(t) - end) / 60 for t, _ in series["values"]]
                ys = [float(v) for _, v in series["values"]]
                ax.plot(xs, ys, linewidth=1, linestyle="--" if legend.endswith("p99") else "-",
                        label=" ".join(legend.split()))
        ax.set_title(panel["title"], fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("minutes", fontsize=7)
        ax.set_ylabel(UNITS.get(panel["fieldConfig"]["defaults"].get("unit", ""), ""), fontsize=7)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=5, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"{dashboard['title']}: panels drawn from Prometheus query_range", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=6.0, help="length of the load (or of the window drawn)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--instances", type=int, default=2, help="model instances (engines) of llm")
    parser.add_argument("--tiny", action="store_true", help="tiny-llama instead of SmolLM2")
    parser.add_argument("--prometheus", help="draw from this running Prometheus instead of starting anything")
    parser.add_argument("--out", type=Path, default=Path("dashboard.png"))
    args = parser.parse_args(argv)
    if args.prometheus:
        print(render(Prometheus(args.prometheus), args.out, args.minutes))
        return 0
    work = Path(tempfile.mkdtemp(prefix="dashboard-"))
    source = ROOT / "model_repository"
    params = {"model": str(ROOT / "models" / "tiny-llama")} if args.tiny else {}
    repo = build_repository(source, work / "model_repository", params)

    def instances(config) -> None:
        for group in config.instance_group:
            group.count = args.instances

    copy_model(source, "llm", repo, params=params, edit=instances)
    with TritonServer(repo, log_path=work / "server.log", startup_timeout_s=600) as server:
        (port,) = free_ports(1)
        config = scrape_config(PROMETHEUS_YML, ALERTS, [f"127.0.0.1:{server.metrics_port}"], "2s", "5s")
        with run_prometheus(work / "prometheus", port, config) as prom:
            t0 = time.monotonic()
            counts = traffic(server.grpc_url, args.minutes * 60, args.concurrency)
            time.sleep(5)  # one more scrape after the last request
            print(f"load: {counts} in {time.monotonic() - t0:.0f} s (server log {work / 'server.log'})")
            print(render(prom, args.out, minutes=(time.monotonic() - t0) / 60 + 0.5))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
