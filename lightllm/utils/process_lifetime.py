"""A child process (a model worker, an extra HTTP process) ends when the process that started it dies."""
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)

PARENT_CHECK_INTERVAL_S = 0.5  # how often a child process checks that its parent lives
PR_SET_PDEATHSIG = 1  # prctl(2) option: the signal this process gets when its parent dies
ORPHAN_EXIT_CODE = 1  # exit status of a child whose parent (the API server) died


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Linux: have the kernel send ``sig`` to this process when the thread that started it
    exits (SIGKILL included). Returns False where prctl is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def start_parent_watchdog(parent_alive: Callable[[], bool], on_death: Callable[[], None],
                          interval_s: float = PARENT_CHECK_INTERVAL_S) -> threading.Thread:
    """A daemon thread that calls ``on_death`` once ``parent_alive()`` turns False, checked
    every ``interval_s`` whatever the main thread is doing (a long batch step included)."""

    def watch() -> None:
        while parent_alive():
            time.sleep(interval_s)
        on_death()

    thread = threading.Thread(target=watch, name="parent-watchdog", daemon=True)
    thread.start()
    return thread


def exit_orphan() -> None:
    logger.error("the process that started this one is gone: exiting")
    os._exit(ORPHAN_EXIT_CODE)  # no atexit joins: nobody is left to read our queues


def exit_with_parent() -> None:
    """End this process when its parent (the API server or launcher) dies: a
    parent-death signal where the kernel has one, and a watchdog thread everywhere."""
    parent = multiprocessing.parent_process()
    ppid = os.getppid()

    def parent_alive() -> bool:
        return os.getppid() == ppid and (parent is None or parent.is_alive())

    set_parent_death_signal()
    if not parent_alive():  # it died before the signal was armed
        exit_orphan()
    start_parent_watchdog(parent_alive, exit_orphan)
