"""OpenAI-compatible HTTP API in front of tritonserver: OpenAI requests in, streaming gRPC calls out."""
