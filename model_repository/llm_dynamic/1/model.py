"""Triton model `llm_dynamic`: the dynamic batcher's batches run as static batches to completion.

Glue only: reads the internal interface (dynamic_arm.interface), hands the batch to dynamic_arm.BatchLine (a
worker thread runs one static batch at a time; execute() returns at once, see batch_line.py for why), and
exports the engine's metrics like `llm` does.
"""
import logging

import triton_python_backend_utils as pb_utils

from dynamic_arm.batch_line import BatchLine
from dynamic_arm.cancel_relay import CancelRelay, new_key
from dynamic_arm.interface import decode_request
from dynamic_arm.static_batch import BatchItem, StaticBatchRunner
from inflight.engine import LLMEngine
from inflight.fields import InvalidRequestError
from serving.health_probe import HealthProbe, discover_base_url
from serving.lifecycle import send_error
from serving.metrics_export import MetricsExporter
from serving.triton_glue import (TritonMetricSink, TritonTransport, metric_labels, streaming_model_options,
                                 place_engine, read_inputs, unreadable)

log = logging.getLogger("llm_dynamic")


class TritonPythonModel:
    def initialize(self, args):
        model_config, options = streaming_model_options(args)
        engine_config = options.engine
        if not engine_config.static_batching:
            raise pb_utils.TritonModelException("parameter static_batching=false is not allowed in llm_dynamic: "
                                                "each batch runs as one static batch; set it to true")
        if engine_config.max_num_seqs < model_config["max_batch_size"]:
            log.warning("max_num_seqs=%d < max_batch_size=%d: a full batch runs in several rounds",
                        engine_config.max_num_seqs, model_config["max_batch_size"])
        place_engine(args, model_config, options)  # this instance's GPU, or its share of the CPU cores
        log.info("loading %s with %s", engine_config.model, engine_config)
        self.engine = LLMEngine(engine_config)
        self.transport = TritonTransport(batched=True)
        runner = StaticBatchRunner(
            self.engine, self.transport,
            is_serving=HealthProbe.for_model(discover_base_url(), args["model_name"], str(args["model_version"])),
            relay=CancelRelay())  # postprocessing posts the rows whose client cancelled llm_ensemble
        self.sink, self.labels = TritonMetricSink(), metric_labels(args)
        self.exporter = MetricsExporter(self.engine.metrics.snapshot, self.sink, self.labels,
                                        options.metrics_interval_s)
        self.exporter.start()
        # Exact batch sizes for the A/B harness (the engine's inflight:batch_size histogram has coarser buckets).
        self._batches = {}
        self._requests = self.sink.counter("llm_dynamic_requests_total", "Requests run in static batches.",
                                           self.labels)
        self._largest = 0
        self._largest_seen = self.sink.gauge("llm_dynamic_max_batch_size_seen",
                                             "Largest static batch run.", self.labels)
        batching = model_config.get("dynamic_batching") or {}
        self.line = BatchLine(runner, model_config["max_batch_size"],
                              [int(p) for p in batching.get("preferred_batch_size", [])], self._record_batch)

    def execute(self, requests):
        items = []
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs, _ = read_inputs(request, ["input_ids", "request_config"])
                if len(inputs) < 2:
                    raise InvalidRequestError("input_ids and request_config are required: allowed what the "
                                              "preprocessing step emits")
                req, arrival = decode_request(inputs["request_config"].reshape(-1)[0])
                prompt_ids = [int(t) for t in inputs["input_ids"].reshape(-1)]
            except Exception as e:  # noqa: BLE001 - this request only; the rest of the batch proceeds
                send_error(self.transport, sender, unreadable(e))
                continue
            items.append(BatchItem(sender, request.request_id(), prompt_ids, req, arrival, row_key=new_key()))
        self.line.submit(items)
        return None

    def _record_batch(self, size: int) -> None:
        """As each static batch starts (on the line's thread): its size in /metrics."""
        counter = self._batches.get(size)
        if counter is None:
            counter = self._batches[size] = self.sink.counter(
                "llm_dynamic_batches_total", "Static batches run, by batch size.",
                {**self.labels, "batch_size": str(size)})
        counter.increment(1)
        self._requests.increment(size)
        if size > self._largest:
            self._largest = size
            self._largest_seen.set(size)

    def finalize(self):
        self.line.close()
        self.exporter.stop()
        log.info("finalize: done")
