"""Import a GGUF file as a Hugging Face checkpoint folder and check it (the code lives in `saguaro.modelmaker.import_cli`)."""
import sys

from saguaro.modelmaker.import_cli import main

if __name__ == "__main__":
    sys.exit(main())
