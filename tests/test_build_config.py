"""Build configuration: shipped configs, validation errors that name the problem, CLI
overrides, and the builder's up-front checks (all raised before any export starts)."""
import json
from pathlib import Path

import pytest
import yaml
from checkpoints import make_checkpoint

from saguaro.compiler import cli as build_engines_cli
from saguaro.compiler.builder import build_engines
from saguaro.compiler.config import BuildConfig, ConfigError, config_from_dict, merge_overrides, resolve_config
from saguaro.runtime.models.checkpoint import CheckpointError

VALID = {"name": "t", "target": "a", "draft": "b"}


@pytest.mark.parametrize("name, precision", [("tiny", "fp32"), ("bench", "int8")])
def test_shipped_configs_validate(name, precision):
    config = resolve_config(name)
    assert (config.name, config.backend, config.precision) == (name, "onnxruntime", precision)
    assert config.target == Path(f"models/{name}/target") and config.draft == Path(f"models/{name}/draft")
    assert (config.max_draft_tokens, config.max_branches, config.session.threads) == (8, 16, 1)


@pytest.mark.parametrize("raw, message", [
    ({**VALID, "max_draft_token": 4}, "unknown key 'max_draft_token'"),
    ({**VALID, "session": {"thread": 2}}, "session: unknown key 'thread'"),
    ({**VALID, "max_draft_tokens": "8"}, "max_draft_tokens must be an integer, got '8'"),
    ({**VALID, "max_context": True}, "max_context must be an integer, got True"),
    ({**VALID, "max_branches": 2.5}, "max_branches must be an integer, got 2.5"),
    ({**VALID, "session": {"spin": "no"}}, "spin must be true or false"),
    ({**VALID, "session": {"pin_cores": [0, -1]}}, "pin_cores must be a list of core numbers"),
    ({**VALID, "session": [1]}, "session must be a mapping"),
    ({**VALID, "name": "a b"}, "name must be a name"),
    ({**VALID, "backend": "tvm"}, "backend='tvm' is not one of onnxruntime, tensorrt"),
    ({**VALID, "precision": "int3"}, "precision='int3' is not supported by backend onnxruntime"),
    ({**VALID, "backend": "tensorrt", "precision": "int4"}, "precision='int4' is not supported by backend tensorrt"),
    ({**VALID, "max_draft_tokens": 0}, "max_draft_tokens=0 must be in 1..64"),
    ({**VALID, "max_draft_tokens": 65}, "max_draft_tokens=65 must be in 1..64"),
    ({**VALID, "max_branches": -1}, "max_branches=-1 must be >= 0"),
    ({**VALID, "max_context": 1}, "max_context=1 must be >= 2"),
    ({**VALID, "max_batch": 0}, "max_batch=0 must be >= 1"),
    ({**VALID, "opset": 13}, "opset=13 must be >= 17"),
    ({**VALID, "session": {"threads": 0}}, "session.threads=0 must be >= 1"),
    ({**VALID, "session": {"threads": 3, "pin_cores": [0]}}, "names fewer cores than the 2"),
    ({"name": "t", "target": "a"}, "missing required key 'draft'"),
    ([1, 2], "expected a mapping"),
])
def test_bad_configs_name_the_problem(raw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        config_from_dict(raw, where="cfg.yaml")


def test_defaults_and_types():
    config = config_from_dict({**VALID, "session": {"pin_cores": [1]}})
    assert isinstance(config, BuildConfig) and config.target == Path("a")
    assert config.session.pin_cores == (1,) and config.session.threads == 1
    assert config.max_cache_entries == config.max_context + (config.max_branches + 1) * config.max_draft_tokens + 1
    with pytest.raises(Exception):
        config.max_context = 3  # frozen


def test_cli_overrides_beat_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**VALID, "precision": "int8", "session": {"threads": 1, "spin": True}}))
    config = resolve_config(path, {"precision": "int4", "threads": 2, "max_draft_tokens": 5,
                                   "target": Path("x"), "max_branches": None})
    assert (config.precision, config.session.threads, config.max_draft_tokens) == ("int4", 2, 5)
    assert config.target == Path("x") and config.session.spin is True and config.max_branches == 16
    with pytest.raises(ConfigError, match="unknown override 'colour'"):
        merge_overrides(VALID, {"colour": "red"})
    with pytest.raises(ConfigError, match="max_draft_tokens=99"):
        resolve_config(path, {"max_draft_tokens": 99})


