"""Triton model `llm_dynamic`: the dynamic batcher's batch runs as one static batch to completion.

Glue only: reads the internal interface (backend_src/dynamic_arm/interface.py), hands the batch to
StaticBatchRunner (which blocks until every request has its final), records the batch sizes it saw.
"""
import json
import logging
from pathlib import Path

import triton_python_backend_utils as pb_utils

from dynamic_arm.interface import decode_request
from dynamic_arm.static_batch import BatchItem, StaticBatchRunner
from inflight.engine import LLMEngine
from inflight.sequence import InvalidRequestError
from serving.errors import RequestError
from serving.options import flatten_triton_parameters, parse_model_parameters


log = logging.getLogger("llm_dynamic")


class _BatchedTransport:
    """pb_utils senders; every output gets the leading batch dimension of 1 that max_batch_size > 0 asks."""

    def send(self, sender, outputs, final: bool, error: RequestError | None = None) -> None:
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        if error is not None:
            code = getattr(pb_utils.TritonError, error.code, None)
            triton_error = (pb_utils.TritonError(error.message, code) if code is not None
                            else pb_utils.TritonError(f"{error.code}: {error.message}"))
            response = pb_utils.InferenceResponse(output_tensors=[], error=triton_error)
        else:
            response = pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor(name, array[None, ...]) for name, array in outputs.items()])
        sender.send(response, flags=flags)

    def is_cancelled(self, sender) -> bool:
        return sender.is_cancelled()


def _is_model_ready(name: str, version: str) -> bool:
    """False once the server stops or unloads us (2.51 raises "not ready" while stopping)."""
    try:
        return bool(pb_utils.is_model_ready(model_name=name, model_version=version))
    except pb_utils.TritonModelException as e:
        if "not ready" in str(e).lower():
            return False
        raise


class TritonPythonModel:
    def initialize(self, args):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("model_transaction_policy.decoupled=false is not allowed: "
                                                "this model streams; set it to true")
        options = parse_model_parameters(flatten_triton_parameters(model_config), Path(args["model_repository"]).parent)
        engine_config = options.engine
        if not engine_config.static_batching:
            raise pb_utils.TritonModelException("parameter static_batching=false is not allowed in llm_dynamic: "
                                                "each batch runs as one static batch; set it to true")
        if engine_config.max_num_seqs < model_config["max_batch_size"]:
            log.warning("max_num_seqs=%d < max_batch_size=%d: a full batch runs in several rounds",
                        engine_config.max_num_seqs, model_config["max_batch_size"])
        log.info("loading %s with %s", engine_config.model, engine_config)
        self.engine = LLMEngine(engine_config)
        name, version = args["model_name"], str(args["model_version"])
        self.runner = StaticBatchRunner(self.engine, _BatchedTransport(),
                                        is_serving=lambda: _is_model_ready(name, version))
        # Touched only from execute (one thread): the python backend aborts on concurrent metric calls.
        # The families are kept alive here: a Metric whose family was collected refuses to update.
        self._labels = {"model": name, "version": version}
        self._families = {
            "batches": pb_utils.MetricFamily(name="llm_dynamic_batches_total", kind=pb_utils.MetricFamily.COUNTER,
                                             description="Batches execute() received, by batch size."),
            "requests": pb_utils.MetricFamily(name="llm_dynamic_requests_total", kind=pb_utils.MetricFamily.COUNTER,
                                              description="Requests execute() received in batches."),
            "largest": pb_utils.MetricFamily(name="llm_dynamic_max_batch_size_seen", kind=pb_utils.MetricFamily.GAUGE,
                                             description="Largest batch execute() has received."),
        }
        self._requests = self._families["requests"].Metric(labels=self._labels)
        self._max_seen = self._families["largest"].Metric(labels=self._labels)
        self._by_size = {}
        self._largest = 0

    def execute(self, requests):
        try:
            self._record_batch(len(requests))
        except Exception:  # noqa: BLE001 - metrics must never cost a batch
            log.exception("recording the batch size failed")
        items = []
        for request in requests:
            sender = request.get_response_sender()
            try:
                ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
                config = pb_utils.get_input_tensor_by_name(request, "request_config")
                if ids is None or config is None:
                    raise InvalidRequestError("input_ids and request_config are required: allowed what the "
                                              "preprocessing step emits")
                req = decode_request(config.as_numpy().reshape(-1)[0])
                prompt_ids = [int(t) for t in ids.as_numpy().reshape(-1)]
            except Exception as e:  # noqa: BLE001 - this request only; the rest of the batch proceeds
                _BatchedTransport().send(sender, None, True, RequestError(f"unreadable request: {e}", "INVALID_ARG"))
                continue
            items.append(BatchItem(sender, request.request_id(), prompt_ids, req))
        try:
            stats = self.runner.run(items)
        except Exception:  # noqa: BLE001 - the runner already sent every request its final
            log.exception("static batch failed")
            return None
        log.info("batch of %d requests (%d admitted): %d steps in %.2f s (engine %.2f s, sending %.2f s, "
                 "cancel checks %.2f s)", len(requests), stats.num_admitted, stats.num_steps, stats.seconds,
                 stats.step_s, stats.send_s, stats.poll_s)
        return None

    def _record_batch(self, size: int) -> None:
        metric = self._by_size.get(size)
        if metric is None:
            metric = self._by_size[size] = self._families["batches"].Metric(
                labels={**self._labels, "batch_size": str(size)})
        metric.increment(1)
        self._requests.increment(size)
        if size > self._largest:
            self._largest = size
            self._max_seen.set(size)

    def finalize(self):
        log.info("finalize: largest batch seen %d", self._largest)
