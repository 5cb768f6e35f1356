"""Become a program with SIGTERM blocked and a parent-death signal set:

    python -m saguaro.serving.guarded_exec PARENT_PID PROGRAM [ARGS...]

How the launcher starts `tritonserver`. On SIGTERM Triton 2.51 stops every model's
scheduler at once, which strands in-flight ensemble requests (their next step is
refused) and tells the generation model nothing. With SIGTERM blocked, a SIGTERM sent
to the server stays pending instead; the launcher sees it pending
(`triton_server.pending_signals`), drains the generations, and only then stops the server with
SIGINT, which Triton handles as it would SIGTERM. If the launcher dies first, the kernel
sends the server SIGINT (PR_SET_PDEATHSIG), so it never outlives the launcher.

Both the signal mask and the parent-death signal survive `exec`, so the server keeps
this process's id: `kill <pid>` reaches it. Standard library only, so it starts fast.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def set_parent_death_signal(signum: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def main(argv: list[str]) -> int:
    parent, program = int(argv[0]), argv[1:]
    set_parent_death_signal(signal.SIGINT)
    if os.getppid() != parent:  # the launcher died before the death signal was armed
        return 1
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    for name in ("SIGPIPE", "SIGXFSZ"):  # what Python ignores, the program gets back (as subprocess does)
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    # SIGINT is how the server is stopped (by the launcher, or the kernel when it dies): a
    # launcher started in the background of a script inherits it ignored, and an ignored
    # signal stays ignored across exec
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.execv(program[0], program)
    return 1  # not reached: execv raises on failure


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
