import os
from pathlib import Path

import pytest

# OpenAI Triton reads this once, at its first import: kernels under test then run on the
# CPU interpreter, whichever test module happens to import triton first.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the tiny model pair (`target/`, `draft/`, `pair.json`), made once
    per test session (about half a minute)."""
    # Imported here so collecting tests that never use the pair stays fast.
    from saguaro.modelmaker.model_pair import make_pair

    out_dir = tmp_path_factory.mktemp("models")
    make_pair("tiny", out_dir, progress=False)
    return out_dir


@pytest.fixture(scope="session")
def tiny_engines(tiny_pair: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """fp32 ONNX Runtime engines of the tiny pair, built once per session by the
    project's build entry point (the way users build them)."""
    from checkpoints import build_engines_cli

    return build_engines_cli(tiny_pair, tmp_path_factory.mktemp("engines") / "tiny")


@pytest.fixture(scope="session")
def served_engines(tiny_pair: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Engines of the tiny pair with a 16384-token context, so one generation lasts long
    enough for concurrency, cancellation and shutdown to be seen (the servers' tests)."""
    from checkpoints import build_engines_cli, with_longer_context

    long_pair = with_longer_context(tiny_pair, tmp_path_factory.mktemp("long_pair"), 16384)
    return build_engines_cli(long_pair, tmp_path_factory.mktemp("engines") / "long", "--max-context", "16384")
