"""The model: Llama-family checkpoints, the EAGLE-3 feature head, tokenizer-side helpers."""
