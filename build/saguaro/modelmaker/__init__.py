"""Making model pairs from scratch: corpus, BPE tokenizer, target training, draft
distillation, and the acceptance report."""
