"""The dynamic-batcher arm: Triton's dynamic batcher forms a batch, execute() runs it as one static batch
to completion on the same engine (EngineConfig.static_batching=True), streaming as it goes."""
