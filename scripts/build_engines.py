"""Compile a draft and a target checkpoint into an engine directory (the code lives in `saguaro.compiler.cli`)."""
import sys

from saguaro.compiler.cli import main

if __name__ == "__main__":
    sys.exit(main())
