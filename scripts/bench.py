"""Benchmark the decoding modes side by side on one pair (the code lives in `saguaro.runtime.bench`)."""
import sys

from saguaro.runtime.bench import main

if __name__ == "__main__":
    sys.exit(main())
