"""The largest branch budget whose pre-speculation hides under one verification, measured
where the engines are built and stored in their manifest.

While the target verifies a round's `[last, d_1..d_K]` (one forward of K+1 tokens), the
draft pre-speculates on the other core: one glue forward (its last draft token) and K
tree steps of B branches each (one forward of B tokens per step). Branches are free while
that lasts no longer than the verify; beyond it the target waits. So the budget that
hides is the largest B with `glue + K * tree_step(B) <= verify(K + 1)`, for each K the
engines accept. It is a property of the machine and the pair, measured once at build
time (about a second) so that loading stays deterministic; the figures go into the
manifest's optional `calibration` entry, and engines built without one load as before
(no hidden budget known).
"""
from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass

from saguaro.runtime.control.costs import calibration_context, forward_cost

CALIBRATION_REPEATS = 7
# The fastest of the timed calls: a build machine is often busy with other work, and a
# call preempted by a neighbour says nothing about what a round costs.
CALIBRATION_SUMMARY = min


@dataclass(frozen=True)
class BranchCalibration:
    """Median ms of the forwards a round overlaps, at `context` cached tokens."""

    context: int
    verify_ms: dict[int, float]     # K -> the target's forward of K + 1 tokens
    glue_ms: float                  # the draft's forward of one token
    tree_step_ms: dict[int, float]  # B -> the draft's forward of B branch tokens
    machine: str = ""
    date: str = ""

    def prespeculation_ms(self, k: int, branches: int) -> float:
        return self.glue_ms + k * self.tree_step_ms[branches]

    def hidden_branches(self, k: int) -> int:
        """The largest B such that pre-speculating every budget up to B hides under
        verify(K + 1) (a prefix, so one noisy timing cannot skip over a budget that
        does not fit); 0 when not even one branch hides."""
        hidden = 0
        for branches in sorted(self.tree_step_ms):
            if self.prespeculation_ms(k, branches) > self.verify_ms[k]:
                break
            hidden = branches
        return hidden

    def hidden_by_k(self) -> tuple[int, ...]:
        """`hidden_branches(K)` for K = 0, 1, .. the largest K measured (K = 0 drafts nothing)."""
        return (0,) + tuple(self.hidden_branches(k) for k in range(1, max(self.verify_ms) + 1))

    def to_manifest(self) -> dict:
        record = asdict(self)
        record["verify_ms"] = {str(k): ms for k, ms in self.verify_ms.items()}  # JSON keys are strings
        record["tree_step_ms"] = {str(b): ms for b, ms in self.tree_step_ms.items()}
        record["hidden_branches"] = list(self.hidden_by_k())
        return record

    @classmethod
    def from_manifest(cls, record: dict) -> "BranchCalibration":
        return cls(context=record["context"], glue_ms=record["glue_ms"],
                   verify_ms={int(k): ms for k, ms in record["verify_ms"].items()},
                   tree_step_ms={int(b): ms for b, ms in record["tree_step_ms"].items()},
                   machine=record.get("machine", ""), date=record.get("date", ""))


def measure_calibration(target, draft, max_draft_tokens: int, max_branches: int,
                        repeats: int = CALIBRATION_REPEATS) -> BranchCalibration:
    """Time the target's verify for every K and the draft's glue and tree steps for every
    B the engines were built for, one after the other (each on its own session threads)."""
    context = calibration_context(target.info.max_context)

    def cost(engine, count: int) -> float:
        return forward_cost(engine, context, count, repeats, CALIBRATION_SUMMARY)

    return BranchCalibration(
        context=context, verify_ms={k: cost(target, k + 1) for k in range(1, max_draft_tokens + 1)},
        glue_ms=cost(draft, 1), tree_step_ms={b: cost(draft, b) for b in range(1, max_branches + 1)},
        machine=machine_name(), date=time.strftime("%Y-%m-%d"))


def machine_name() -> str:
    """The CPU model as the OS names it (lscpu's "Model name"), else the architecture."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def hidden_branches_from_manifest(manifest: dict) -> tuple[int, ...] | None:
    """The stored `hidden_branches` by K, or None for engines built without a calibration."""
    record = manifest.get("calibration")
    return None if record is None else tuple(record["hidden_branches"])
