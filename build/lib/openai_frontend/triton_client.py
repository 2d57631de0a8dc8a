"""The gRPC side: which models speak our contract, and one streaming call per generation."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, AsyncIterator

import grpc
from tritonclient.grpc.aio import InferenceServerClient
from tritonclient.utils import InferenceServerException

from .errors import APIError, from_triton, model_not_found
from .triton_io import Delta, ModelInfo, build_request, find_tokenizer_dir, make_infer_inputs, parse_response

log = logging.getLogger(__name__)

_DRAIN_TIMEOUT_S = 10.0


def _triton_error(e: Exception) -> APIError:
    if isinstance(e, grpc.RpcError):  # the aio stream raises grpc's own errors, not tritonclient's
        return from_triton(e.details() or str(e), str(e.code()))
    if isinstance(e, InferenceServerException):
        return from_triton(e.message() or str(e), e.status())
    return APIError(500, f"{type(e).__name__}: {e}")


def _is_final(result: Any) -> bool:
    # Triton marks each streamed response with triton_final_response; the finish_reason output is what
    # our contract promises, this flag is the fallback for a model that lacks it.
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


class TritonBackend:
    """Must be created inside the running event loop (grpc.aio binds its channel to it)."""

    def __init__(self, url: str, tokenizers: dict[str, str] | None = None,
                 model_repository: str | None = None, admin_key: str | None = None):
        self.client = InferenceServerClient(url)
        # `make serve` restricts the model-repository protocol (the index /v1/models lists) to an admin key;
        # Triton reads it from the header triton-grpc-protocol-<restricted key name>.
        self._index_headers = {"triton-grpc-protocol-admin-key": admin_key} if admin_key else None
        self.tokenizers = dict(tokenizers or {})
        # Our models resolve a relative model path against the model repository; other models may mean the
        # server's working directory or the model's own folder. Try each.
        self.search_roots = [Path.cwd()]
        if model_repository:
            self.search_roots = [Path(model_repository), Path(model_repository).parent, *self.search_roots]
        self._models: dict[str, ModelInfo] = {}
        self._lock = asyncio.Lock()
        self._drains: set[asyncio.Task] = set()  # finished streams being read to their end

    async def close(self) -> None:
        if self._drains:
            await asyncio.wait(set(self._drains), timeout=_DRAIN_TIMEOUT_S)
        await self.client.close()

    async def is_ready(self) -> bool:
        try:
            return await self.client.is_server_ready()
        except Exception:  # noqa: BLE001 - not ready is the answer to any failure here
            return False

    async def _config(self, name: str) -> dict | None:
        try:
            return (await self.client.get_model_config(name, as_json=True))["config"]
        except InferenceServerException as e:
            # Triton answers an unknown or unloaded model with UNAVAILABLE too; only its words tell that
            # apart from an unreachable server, which must stay a 503 rather than become a 404.
            msg = (e.message() or "").lower()
            if "unknown model" in msg or "not found" in msg or "not ready" in msg:
                return None
            raise _triton_error(e) from e

    def _roots(self, name: str) -> list[Path]:
        return self.search_roots + [r / name for r in self.search_roots]

    async def _load_info(self, name: str) -> ModelInfo | None:
        cfg = await self._config(name)
        if cfg is None:
            return None
        info = ModelInfo.from_config(cfg, self._roots(name))
        if name in self.tokenizers:
            info.tokenizer_dir = self.tokenizers[name]
        # An ensemble names no weights itself; its tokenizing step does.
        for step in cfg.get("ensemble_scheduling", {}).get("step", []):
            if info.tokenizer_dir is not None:
                break
            step_cfg = await self._config(step.get("model_name", ""))
            if step_cfg is not None:
                params = {k: v.get("string_value", "") for k, v in step_cfg.get("parameters", {}).items()}
                info.tokenizer_dir = find_tokenizer_dir(params, self._roots(step_cfg["name"]))
        return info

    async def model(self, name: str) -> ModelInfo:
        """The model's declared inputs and outputs, read once; 404 unless it speaks the contract."""
        info = self._models.get(name)
        if info is None:
            async with self._lock:
                info = self._models.get(name) or await self._load_info(name)
                if info is not None and info.speaks_contract:
                    self._models[name] = info
        if info is None or not info.speaks_contract:
            raise model_not_found(name)
        return info

    async def list_models(self) -> list[ModelInfo]:
        try:
            index = await self.client.get_model_repository_index(headers=self._index_headers, as_json=True)
        except InferenceServerException as e:
            raise _triton_error(e) from e
        names = sorted({m["name"] for m in index.get("models", []) if m.get("state") == "READY"})
        out = []
        for name in names:
            try:
                out.append(await self.model(name))
            except APIError:
                continue  # a model outside the contract (a tokenizer step of an ensemble, say)
        return out

    def forget(self, name: str) -> None:
        self._models.pop(name, None)

    async def generate(self, info: ModelInfo, prompt: str, sampling: dict[str, Any],
                       request_id: str) -> AsyncIterator[list[Delta]]:
        """Yield each response's deltas (one per sample) up to and including the final response, which finishes
        the last unfinished sample. Leaving early (client gone, consumer
        cancelled) cancels the gRPC call, which Triton turns into a cancelled request the engine drops at its
        next step. Use with contextlib.aclosing so that happens at once, not at garbage collection."""
        tensors, params = build_request(info, prompt, sampling)
        inputs = make_infer_inputs(tensors, info)

        async def requests() -> AsyncIterator[dict]:
            yield {"model_name": info.name, "inputs": inputs, "request_id": request_id,
                   "parameters": params or None}

        call = self.client.stream_infer(requests())
        finished = False  # the model sent its final response (data or error)
        done: set[int] = set()  # samples that finished
        try:
            async for result, error in call:
                if error is not None:  # an error response is the request's final one
                    finished = True
                    raise from_triton(error.message())
                deltas = parse_response(result.as_numpy)
                final = _is_final(result)
                for delta in deltas:
                    if delta.finish_reason is None and final:
                        delta.finish_reason = "stop"  # a model that does not say why it finished
                    if delta.finish_reason is not None:
                        done.add(delta.index)
                finished = final or len(done) == len(deltas)
                yield deltas
                if finished:
                    return
            raise APIError(500, f"model {info.name!r} closed the stream without a final response")
        except (grpc.RpcError, InferenceServerException) as e:
            finished = True  # the call itself failed: nothing left to cancel or drain
            err = _triton_error(e)
            if err.status == 404:
                self.forget(info.name)
            raise err from e
        finally:
            if finished:
                self._drain_later(call)
            else:
                call.cancel()  # the client left early: Triton cancels the request

    def _drain_later(self, call: Any) -> None:
        """Let a finished stream end by itself. Cancelling a stream after its final response makes Triton
        2.51 keep state for it until shutdown, where it stalls the unload for the whole exit timeout; so
        read the server's end of stream (it follows the final response at once) in the background, and
        cancel only if it does not come."""
        async def read_to_end() -> None:
            async for _ in call:
                pass

        async def drain() -> None:
            try:
                # wait_for, not asyncio.timeout: this runs on Python 3.10 in the GPU image (docker/Dockerfile.gpu)
                await asyncio.wait_for(read_to_end(), _DRAIN_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - timeout or a late error: the request is over either way
                call.cancel()

        task = asyncio.get_running_loop().create_task(drain())
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)
