"""The server under load, modes side by side (the code lives in `saguaro.benchmarks.load_bench`)."""
import sys

from saguaro.benchmarks.load_bench import main

if __name__ == "__main__":
    sys.exit(main())
