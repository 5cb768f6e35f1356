"""BranchDraft registered with TensorRT's Python plugin API (`tensorrt.plugin`, TensorRT >= 10.8).

B = sum(fanout) is data-dependent, so the outputs use TensorRT's data-dependent shapes:
a size tensor per data-dependent extent, bounded by the node's `max_branches` attribute.
`tensorrt.plugin` forbids arithmetic on size-tensor expressions, so the mask's extents
K*B and K + K*B get size tensors of their own. The plugin's outputs are therefore

    depth [B], token [B], rank [B], positions [K, B], window_mask [K*B, K + K*B],
    branches, mask_rows, mask_cols      (0-d int32 size tensors)

The ONNX node names only the first five; TensorRT's parser drops trailing plugin outputs
the node does not name, so ONNX Runtime and TensorRT see the same node. The values are
those of `reference.plan_branches`, unpadded: the same contract on every backend.

The KV gather is not a plugin: TensorRT engines here bind caches that the runtime owns
as device buffers, and committing a branch is the in-place Triton kernel
(`triton_kernel.gather_kv`) run between engine calls. Inside an engine it would have to
copy the whole cache every round.

No `from __future__ import annotations` here: `tensorrt.plugin` reads the annotations of
the decorated functions as classes.
"""
from typing import Tuple

from saguaro.plugins.branch_draft import PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION
from saguaro.plugins.tensorrt_registry import registration

PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}"
NUM_PLUGIN_OUTPUTS = 8

# dtype -> array-interface type string, for views of TensorRT-allocated output buffers
_TYPESTR = {"int64": "<i8", "int32": "<i4", "bool": "|b1"}


class DeviceBuffer:
    """A contiguous view of raw device memory for `torch.as_tensor`.

    A data-dependent output's `tensorrt.plugin.Tensor` has wildcard extents until the op
    has run, so its own array interface cannot describe it; once B is known, this can.
    """

    def __init__(self, pointer: int, shape: tuple, dtype: str):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": _TYPESTR[dtype],
                                         "data": (pointer, False), "strides": None,
                                         "version": 3, "stream": None}


def register() -> None:
    """Register `saguaro::BranchDraft` with TensorRT (once per process)."""
    _register()


def _define_plugin(trt, trtp) -> None:
    @trtp.register(PLUGIN_ID)
    def branch_draft_shapes(
        scores: trtp.TensorDesc, draft_tokens: trtp.TensorDesc, fanout: trtp.TensorDesc,
        context_length: trtp.TensorDesc, max_branches: int,
    ) -> Tuple[(trtp.TensorDesc,) * NUM_PLUGIN_OUTPUTS]:
        drafts = draft_tokens.shape_expr[0]
        # builds tune for half the bound; any B up to max_branches runs
        typical = max(1, max_branches // 2)
        branches = trtp.size_tensor(trtp.ShapeExpr(typical), trtp.ShapeExpr(max_branches))
        mask_rows = trtp.size_tensor(drafts * typical, drafts * max_branches)
        mask_cols = trtp.size_tensor(drafts + drafts * typical, drafts + drafts * max_branches)
        per_branch = [trtp.from_shape_expr((branches.expr(),), dtype=trt.int64) for _ in range(3)]
        positions = trtp.from_shape_expr((drafts, branches.expr()), dtype=trt.int64)
        window_mask = trtp.from_shape_expr((mask_rows.expr(), mask_cols.expr()), dtype=trt.bool)
        return (*per_branch, positions, window_mask, branches, mask_rows, mask_cols)

    @trtp.impl(PLUGIN_ID)
    def branch_draft_launch(
        scores: trtp.Tensor, draft_tokens: trtp.Tensor, fanout: trtp.Tensor,
        context_length: trtp.Tensor, max_branches: int, outputs: Tuple[(trtp.Tensor,) * NUM_PLUGIN_OUTPUTS],
        stream: int,
    ) -> None:
        import torch

        from saguaro.plugins.branch_draft.triton_kernel import launch_candidate_keys, launch_tree_layout

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            scores_t, drafts_t, fanout_t, length_t = (
                torch.as_tensor(t, device="cuda") for t in (scores, draft_tokens, fanout, context_length))
            # one host sync: TensorRT reads the size tensors back to size the outputs anyway
            branches = int(fanout_t.sum())
            if branches > max_branches:
                raise ValueError(f"{PLUGIN_ID}: sum(fanout) = {branches} exceeds max_branches = {max_branches}")
            drafts = drafts_t.shape[0]
            shapes = [(branches,)] * 3 + [(drafts, branches), (drafts * branches, drafts + drafts * branches)]
            dtypes = ["int64"] * 4 + ["bool"]
            depth, token, rank, positions, window_mask = (
                torch.as_tensor(DeviceBuffer(out.data_ptr, shape, dtype), device="cuda")
                for out, shape, dtype in zip(outputs, shapes, dtypes))
            launch_candidate_keys(scores_t, drafts_t, fanout_t, depth, token, rank)
            launch_tree_layout(depth, length_t, drafts, positions, window_mask)
            sizes = (branches, drafts * branches, drafts + drafts * branches)
            for out, size in zip(outputs[5:], sizes):
                torch.as_tensor(DeviceBuffer(out.data_ptr, (), "int32"), device="cuda").fill_(size)


_register = registration(_define_plugin, PLUGIN_VERSION)
