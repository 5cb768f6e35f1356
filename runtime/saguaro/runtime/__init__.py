"""Saguaro-TRT runtime: engines behind one protocol, sampling, and the decoding loops
(autoregressive, speculative, speculative-speculative) with drafting overlapped."""
