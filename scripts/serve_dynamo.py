"""Serve an engine folder as an SSD worker behind NVIDIA Dynamo's frontend (the code lives in `saguaro.serving.dynamo_worker`)."""
import sys

from saguaro.serving.dynamo_worker import main

if __name__ == "__main__":
    sys.exit(main())
