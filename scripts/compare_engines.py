"""Two engine folders' forwards timed against each other (the code lives in `saguaro.benchmarks.compare_engines`)."""
import sys

from saguaro.benchmarks.compare_engines import main

if __name__ == "__main__":
    sys.exit(main())
