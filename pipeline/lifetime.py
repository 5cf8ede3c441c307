"""Processes a run starts end with the process that started them, also when that one is SIGKILLed.

A child asks the kernel (Linux `prctl(PR_SET_PDEATHSIG)`) for SIGKILL the moment its parent dies:
`die_with_parent()` at the top of a Python child's entry point, or `preexec_fn=die_with_parent` for a
`subprocess.Popen` of any program (a `mooncake_master`, an SGLang server). Then a `kill -9` of
`baton run`, or of a Ray worker that started a service, leaves nothing behind adopted by init. Where
the call is unavailable (not Linux) it does nothing; the runtimes' own stops still apply.

The signal goes when the parent *thread* that started the child exits, so children are started from
a thread that lives as long as the process (the main thread, or the event loop's), never from a
short-lived worker thread.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask for `sig` when this process's parent dies; if the parent is already gone, exit now."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


__all__ = ["die_with_parent"]
