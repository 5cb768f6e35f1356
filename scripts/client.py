"""Ask the served SSD ensemble for a completion over gRPC, streamed or in one piece
(the code lives in `saguaro.serving.client`)."""
import sys

from saguaro.serving.client import main

if __name__ == "__main__":
    sys.exit(main())
