"""Serving SSD with Triton Inference Server: request parsing, the model-repository filler,
the server launcher and a gRPC client. The Triton models themselves are in `model_repo/`."""
