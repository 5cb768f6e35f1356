"""The ONNX Runtime backend: a role's graphs, and the check that ONNX Runtime opens them.

A role is one fused model graph (`fused_export`: every call of the model, weights held
once, fp32 / int8 / int4 / w8a8) plus the plugin graph that role needs, weightless and small:
`fused_verify` for the target (a FusedVerify node reading the model's logits rows) and
`branch_draft` for the draft (a BranchDraft node). Each plugin node is backed by its ONNX
local function, which ONNX Runtime inlines. A feature draft (an EAGLE-3 head) is its
head's graphs (`feature_export`: the model and the `project` graph that turns the
target's features into the head's inputs) plus the same `branch_draft`; its target's
model graph then also returns those features. The runtime loads the `.onnx` files as they
are: ONNX Runtime optimises them at session creation (the fused graph leaves it little).
"""
from __future__ import annotations

from pathlib import Path

import onnx

from saguaro.compiler import export, feature_export, fused_export, quantization, smoothing
from saguaro.plugins.fused_verify import onnx_function as fused_verify_onnx
from saguaro.runtime.engines.onnxruntime_engine import SessionSettings, open_session
from saguaro.runtime.models.checkpoint import read_state_dict

GRAPHS = {"target": ("model", "fused_verify"), "draft": ("model", "branch_draft")}
FEATURE_DRAFT_GRAPHS = ("model", "project", "branch_draft")


def rope_positions(config) -> int:
    """Rows of the rotary tables. GroupQueryAttention wants at least as many as the total
    sequence length it is given, not only the furthest position: a draft cache holds a
    round's branch entries after its context, and a one-token step's padding query takes
    one entry more (`fused_export.AttentionInputs`)."""
    return config.max_cache_entries + 1


def export_role(config, role: str, shape, checkpoint: Path, folder: Path,
                feature_layers: tuple[int, ...] = ()) -> dict[str, Path]:
    """The role's graphs in `folder`; returns stem -> path. `feature_layers`: a target's,
    for a feature draft (`fused_export`'s `hidden_states` output)."""
    folder.mkdir(parents=True, exist_ok=True)
    state = read_state_dict(checkpoint)
    if config.precision == quantization.PER_TOKEN_INT8:
        state = smoothing.smoothed_state(shape, state, checkpoint)
    paths = {"model": fused_export.export_model(shape, state, folder / "model.onnx",
                                                config.precision, rope_positions(config), feature_layers)}
    if role == "target":
        return {**paths, **save_plugin(fused_verify_onnx.standalone_model(config.opset), folder, "fused_verify")}
    return {**paths, **branch_draft_graph(config, folder)}


def export_feature_draft(config, head, folder: Path) -> dict[str, Path]:
    """A feature head's graphs (`feature_export`) and the draft's plan graph in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = feature_export.export_head(head, folder, config.precision, rope_positions(config))
    return {**paths, **branch_draft_graph(config, folder)}


def branch_draft_graph(config, folder: Path) -> dict[str, Path]:
    return save_plugin(export.branch_draft_model(config.opset, config.max_branches), folder, "branch_draft")


def save_plugin(model: onnx.ModelProto, folder: Path, stem: str) -> dict[str, Path]:
    path = folder / f"{stem}.onnx"
    onnx.save_model(model, str(path))
    return {stem: path}


def check_loads(path: Path, settings: SessionSettings) -> Path:
    """Open the graph once, at build time, as the runtime will: a graph ONNX Runtime
    refuses fails the build, not the first request."""
    open_session(path, settings)
    return path
