"""Build model repositories for tests and benchmarks from the project's own model_repository/.

Each model is copied (config.pbtxt rewritten through protobuf, model.py and alternative configs copied), so a
built repository is as relocatable as the original: it needs the installed packages, nothing else. A
relative `model` parameter is made absolute against the source repository, so the copy still finds the
same model folder wherever it is written.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable, Iterable, Mapping

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

INFLIGHT_MODEL = "llm"
DYNAMIC_MODEL = "llm_ensemble"
ITERATIVE_MODEL = "llm_iterative"
ARM_MODELS = ("llm", "preprocessing", "llm_dynamic", "postprocessing", "llm_ensemble")
ENGINE_MODELS = ("llm", "llm_dynamic", "llm_iterative")  # the engines: the same engine options go to each
TOKENIZER_MODELS = ("preprocessing",)  # they take only the `model` option (their tokenizer must match)


def load_config(path: Path) -> mc.ModelConfig:
    return text_format.Parse(path.read_text(), mc.ModelConfig())



def instances(count: int) -> Callable[[mc.ModelConfig], None]:
    """A copy_model `edit`: every instance group of the model gets `count` instances (engines)."""
    def edit(config: mc.ModelConfig) -> None:
        for group in config.instance_group:
            group.count = count
    return edit

def _set_parameters(config: mc.ModelConfig, source: Path, params: Mapping[str, object] | None) -> None:
    """Set the given parameters, and make a relative `model` absolute against the source repository."""
    for key, value in (params or {}).items():
        config.parameters[key].string_value = str(value)
    if "model" in config.parameters:
        model_path = Path(config.parameters["model"].string_value)
        if not model_path.is_absolute():
            config.parameters["model"].string_value = str((source / model_path).resolve())


def copy_model(source: Path, name: str, dest: Path, *, as_name: str | None = None,
               params: Mapping[str, object] | None = None,
               edit: Callable[[mc.ModelConfig], None] | None = None, files: Iterable[Path] = ()) -> Path:
    """Copy model `name` of the repository `source` into the repository `dest` (as `as_name`).

    params override parameters the config already has (a typo fails here, not as a load error inside the
    server); `edit` may change anything else in the parsed config. `files` go beside model.py, a folder the
    Python backend puts on the model's sys.path (the fault tests bring their request hook module so)."""
    config = load_config(source / name / "config.pbtxt")
    for key, value in (params or {}).items():
        if key not in config.parameters:
            raise KeyError(f"parameter {key}={value!r} is not in {name}'s config: allowed "
                           f"{', '.join(sorted(config.parameters))}")
    _set_parameters(config, source, params)
    if as_name:
        config.name = as_name
    if edit is not None:
        edit(config)
    model_dir = dest / (as_name or name)
    if model_dir.exists():
        shutil.rmtree(model_dir)
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(text_format.MessageToString(config))
    if (source / name / "configs").is_dir():  # alternative configs (--model-config-name), the same parameters set
        (model_dir / "configs").mkdir()
        for path in sorted((source / name / "configs").glob("*.pbtxt")):
            alternative = load_config(path)
            given = {k: v for k, v in (params or {}).items() if k in alternative.parameters}
            _set_parameters(alternative, source, given)
            (model_dir / "configs" / path.name).write_text(text_format.MessageToString(alternative))
    # model.py and any other model file (llm/1/iterative.py, a link, for --model-config-name=iterative), as files
    for path in sorted((source / name / "1").glob("*.py")):
        shutil.copy(path, model_dir / "1" / path.name)
    for path in files:
        shutil.copy(path, model_dir / "1" / Path(path).name)
    return model_dir


def make_model_repository(source: Path, dest: Path, models: Mapping[str, Mapping[str, object]],
                          files: Iterable[Path] = ()) -> Path:
    """One copy of the in-flight model `llm` per entry: served name -> {config parameter: value}; `files` go
    beside every copy's model.py (see copy_model)."""
    files = tuple(files)
    for as_name, params in models.items():
        copy_model(source, INFLIGHT_MODEL, dest, as_name=as_name, params=params, files=files)
    return dest


def build_repository(source: Path, dest: Path, engine_params: Mapping[str, object] | None = None,
                     max_batch_size: int | None = None, max_queue_delay_us: int | None = None,
                     iterative: bool = False) -> Path:
    """The A/B arms under dest: llm, llm_ensemble (= preprocessing -> llm_dynamic -> postprocessing) and, with
    `iterative`, llm_iterative (Triton's iterative sequence batcher).

    engine_params go to every engine (`model` to preprocessing too); max_batch_size / max_queue_delay_us
    override llm_dynamic's dynamic batcher (preferred sizes above the new maximum are dropped)."""
    engine_params = dict(engine_params or {})
    dest.mkdir(parents=True, exist_ok=True)

    def batcher(config: mc.ModelConfig) -> None:
        if max_batch_size is not None:
            config.max_batch_size = max_batch_size
            kept = [s for s in config.dynamic_batching.preferred_batch_size if s <= max_batch_size]
            del config.dynamic_batching.preferred_batch_size[:]
            config.dynamic_batching.preferred_batch_size.extend(kept or [max_batch_size])
        if max_queue_delay_us is not None:
            config.dynamic_batching.max_queue_delay_microseconds = max_queue_delay_us

    for name in ARM_MODELS + ((ITERATIVE_MODEL,) if iterative else ()):
        if name in ENGINE_MODELS:
            params = engine_params
        elif name in TOKENIZER_MODELS:
            params = {k: v for k, v in engine_params.items() if k == "model"}
        else:
            params = {}
        copy_model(source, name, dest, params=params, edit=batcher if name == "llm_dynamic" else None)
    return dest
