"""The plugins' ops per call, reference against kernels (the code lives in `saguaro.benchmarks.kernel_bench`)."""
import sys

from saguaro.benchmarks.kernel_bench import main

if __name__ == "__main__":
    sys.exit(main())
