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
from saguaro.plugins.tensorrt_registry import DeviceBuffer, check_input_types, registration, tensorrt_dtype

PLUGIN_ID = SIGNATURE.plugin_id
NUM_OUTPUTS = len(SIGNATURE.outputs)
SIZE_TENSORS = tuple(spec.name for spec in SIGNATURE.outputs if spec.size_tensor)


def register() -> None:
    """Register `saguaro::BranchDraft` with TensorRT (once per process)."""
    _register()


def size_tensor_bounds(trtp, drafts, max_branches: int) -> dict:
    """(opt, upper bound) of each size tensor, B, K*B and K + K*B, as shape expressions
    of K = `drafts` (builds tune for half the bound; any B up to max_branches runs).

    TensorRT runs the shape function twice. For the output types it passes fake
    expressions and only the types are read; then no expression may be built from an
    int: before TensorRT 10.15, `tensorrt.plugin` keeps the expression builder of the
    last shape pass in a class attribute, which TensorRT destroyed when that pass
    returned, and `ShapeExpr(int)` would call into it. So while K is fake the bounds
    are K itself (fake too); constants are made only in the shape pass."""
    if drafts.is_fake:
        return {name: (drafts, drafts) for name in SIZE_TENSORS}
    typical = max(1, max_branches // 2)
    return {"branches": (trtp.ShapeExpr(typical), trtp.ShapeExpr(max_branches)),
            "mask_rows": (drafts * typical, drafts * max_branches),
            "mask_cols": (drafts + drafts * typical, drafts + drafts * max_branches)}


def _define_plugin(trt, trtp) -> None:
    @trtp.register(PLUGIN_ID)
    def branch_draft_shapes(
        scores: trtp.TensorDesc, draft_tokens: trtp.TensorDesc, fanout: trtp.TensorDesc,
        context_length: trtp.TensorDesc, max_branches: int,
    ) -> Tuple[(trtp.TensorDesc,) * NUM_OUTPUTS]:  # type: ignore[valid-type]  # built at run time for tensorrt.plugin
        check_input_types(trt, SIGNATURE, (scores, draft_tokens, fanout, context_length))
        drafts = draft_tokens.shape_expr[0]
        sizes = {name: trtp.size_tensor(opt, bound)
                 for name, (opt, bound) in size_tensor_bounds(trtp, drafts, max_branches).items()}
        # a size tensor's expression takes part in no arithmetic (tensorrt.plugin raises)
        branches, rows, cols = (sizes[name].expr() for name in SIZE_TENSORS)
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
        context_length: trtp.Tensor, max_branches: int,
        outputs: Tuple[(trtp.Tensor,) * NUM_OUTPUTS],  # type: ignore[valid-type]  # built at run time for tensorrt.plugin
        stream: int,
    ) -> None:
        import torch

        from saguaro.plugins.branch_draft.triton_kernel import launch_plan_outputs

        def output(index: int, shape: tuple, dtype: str) -> torch.Tensor:
            # a data-dependent output's own array interface has wildcard extents until now
            return torch.as_tensor(DeviceBuffer(outputs[index].data_ptr, shape, dtype), device="cuda")

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            inputs = [torch.as_tensor(t, device="cuda") for t in (scores, draft_tokens, fanout, context_length)]
            scores_in, tokens_in, fanout_in, length_in = inputs
            launch_plan_outputs(scores_in, tokens_in, fanout_in, length_in, max_branches, output)


_register = registration(_define_plugin, SIGNATURE.version)
