"""The loops: the decoding round over a batch, its draft side, the scheduler, the TensorRT-LLM request loop."""
