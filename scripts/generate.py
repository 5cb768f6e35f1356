"""Generate text with a draft/target pair: autoregressive, speculative or SSD decoding
(the code lives in `saguaro.runtime.cli`)."""
import sys

from saguaro.runtime.cli import main

if __name__ == "__main__":
    sys.exit(main())
