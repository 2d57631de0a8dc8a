"""Where one model instance's engine runs. Triton makes one python-backend process per model instance
(`instance_group { count: N }`), and each holds its own engine: on CUDA, the GPU Triton assigned to the
instance; on the CPU, a share of the cores. Pure functions; serving.triton_glue applies them."""
from __future__ import annotations

import os
from typing import Mapping


def engine_device(device: str, instance_kind: str, device_id: int) -> str:
    """`cuda` on a KIND_GPU instance becomes `cuda:<device_id>`, the GPU Triton gave this instance (with
    `count: 1` and no `gpus` list, one instance per visible GPU). An explicit `cuda:K`, or the CPU, stays."""
    if device == "cuda" and instance_kind.upper() in ("GPU", "KIND_GPU"):
        return f"cuda:{device_id}"
    return device


def cpu_instances(model_config: Mapping) -> int:
    """How many CPU instances of this model Triton makes (the config as Triton passes it to initialize)."""
    return sum(int(g.get("count", 1)) for g in model_config.get("instance_group", [])
               if g.get("kind", "KIND_CPU") == "KIND_CPU")


def cpu_threads(num_cores: int, num_instances: int, environ: Mapping[str, str] = os.environ) -> int | None:
    """Torch threads for one of num_instances CPU engines sharing num_cores: an equal share, at least 1.
    None (leave torch's default) for a single instance, or when OMP_NUM_THREADS says what the operator wants."""
    if num_instances <= 1 or environ.get("OMP_NUM_THREADS"):
        return None
    return max(1, num_cores // num_instances)
