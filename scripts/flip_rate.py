"""Greedy output against autoregressive decoding over many prompts (the code lives in `saguaro.runtime.flip_rate`)."""
import sys

from saguaro.runtime.flip_rate import main

if __name__ == "__main__":
    sys.exit(main())
