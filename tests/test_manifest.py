"""manifest.json: written last, validated before anything loads, every failure named."""
import json
import shutil

import pytest
from checkpoints import build_small_engines, make_checkpoint

from saguaro.runtime.engines import load_engine_pair
from saguaro.runtime.engines.manifest import (
    MANIFEST_FILE,
    PLUGINS,
    ManifestError,
    read_manifest,
    validate_engine_dir,
    write_manifest,
)


@pytest.fixture(scope="module")
def built(tiny_pair, tmp_path_factory):
    return build_small_engines(tiny_pair, tmp_path_factory.mktemp("built") / "engines", "manifest-test",
                               max_draft_tokens=4, max_branches=8)


@pytest.fixture
def engine_dir(built, tmp_path):
    """A private copy of the built directory that a test may damage."""
    return shutil.copytree(built, tmp_path / "engines")


def rewrite_manifest(root, change):
    manifest = json.loads((root / MANIFEST_FILE).read_text())
    change(manifest)
    (root / MANIFEST_FILE).write_text(json.dumps(manifest))


def test_manifest_describes_the_build(built, tiny_pair):
    manifest = validate_engine_dir(built)
    assert manifest["backend"] == "onnxruntime" and manifest["precision"] == "fp32"
    assert manifest["plugins"] == PLUGINS
    assert manifest["build"]["max_draft_tokens"] == 4 and manifest["build"]["max_branches"] == 8
    assert set(manifest["models"]["target"]["graphs"]) == {"model", "fused_verify"}
    assert set(manifest["models"]["draft"]["graphs"]) == {"model", "branch_draft"}
    verify = manifest["models"]["target"]["signatures"]["fused_verify"]
    assert [o["name"] for o in verify["outputs"]][:2] == ["accepted", "bonus"]
    config = json.loads((tiny_pair / "target" / "config.json").read_text())
    assert manifest["models"]["target"]["config"] == config
    assert manifest["models"]["target"]["shape"]["vocab_size"] == config["vocab_size"]
    assert manifest["tokenizer"]["fingerprint"] == manifest["models"]["draft"]["tokenizer_fingerprint"]
    assert set(manifest["versions"]) >= {"torch", "onnx", "onnxruntime", "opset"}
    assert "target/model.safetensors" in manifest["inputs"] and "draft/config.json" in manifest["inputs"]
    files = {p.relative_to(built).as_posix() for p in built.rglob("*") if p.is_file()} - {MANIFEST_FILE}
    assert set(manifest["files"]) == files
    assert "tokenizer/tokenizer.json" in files


def test_changed_file_is_named(engine_dir):
    with open(engine_dir / "target" / "model.weights", "ab") as file:
        file.write(b"\0")
    with pytest.raises(ManifestError, match=r"'target/model.weights' does not match its sha256"):
        load_engine_pair(engine_dir)


def test_missing_file_is_named(engine_dir):
    (engine_dir / "draft" / "branch_draft.onnx").unlink()
    with pytest.raises(ManifestError, match=r"'draft/branch_draft.onnx' listed in manifest.json is missing"):
        validate_engine_dir(engine_dir)


def test_unlisted_file_is_named(engine_dir):
    (engine_dir / "target" / "stray.onnx").write_bytes(b"x")
    with pytest.raises(ManifestError, match=r"'target/stray.onnx' is not listed"):
        validate_engine_dir(engine_dir)


def test_plugin_version_mismatch(engine_dir):
    rewrite_manifest(engine_dir, lambda m: m["plugins"]["FusedVerify"].update(version="0"))
    with pytest.raises(ManifestError, match="plugin FusedVerify"):
        validate_engine_dir(engine_dir)


def test_incompatible_pair_in_manifest(engine_dir):
    rewrite_manifest(engine_dir, lambda m: m["models"]["draft"].update(tokenizer_fingerprint="0" * 16))
    with pytest.raises(ManifestError, match="incompatible engine pair: draft tokenizer"):
        validate_engine_dir(engine_dir)
    rewrite_manifest(engine_dir, lambda m: m["models"]["draft"]["shape"].update(vocab_size=33))
    with pytest.raises(ManifestError, match="vocab_size"):
        validate_engine_dir(engine_dir)


def test_replaced_tokenizer_is_caught_even_with_a_rehashed_manifest(engine_dir, tmp_path):
    other = make_checkpoint(tmp_path / "other", vocab_size=32, hidden=16, word_prefix="v")
    shutil.copy(other / "tokenizer.json", engine_dir / "tokenizer" / "tokenizer.json")
    manifest = read_manifest(engine_dir)
    content = {k: v for k, v in manifest.items() if k not in ("format", "format_version", "plugins", "files")}
    write_manifest(engine_dir, content)  # hashes now match the swapped file
    with pytest.raises(ManifestError, match="not the one the engines were built with"):
        load_engine_pair(engine_dir)


@pytest.mark.parametrize("damage, message", [
    (lambda root: (root / MANIFEST_FILE).unlink(), "no manifest.json"),
    (lambda root: (root / MANIFEST_FILE).write_text("{"), "not valid JSON"),
    (lambda root: (root / MANIFEST_FILE).write_text("[]"), "not a saguaro-engines manifest"),
    (lambda root: rewrite_manifest(root, lambda m: m.update(format_version=99)), "format_version 99"),
    (lambda root: rewrite_manifest(root, lambda m: m.pop("models")), "missing key 'models'"),
])
def test_broken_manifest(engine_dir, damage, message):
    damage(engine_dir)
    with pytest.raises(ManifestError, match=message):
        load_engine_pair(engine_dir)


def test_not_a_directory(tmp_path):
    with pytest.raises(ManifestError, match="does not exist"):
        validate_engine_dir(tmp_path / "nowhere")
