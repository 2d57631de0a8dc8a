"""Build a model repository holding both arms (llm, and llm_ensemble = preprocessing -> llm_dynamic ->
postprocessing) for one tritonserver: configs copied with parameter overrides, model.py files symlinked
(they find backend_src through the link), so a test can point both arms at models/tiny-llama."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Mapping

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "model_repository"
INFLIGHT_MODEL = "llm"
DYNAMIC_MODEL = "llm_ensemble"
ARM_MODELS = ("llm", "preprocessing", "llm_dynamic", "postprocessing", "llm_ensemble")
ENGINE_MODELS = ("llm", "llm_dynamic")  # the two engines: the same engine options go to both
TOKENIZER_MODELS = ("preprocessing",)


def load_config(path: Path) -> mc.ModelConfig:
    return text_format.Parse(path.read_text(), mc.ModelConfig())


def build_repository(dest: Path, engine_params: Mapping[str, str] | None = None, max_batch_size: int | None = None,
                     max_queue_delay_us: int | None = None, source: Path = SOURCE) -> Path:
    """Write the five models under dest. engine_params override parameters the engines' configs already have
    (model also goes to preprocessing, whose tokenizer must match); max_batch_size / max_queue_delay_us
    override llm_dynamic's dynamic batcher (preferred sizes above the new maximum are dropped)."""
    engine_params = dict(engine_params or {})
    dest.mkdir(parents=True, exist_ok=True)
    for name in ARM_MODELS:
        config = load_config(source / name / "config.pbtxt")
        params = engine_params if name in ENGINE_MODELS else (
            {k: v for k, v in engine_params.items() if k == "model"} if name in TOKENIZER_MODELS else {})
        for key, value in params.items():
            if key not in config.parameters:
                raise ValueError(f"parameter {key}={value!r} is not in {name}'s config: allowed "
                                 f"{', '.join(sorted(config.parameters))}")
            config.parameters[key].string_value = str(value)
        if name == "llm_dynamic":
            if max_batch_size is not None:
                config.max_batch_size = max_batch_size
                kept = [s for s in config.dynamic_batching.preferred_batch_size if s <= max_batch_size]
                del config.dynamic_batching.preferred_batch_size[:]
                config.dynamic_batching.preferred_batch_size.extend(kept or [max_batch_size])
            if max_queue_delay_us is not None:
                config.dynamic_batching.max_queue_delay_microseconds = max_queue_delay_us
        model_dir = dest / name
        if model_dir.exists():
            shutil.rmtree(model_dir)
        (model_dir / "1").mkdir(parents=True)
        (model_dir / "config.pbtxt").write_text(text_format.MessageToString(config))
        if (source / name / "configs").is_dir():  # alternative configs (--model-config-name) go along as they are
            shutil.copytree(source / name / "configs", model_dir / "configs")
        source_py = source / name / "1" / "model.py"
        if source_py.exists():
            (model_dir / "1" / "model.py").symlink_to(source_py.resolve())
    return dest
