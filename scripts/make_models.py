"""Make the target/draft model pair the runtime, tests and benchmarks use (the code lives in `saguaro.modelmaker.cli`)."""
import sys

from saguaro.modelmaker.cli import main

if __name__ == "__main__":
    sys.exit(main())
