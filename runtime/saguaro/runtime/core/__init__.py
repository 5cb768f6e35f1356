"""Core contracts every layer shares: engine protocols, sampling, decoding options, statistics."""
