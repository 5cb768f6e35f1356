"""Fused verification: one op from target logits to the round's outcome `(accepted, bonus)`."""
PLUGIN_NAME = "FusedVerify"
PLUGIN_NAMESPACE = "saguaro"
PLUGIN_VERSION = "1"
