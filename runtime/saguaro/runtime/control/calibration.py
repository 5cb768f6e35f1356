"""The calibration: what the forwards a round is made of cost on this machine, by size.

One measurement feeds the one cost model (`control.costs`). The build takes it on the
engines it built and stores it in their manifest (`calibration`), with the branch budget
that hides under a verification at each K at batch 1 (the default fan-out of a request
that names none); the load policy starts its cost curves from it when it was measured on
the machine that serves, and measures it the same way at load otherwise (engines built
elsewhere or before the calibration existed, torch engines).

While the target verifies a round's `[last, d_1..d_K]` (one forward of K+1 tokens), the
draft pre-speculates on the other core: one glue forward (its last draft token) and K
tree steps of B branches each (one forward of B rows per step). Branches are free while
that lasts no longer than the verification; beyond it the target waits.
"""
from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field

from saguaro.runtime.control.costs import MOST_BRANCHES, CostCurve, calibration_context, hidden_branches, measure_curve

CALIBRATION_PASSES = 3  # over the sizes; the fastest of them counts


@dataclass(frozen=True)
class Calibration:
    """Seconds of one forward by its size, at `context` cached tokens, on `machine`."""

    context: int
    verify: dict[int, float]   # tokens -> the target's forward beside the draft's session
    draft: dict[int, float]    # rows -> the draft's forward (a step for R requests, a tree step of R rows)
    alone: dict[int, float] = field(default_factory=dict)  # tokens -> the target's, nothing beside it
    machine: str = ""
    date: str = ""

    def hidden_branches(self, k: int, most: int = MOST_BRANCHES) -> int:
        """Branches whose pre-speculation (the glue forward, then K tree steps) hides under
        one request's verification of K + 1 tokens; 0 when not even one does."""
        tree = CostCurve(self.draft)
        return hidden_branches(CostCurve(self.verify)(k + 1) - tree(1), tree, steps=k, most=most)

    def hidden_by_k(self, max_k: int, most: int = MOST_BRANCHES) -> tuple[int, ...]:
        """`hidden_branches(K)` for K = 0 (drafts nothing), 1, .. `max_k`."""
        return (0,) + tuple(self.hidden_branches(k, most) for k in range(1, max_k + 1))

    @property
    def measured_here(self) -> bool:
        """Taken on this machine, the target alone too (as builds take it): a policy may
        start from it without measuring."""
        return bool(self.alone) and self.machine == machine_name()

    def to_manifest(self, max_k: int, most: int) -> dict:
        def by_size(points):
            return {str(size): seconds for size, seconds in points.items()}  # JSON keys are strings

        return {"context": self.context, "verify_s": by_size(self.verify), "draft_s": by_size(self.draft),
                "alone_s": by_size(self.alone), "machine": self.machine, "date": self.date,
                "hidden_branches": list(self.hidden_by_k(max_k, most))}

    @classmethod
    def from_milliseconds(cls, context: int, verify_ms: dict[int, float], glue_ms: float,
                          tree_step_ms: dict[int, float], machine: str = "", date: str = "") -> "Calibration":
        """Figures in ms of a round's forwards: the verify by K (K + 1 tokens), the draft's
        step of one token (the glue) and its tree steps by B rows."""
        draft = {b: ms / 1000 for b, ms in tree_step_ms.items()}
        draft[1] = min(draft.get(1, glue_ms / 1000), glue_ms / 1000)
        return cls(context, {k + 1: ms / 1000 for k, ms in verify_ms.items()}, draft, machine=machine, date=date)

    @classmethod
    def from_manifest(cls, record: dict) -> "Calibration":
        """The stored record; one from engines built before the curves (milliseconds of the
        verify by K, the glue and the tree step by B) reads as the points it measured."""
        if "verify_s" not in record:
            return cls.from_milliseconds(record["context"], {int(k): ms for k, ms in record["verify_ms"].items()},
                                         record["glue_ms"], {int(b): ms for b, ms in record["tree_step_ms"].items()},
                                         record.get("machine", ""), record.get("date", ""))

        def by_size(points):
            return {int(size): seconds for size, seconds in points.items()}

        return cls(record["context"], by_size(record["verify_s"]), by_size(record["draft_s"]),
                   by_size(record.get("alone_s", {})), record.get("machine", ""), record.get("date", ""))


def measure_calibration(target, draft, alone: bool = True, passes: int = CALIBRATION_PASSES) -> Calibration:
    """Time the target's forwards (beside the draft's session, and alone unless `alone` is
    False: engines that other decoders share never run alone) and the draft's, at the
    ladder of sizes each can take, one engine after the other."""
    return Calibration(calibration_context(target.info.max_context), verify=measure_curve(target, passes),
                       draft=measure_curve(draft, passes), alone=measure_curve(target, passes, alone=True) if alone else {},
                       machine=machine_name(), date=time.strftime("%Y-%m-%d"))


def calibration_from_manifest(manifest: dict) -> Calibration | None:
    """The engines' stored calibration, or None for engines built without one."""
    record = manifest.get("calibration")
    return None if record is None else Calibration.from_manifest(record)


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
