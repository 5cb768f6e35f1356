"""Benchmark the decoding modes side by side on one pair (the code lives in `saguaro.benchmarks.bench`)."""
import sys

from saguaro.benchmarks.bench import main

if __name__ == "__main__":
    sys.exit(main())
