"""One machine as a Dynamo cluster: the frontend and SSD workers on 127.0.0.1
(the code lives in `saguaro.serving.dynamo_cluster`)."""
import sys

from saguaro.serving.dynamo_cluster import main

if __name__ == "__main__":
    sys.exit(main())
