"""Triton model `ensemble`: TensorRT-LLM's client surface (batch dimensions, batch_index, its input names) over
the in-flight model `llm`, through BLS; decoupled, so it streams. Glue only: serving.bls_front does the work."""
import json

from serving.bls_front import BlsFront


class TritonPythonModel:
    def initialize(self, args):
        self.front = BlsFront(json.loads(args["model_config"]))

    def execute(self, requests):
        return self.front.execute(requests)
