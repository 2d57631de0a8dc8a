"""Run the peers' own client scripts and CI tests against this server, changing only the URL and model name.

    .venv/bin/python -m perf.peers.peer_clients --vllm PATH --trtllm PATH --out perf/results/peer-clients

PATH is a checkout of triton-inference-server/vllm_backend, and of tensorrtllm_backend at its last commit that
still has inflight_batcher_llm/client and tools/ (6a749f5~1). Nothing of theirs is kept here: each run copies
their files into a temporary folder, rewrites the address (localhost:8000/8001/8002) and the model name
(vllm_opt -> llm), and runs them with this venv's Python. The vLLM tests run against `llm` configured with
vLLM's defaults (default_max_tokens 16, default_exclude_input_in_output false), alone in its repository as
their CI has it; the TensorRT-LLM scripts against `make serve`'s repository (`ensemble`, `ensemble_unary`).
Writes report.md and summary.json: per script, its command, exit status and pytest's counts.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from server_harness.repository import copy_model
from server_harness.server import TritonServer

ROOT = Path(__file__).resolve().parents[2]
REPO = ROOT / "model_repository"
SMOL = ROOT / "models" / "SmolLM2-135M-Instruct"

# (name, folder in their repo, command run there, timeout s). {py} is this venv's Python.
VLLM_RUNS = [
    ("samples/client.py", "samples", "{py} client.py -u {grpc} -m llm", 600),
    ("L0_backend_vllm/vllm_backend", "ci/L0_backend_vllm/vllm_backend", "{py} vllm_backend_test.py -v", 1200),
    ("L0_backend_vllm/enabled_stream", "ci/L0_backend_vllm/enabled_stream",
     "{py} enabled_stream_test.py -v", 600),
    ("L0_backend_vllm/request_cancellation", "ci/L0_backend_vllm/request_cancellation",
     "{py} request_cancellation_test.py -v", 600),
    ("L0_backend_vllm/metrics_test", "ci/L0_backend_vllm/metrics_test", "{py} vllm_metrics_test.py -v", 600),
    ("L0_check_health_vllm", "ci/L0_check_health_vllm",
     "{py} -m pytest -q check_health_test.py -k test_vllm_is_healthy", 600),
    ("L0_additional_outputs_vllm", "ci/L0_additional_outputs_vllm",
     "{py} -m pytest -q additional_outputs_test.py", 5400),
]
TRTLLM_RUNS = [
    ("end_to_end_grpc_client.py", "inflight_batcher_llm/client",
     "{py} end_to_end_grpc_client.py -u {grpc} -p 'The capital of France is' -o 20", 300),
    ("end_to_end_grpc_client.py --streaming", "inflight_batcher_llm/client",
     "{py} end_to_end_grpc_client.py -u {grpc} -p 'The capital of France is' -o 20 --streaming", 300),
    ("end_to_end_grpc_client.py --batch-inputs --streaming", "inflight_batcher_llm/client",
     """{py} end_to_end_grpc_client.py -u {grpc} -p '["The capital of France is", "Once upon a time"]' -o 12 """
     "--batch-inputs --streaming", 300),
    ("end_to_end_test.py", "tools/inflight_batcher_llm",
     "{py} end_to_end_test.py -u {http} --max-input-len 500 --dataset {data} --model-name ensemble_unary", 1800),
]


# Their model names -> ours. TensorRT-LLM's inner models keep their interfaces under our names (ours
# `preprocessing`/`postprocessing` are the dynamic arm's), and its unary callers get the non-decoupled model.
MODEL_NAMES = {'"vllm_opt"': '"llm"', "'preprocessing'": "'trtllm_preprocessing'",
               '"postprocessing"': '"trtllm_postprocessing"',
               'model_name = "ensemble"': 'model_name = "ensemble_unary"'}


def localize(checkout: Path, folder: str, work: Path, server: TritonServer) -> Path:
    """Their checkout's top folder holding `folder` (tests import siblings such as ci/common), copied, with our
    address and model name in place of theirs; returns the copy of `folder`."""
    top = folder.split("/")[0]
    dest = work / checkout.name / top
    if not dest.exists():
        shutil.copytree(checkout / top, dest)
        http, grpc = server.http_url.split(":")[1], server.grpc_url.split(":")[1]
        metrics_port = server.metrics_url.split(":")[2].split("/")[0]
        ports = {"8000": http, "8001": grpc, "8002": metrics_port}
        for f in dest.rglob("*.py"):
            text = re.sub(r":(800[012])\b", lambda m: ":" + ports[m.group(1)], f.read_text())
            for theirs, ours in MODEL_NAMES.items():
                text = text.replace(theirs, ours)
            f.write_text(text)
    return work / checkout.name / folder


def run(name: str, folder: Path, command: str, timeout_s: int, server: TritonServer, data: Path,
        select: str | None = None) -> dict:
    cmd = command.format(py=sys.executable, grpc=server.grpc_url, http=server.http_url, data=data)
    if select:
        cmd += f" -k '{select}'"
    t0 = time.monotonic()
    try:
        done = subprocess.run(["bash", "-c", cmd], cwd=folder, capture_output=True, text=True, timeout=timeout_s)
        code, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        code, out = "timeout", (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else ""
    counts = dict((k, int(v)) for v, k in re.findall(r"(\d+) (passed|failed|error|skipped|deselected)", out))
    ran = re.search(r"Ran (\d+) tests?", out)  # unittest's own summary
    if ran:
        bad = re.search(r"FAILED \((.*)\)", out)
        counts = {"ran": int(ran.group(1)), **({k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", bad.group(1))}
                                                if bad else {"failures": 0})}
    print(f"[peers] {name}: exit {code}, {counts or ''} ({time.monotonic() - t0:.0f} s)", flush=True)
    return {"name": name, "command": cmd, "exit": code, "counts": counts, "seconds": round(time.monotonic() - t0),
            "tail": out[-2500:]}


def wanted(name: str, args: argparse.Namespace) -> bool:
    return (not args.only or args.only in name) and not (args.skip and args.skip in name)


def serve(repo: Path, work: Path, extra: list[str] | None = None) -> TritonServer:
    return TritonServer(repo, ["--model-control-mode=explicit", "--load-model=*", *(extra or [])],
                        log_path=work / f"{repo.name}.log", startup_timeout_s=600)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm", type=Path, help="checkout of vllm_backend")
    ap.add_argument("--trtllm", type=Path, help="checkout of tensorrtllm_backend (6a749f5~1)")
    ap.add_argument("--out", type=Path, default=ROOT / "perf" / "results" / "peer-clients")
    ap.add_argument("--only", help="run only the scripts whose name contains this")
    ap.add_argument("--skip", help="skip the scripts whose name contains this")
    ap.add_argument("--arm", choices=("inflight", "dynamic"), default="inflight",
                    help="the vLLM tests' `llm`: the in-flight model, or the dynamic-batcher arm by the config swap")
    ap.add_argument("-k", dest="select", help="pytest -k expression for the additional-outputs test (a subset)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="peers-"))
    results = []
    if args.vllm:
        repo = work / "vllm_repo"
        vllm_defaults = {"default_max_tokens": 16, "default_exclude_input_in_output": "false"}
        extra = []
        if args.arm == "inflight":
            copy_model(REPO, "llm", repo, params={"model": SMOL, **vllm_defaults})
        else:  # `llm` served by preprocessing -> llm_dynamic -> postprocessing (--model-config-name=dynamic)
            copy_model(REPO, "llm", repo, params={"model": SMOL})
            copy_model(REPO, "llm_dynamic", repo, params={"model": SMOL, "default_max_tokens": 16})
            copy_model(REPO, "preprocessing", repo,
                       params={"model": SMOL, "default_exclude_input_in_output": "false"})
            copy_model(REPO, "postprocessing", repo)
            extra = ["--model-config-name=dynamic"]
        with serve(repo, work, extra) as server:
            for name, folder, command, timeout_s in VLLM_RUNS:
                if wanted(name, args):
                    select = args.select if name == "L0_additional_outputs_vllm" else None
                    results.append(run(name, localize(args.vllm, folder, work / "vllm", server), command, timeout_s,
                                       server, Path(), select))
    if args.trtllm:
        repo = work / "trtllm_repo"
        copy_model(REPO, "llm", repo, params={"model": SMOL})
        for name in ("ensemble", "ensemble_unary"):
            copy_model(REPO, name, repo)
        for name in ("trtllm_preprocessing", "tensorrt_llm", "trtllm_postprocessing"):
            copy_model(REPO, name, repo, params={"model": SMOL})
        data = args.trtllm / "ci" / "L0_backend_trtllm" / "simple_data.json"
        with serve(repo, work) as server:
            for name, folder, command, timeout_s in TRTLLM_RUNS:
                if wanted(name, args):
                    results.append(run(name, localize(args.trtllm, folder, work / "trtllm", server), command,
                                       timeout_s, server, data))
    (args.out / "summary.json").write_text(json.dumps(results, indent=1))
    lines = ["# The peers' clients against this server", "", "| script | exit | pytest counts | seconds |",
             "|---|---|---|---:|"]
    lines += [f"| {r['name']} | {r['exit']} | {r['counts'] or '-'} | {r['seconds']} |" for r in results]
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    print(f"[peers] report {args.out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
