"""Plot speed-up against acceptance from bench.py --json files (`saguaro.runtime.speedup_plot`)."""
import sys

from saguaro.runtime.speedup_plot import main

if __name__ == "__main__":
    sys.exit(main())
