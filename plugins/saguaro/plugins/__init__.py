"""The two custom ops of the pipeline, each defined once with several implementations.

- `fused_verify`: target logits + draft tokens (+ draft probabilities, uniforms, sampling
  parameters) in, the verification outcome `(accepted, bonus)` out.
- `branch_draft`: draft distributions over the K+1 positions of a round + a fan-out in,
  branch keys `(j, t)`, branch positions and the tree attention mask out; plus the KV
  gather that commits a hit branch.

`reference.py` in each is the pure-torch definition every other form is tested against.
`probs.py` holds the sampling math both share.
"""