def test_unreadable_config_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_config(tmp_path / "none.yaml")
    (tmp_path / "bad.yaml").write_text("name: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        resolve_config(tmp_path / "bad.yaml")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    make_checkpoint(root / "target", vocab_size=16, hidden=16, heads=1, kv_heads=1, max_positions=64)
    make_checkpoint(root / "draft", vocab_size=16, hidden=16, heads=1, kv_heads=1, max_positions=64, seed=1)
    make_checkpoint(root / "other_tokenizer", vocab_size=16, hidden=16, heads=1, kv_heads=1, max_positions=64, word_prefix="v")
    make_checkpoint(root / "other_vocab", vocab_size=20, hidden=16, heads=1, kv_heads=1, max_positions=64)
    not_llama = make_checkpoint(root / "not_llama", vocab_size=16, hidden=16, heads=1, kv_heads=1, max_positions=64)
    config = json.loads((not_llama / "config.json").read_text())
    (not_llama / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    return root


@pytest.mark.parametrize("change, error, message", [
    (dict(max_context=65), ConfigError, "max_context=65 is beyond the target model's max_position_embeddings 64"),
    (dict(draft="other_tokenizer"), CheckpointError, "draft tokenizer .* differs from the target's"),
    (dict(draft="other_vocab"), CheckpointError, "draft vocab_size 20 differs from target vocab_size 16"),
    (dict(target="not_llama"), CheckpointError, "target checkpoint .* model_type 'gpt2' is not supported"),
    (dict(draft="missing"), CheckpointError, "does not exist"),
    (dict(backend="tensorrt"), ConfigError, "pip install --extra-index-url https://pypi.nvidia.com 'tensorrt>=10.8,<12'"),
])
def test_builder_rejects_bad_input_before_any_work(pair, tmp_path, change, error, message):
    if change.get("backend") == "tensorrt" and _has_tensorrt():
        pytest.skip("TensorRT is installed here")
    fields = {"name": "t", "target": pair / "target", "draft": pair / "draft", "max_context": 64}
    fields.update({k: pair / v if k in ("target", "draft") else v for k, v in change.items()})
    out = tmp_path / "engines"
    with pytest.raises(error, match=message):
        build_engines(BuildConfig(**fields), out, show_progress=False)
    assert not out.exists() and not (tmp_path / ".engines.building").exists()


def test_builder_refuses_to_replace_a_folder_that_is_not_an_engine_directory(pair, tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    config = BuildConfig(name="t", target=pair / "target", draft=pair / "draft", max_context=64)
    with pytest.raises(ConfigError, match="exists and is not an engine directory"):
        build_engines(config, tmp_path, show_progress=False)
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_cli_exit_code_2_names_the_problem(pair, tmp_path, capsys):
    code = build_engines_cli.main(["--target", str(pair / "target"), "--draft", str(pair / "draft"),
                                   "--max-draft-tokens", "0", "--out", str(tmp_path / "e"), "--quiet"])
    assert code == 2 and "max_draft_tokens=0 must be in 1..64" in capsys.readouterr().err
    code = build_engines_cli.main(["--target", str(pair / "not_llama"), "--draft", str(pair / "draft"),
                                   "--out", str(tmp_path / "e"), "--quiet"])
    assert code == 2 and "model_type 'gpt2' is not supported" in capsys.readouterr().err


def test_cli_builds_and_prints_a_summary(pair, tmp_path, capsys):
    out = tmp_path / "e"
    code = build_engines_cli.main(["--target", str(pair / "target"), "--draft", str(pair / "draft"),
                                   "--max-context", "64", "--max-draft-tokens", "3", "--out", str(out), "--quiet"])
    printed = capsys.readouterr().out
    assert code == 0 and (out / "manifest.json").is_file()
    assert "target/fused_verify" in printed and "draft/branch_draft" in printed and "K <= 3" in printed


def _has_tensorrt() -> bool:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False
    return True
