"""Plot speed-up against acceptance from bench.py --json files (`saguaro.benchmarks.speedup_plot`)."""
import sys

from saguaro.benchmarks.speedup_plot import main

if __name__ == "__main__":
    sys.exit(main())
