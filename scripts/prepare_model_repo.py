"""Fill the Triton model repository templates into a run folder (the code lives in `saguaro.serving.model_repo`)."""
import sys

from saguaro.serving.model_repo import main

if __name__ == "__main__":
    sys.exit(main())
