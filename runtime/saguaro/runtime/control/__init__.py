"""What is decided while decoding: the cost model, the load policy, the branch budget."""
