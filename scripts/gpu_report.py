"""The JSON of figures of a `scripts/gpu_check.sh` run (the code lives in `saguaro.benchmarks.gpu_report`)."""
import sys

from saguaro.benchmarks.gpu_report import main

if __name__ == "__main__":
    sys.exit(main())
