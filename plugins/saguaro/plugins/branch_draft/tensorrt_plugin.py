"""BranchDraft registered with TensorRT's Python plugin API (`tensorrt.plugin`, TensorRT >= 10.8).

The outputs are `signature.SIGNATURE`'s, in its order: the plan (depth, token, rank
`[B]`, positions `[K, B]`, the int32 window mask `[K*B, K + K*B]`) and the three 0-d int32
size tensors B, K*B, K + K*B that TensorRT's data-dependent shapes need, each bounded
through the node's `max_branches` attribute. The ONNX node names all eight (TensorRT's
parser requires exactly the plugin's count) and the graph casts the mask to bool after
it. The values are those of `reference.plan_branches`, unpadded: the same contract on
every backend. The computation is `triton_kernel.launch_plan_outputs`, launched on the
stream TensorRT hands over.

The KV gather is not a plugin: TensorRT engines here bind caches that the runtime owns
as device buffers, and committing a branch is the in-place Triton kernel
(`triton_kernel.gather_kv`) run between engine calls. Inside an engine it would have to
copy the whole cache every round.

No `from __future__ import annotations` here: `tensorrt.plugin` reads the annotations of
the decorated functions as classes.
"""
from typing import Tuple

from saguaro.plugins.branch_draft.signature import SIGNATURE
from saguaro.plugins.tensorrt_registry import DeviceBuffer, registration, tensorrt_dtype

PLUGIN_ID = SIGNATURE.plugin_id
NUM_OUTPUTS = len(SIGNATURE.outputs)


def register() -> None:
    """Register `saguaro::BranchDraft` with TensorRT (once per process)."""
    _register()


def _define_plugin(trt, trtp) -> None:
    @trtp.register(PLUGIN_ID)
    def branch_draft_shapes(
        scores: trtp.TensorDesc, draft_tokens: trtp.TensorDesc, fanout: trtp.TensorDesc,
        context_length: trtp.TensorDesc, max_branches: int,
    ) -> Tuple[(trtp.TensorDesc,) * NUM_OUTPUTS]:
        drafts = draft_tokens.shape_expr[0]
        # builds tune for half the bound; any B up to max_branches runs
        typical = max(1, max_branches // 2)
        sizes = {"branches": trtp.size_tensor(trtp.ShapeExpr(typical), trtp.ShapeExpr(max_branches)),
                 "mask_rows": trtp.size_tensor(drafts * typical, drafts * max_branches),
                 "mask_cols": trtp.size_tensor(drafts + drafts * typical, drafts + drafts * max_branches)}
        branches, rows, cols = (sizes[name].expr() for name in ("branches", "mask_rows", "mask_cols"))
        shapes = {"depth": (branches,), "token": (branches,), "rank": (branches,), "positions": (drafts, branches),
                  "window_mask": (rows, cols)}
        outputs = []
        for spec in SIGNATURE.outputs:
            if spec.size_tensor:
                sizes[spec.name].dtype = tensorrt_dtype(trt, spec.dtype)
                outputs.append(sizes[spec.name])
            else:
                outputs.append(trtp.from_shape_expr(shapes[spec.name], dtype=tensorrt_dtype(trt, spec.dtype)))
        return tuple(outputs)

    @trtp.impl(PLUGIN_ID)
    def branch_draft_launch(
        scores: trtp.Tensor, draft_tokens: trtp.Tensor, fanout: trtp.Tensor,
        context_length: trtp.Tensor, max_branches: int, outputs: Tuple[(trtp.Tensor,) * NUM_OUTPUTS],
        stream: int,
    ) -> None:
        import torch

        from saguaro.plugins.branch_draft.triton_kernel import launch_plan_outputs

        def output(index: int, shape: tuple, dtype: str) -> torch.Tensor:
            # a data-dependent output's own array interface has wildcard extents until now
            return torch.as_tensor(DeviceBuffer(outputs[index].data_ptr, shape, dtype), device="cuda")

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            inputs = [torch.as_tensor(t, device="cuda") for t in (scores, draft_tokens, fanout, context_length)]
            launch_plan_outputs(*inputs, max_branches, output)


_register = registration(_define_plugin, SIGNATURE.version)
