"""What the command line says on stderr besides its results and errors, set once per command by -q / -v:
quiet (results and errors only), normal (load lines, progress bars, the stats line) or verbose (also the resolved
setup: paths, device, threads, sampling, each phase's time). Warnings are not progress: they print at every level."""

from __future__ import annotations

import argparse
import sys

QUIET, NORMAL, VERBOSE = -1, 0, 1
_level = NORMAL


def set_level(level: int) -> None:
    global _level
    _level = level


def shows_progress() -> bool:
    """Whether load lines and progress bars show (not with -q)."""
    return _level >= NORMAL


def info(message: str) -> None:
    """A load or progress line (dropped with -q)."""
    if _level >= NORMAL:
        print(message, file=sys.stderr, flush=True)


def detail(message: str) -> None:
    """A line of the resolved setup or a phase's time (-v only)."""
    if _level >= VERBOSE:
        print(message, file=sys.stderr, flush=True)


def add_options(p: argparse.ArgumentParser, verbose: bool = True) -> None:
    """-q/--quiet, and -v/--verbose where a command has more to say; the command's args.verbosity."""
    levels = p.add_mutually_exclusive_group()
    levels.add_argument("-q", "--quiet", dest="verbosity", action="store_const", const=QUIET, default=NORMAL,
                        help="nothing on stderr but errors and warnings (no load lines, progress or stats)")
    if verbose:
        levels.add_argument("-v", "--verbose", dest="verbosity", action="store_const", const=VERBOSE,
                            help="also the resolved checkpoint path, device, threads, sampling settings and the "
                                 "time of each phase")
