#!/usr/bin/env python3
"""Turn a model repository's engines to the GPU, for docker/Dockerfile.gpu: in `llm` and `llm_dynamic`,
instance_group kind KIND_CPU -> KIND_GPU and the `device` parameter cpu -> cuda.

With KIND_GPU and no `gpus` list, Triton makes `count` instances on EVERY visible GPU and tells each its GPU
(model_instance_device_id), where the model puts its engine: count 1 serves each GPU of a host with one engine.

    python3 docker/gpu_config.py MODEL_REPOSITORY

Fails (exit 1) if a file does not have what it expects, so a changed config cannot slip through unconverted.
Plain text edits (the image's Python 3.10 has no protobuf text_format guaranteed); standard library only.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ENGINE_MODELS = ("llm", "llm_dynamic")
# One model's config: the instance kind, and the device parameter in either of the repository's two layouts
# (multi-line, or `parameters { key: "device" value: { string_value: "cpu" } }` on one line).
KIND = re.compile(r"\bkind:\s*KIND_CPU\b")
DEVICE = re.compile(r'(key:\s*"device"\s*value:\s*\{\s*string_value:\s*")cpu(")')


def convert(text: str, name: str) -> str:
    text, kinds = KIND.subn("kind: KIND_GPU", text)
    text, devices = DEVICE.subn(r"\1cuda\2", text)
    if kinds != 1 or devices != 1:
        raise ValueError(f"{name}/config.pbtxt: expected one KIND_CPU instance group and one device=\"cpu\" "
                         f"parameter, found {kinds} and {devices}")
    return text


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    repo = Path(argv[0])
    for name in ENGINE_MODELS:
        path = repo / name / "config.pbtxt"
        try:
            path.write_text(convert(path.read_text(), name))
        except (OSError, ValueError) as e:
            print(f"gpu_config: {e}", file=sys.stderr)
            return 1
        print(f"gpu_config: {path}: KIND_GPU, device=cuda")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
