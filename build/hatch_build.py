"""Wheel build hook: ship the Triton model repository templates inside `saguaro.serving`.

A static `force-include` would also copy them into site-packages on editable installs,
where the copy goes stale; an editable install reads the checkout's `model_repo/`.
"""
from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class ModelRepoTemplates(BuildHookInterface):
    def initialize(self, version: str, build_data: dict) -> None:
        if version != "editable":
            build_data["force_include"]["model_repo"] = "saguaro/serving/model_repo"
