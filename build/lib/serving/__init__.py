"""Serving glue that needs no Triton: the request contract, model parameters and the in-flight frontend."""
