"""serving.placement: each model instance's engine gets its own GPU, or its share of the CPU cores."""
from __future__ import annotations

from serving.placement import cpu_instances, cpu_threads, engine_device


def test_a_gpu_instance_runs_on_the_gpu_triton_gave_it():
    assert engine_device("cuda", "GPU", 3) == "cuda:3"
    assert engine_device("cuda", "KIND_GPU", 0) == "cuda:0"
    assert engine_device("cuda:1", "GPU", 3) == "cuda:1"  # an explicit choice stays
    assert engine_device("cpu", "CPU", 0) == "cpu"
    assert engine_device("cuda", "CPU", 0) == "cuda"  # KIND_CPU instance asked for cuda: torch's current device


def test_cpu_instances_share_the_cores():
    config = {"instance_group": [{"count": 2, "kind": "KIND_CPU"}, {"count": 1, "kind": "KIND_GPU"}]}
    assert cpu_instances(config) == 2
    assert cpu_threads(16, 2, environ={}) == 8
    assert cpu_threads(2, 2, environ={}) == 1
    assert cpu_threads(2, 4, environ={}) == 1  # never 0
    assert cpu_threads(16, 1, environ={}) is None  # one instance: torch's default (all cores)
    assert cpu_threads(16, 2, environ={"OMP_NUM_THREADS": "3"}) is None  # the operator's setting wins
