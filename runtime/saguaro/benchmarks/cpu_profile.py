"""Where the CPU goes while a server runs: CPU seconds of each of its processes (Linux /proc).

A served round spends its time in several processes: the `ssd` model's Python stub (the
engines, the scheduler, building and sending responses), the pre/postprocessing stubs
(the ensemble's text path), `tritonserver` itself (routing between models, the gRPC front
end) and the client. The load benchmark samples each one's CPU time before and after a
level and reports it per output token: on a machine whose cores are all busy, that is
where a round's time goes.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
STUB_MODEL = re.compile(r"/model_repo/([^/]+)/\d+/model\.py")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process, all its threads (0 if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S  # utime, stime


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def server_processes(server_pid: int) -> dict[str, int]:
    """`tritonserver` and its Python stubs, by the model each stub runs."""
    processes = {"tritonserver": server_pid}
    for child in children(server_pid):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        match = STUB_MODEL.search(command)
        if match:
            processes[f"{match.group(1)} stub"] = child
    return processes


def snapshot(processes: dict[str, int]) -> dict[str, float]:
    return {name: cpu_seconds(pid) for name, pid in processes.items()}


def spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before.get(name, 0.0) for name in after}
