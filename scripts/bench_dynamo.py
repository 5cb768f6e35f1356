"""Per-worker throughput behind Dynamo's frontend at several stream counts, and the projection
to N workers (the code lives in `saguaro.benchmarks.dynamo_bench`)."""
import sys

from saguaro.benchmarks.dynamo_bench import main

if __name__ == "__main__":
    sys.exit(main())
