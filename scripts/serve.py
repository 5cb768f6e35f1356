"""Serve SSD with a real Triton Inference Server on 127.0.0.1 until interrupted (the code lives in `saguaro.serving.launch`)."""
import sys

from saguaro.serving.launch import main

if __name__ == "__main__":
    sys.exit(main())
