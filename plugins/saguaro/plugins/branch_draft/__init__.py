"""Branch-keyed drafting: candidate outcomes `(j, t)`, their tree layout, and the KV commit."""
PLUGIN_NAME = "BranchDraft"
PLUGIN_NAMESPACE = "saguaro"
PLUGIN_VERSION = "1"
