"""Both `saguaro` plugins for TensorRT, registered together (once per process)."""
from __future__ import annotations

from saguaro.plugins.branch_draft import tensorrt_plugin as branch_draft
from saguaro.plugins.fused_verify import tensorrt_plugin as fused_verify


def register_plugins() -> None:
    """Make both plugins known to TensorRT before a parser or runtime meets their nodes."""
    fused_verify.register()
    branch_draft.register()
