"""docker/prometheus/alerts.yml under `promtool test rules`: synthetic series with known rates, so each rule's
threshold is checked where it matters (the live dashboard test only shows that every expression has data)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "docker" / "prometheus" / "alerts.yml"
TARGET = "server:8002"


def counter(name: str, model: str, per_minute: int, **labels: str) -> dict:
    """A counter growing by per_minute each minute for 20 minutes."""
    extra = "".join(f', {k}="{v}"' for k, v in labels.items())
    return {"series": f'{name}{{instance="{TARGET}", model="{model}"{extra}}}', "values": f"0+{per_minute}x20"}


def requests(model: str, succeeded: int, failures_counted: int) -> list[dict]:
    return [counter("nv_inference_request_success", model, succeeded),
            counter("nv_inference_request_failure", model, failures_counted, reason="OTHER")]


def failing(model: str, percent: str) -> dict:
    return {"exp_labels": {"severity": "warning", "instance": TARGET, "model": model},
            "exp_annotations": {"summary": f"{model} on {TARGET}: {percent} of requests fail"}}


def run_promtool(tmp_path: Path, tests: list[dict]) -> subprocess.CompletedProcess:
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: run scripts/setup_docker.sh"
    spec = tmp_path / "alerts_test.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [str(ALERTS)], "evaluation_interval": "1m", "tests": tests}))
    return subprocess.run([promtool, "test", "rules", str(spec)], capture_output=True, text=True, timeout=60)


def failures_at(series: list[dict], expected: list[dict]) -> dict:
    return {"interval": "1m", "input_series": series,
            "alert_rule_test": [{"eval_time": "15m", "alertname": "LLMTritonRequestFailures", "exp_alerts": expected}]}


def test_request_failures_count_each_failed_ensemble_request_once(tmp_path):
    """Triton 2.51 adds 2 to llm_ensemble's failure counter per failed request (measured: 14 refused requests,
    +28). 4 refused of 100 is 4%: quiet; 10 of 100 is 10%: the alert. `llm` counts once: 6 of 100 alerts."""
    done = run_promtool(tmp_path, [
        failures_at(requests("llm_ensemble", succeeded=96, failures_counted=8), []),
        failures_at(requests("llm_ensemble", succeeded=90, failures_counted=20), [failing("llm_ensemble", "10%")]),
        failures_at(requests("llm", succeeded=94, failures_counted=6), [failing("llm", "6%")]),
        failures_at(requests("llm", succeeded=96, failures_counted=4), []),
    ])
    assert done.returncode == 0, done.stdout + done.stderr
