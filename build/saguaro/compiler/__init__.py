"""Compiling a draft/target checkpoint pair into engines: YAML build config, ONNX export with
the plugin nodes, ONNX Runtime and TensorRT builders. Writes the manifest the runtime reads."""
