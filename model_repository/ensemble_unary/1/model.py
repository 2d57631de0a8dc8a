"""Triton model `ensemble_unary`: `ensemble` without decoupling, one response per request, for plain `infer`
clients (HTTP and gRPC), which Triton refuses on a decoupled model. Glue only: serving.bls_front."""
import json

from serving.bls_front import BlsFront


class TritonPythonModel:
    def initialize(self, args):
        self.front = BlsFront(json.loads(args["model_config"]))

    def execute(self, requests):
        return self.front.execute(requests)
