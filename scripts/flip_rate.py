"""Greedy output against autoregressive decoding over many prompts (the code lives in `saguaro.benchmarks.flip_rate`)."""
import sys

from saguaro.benchmarks.flip_rate import main

if __name__ == "__main__":
    sys.exit(main())
