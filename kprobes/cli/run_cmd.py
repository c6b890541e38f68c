"""``kprobes run MODULE.py [PARAM=VALUE ...] (-p PID | -c CMD)``: an instrumentation module.

The equivalent of loading a kprobes kernel module: the Python file's ``init(target)``
registers probes (its handlers print what they like, as a module's handlers call printk),
the program runs until it exits or Ctrl-C (SIGINT, obeyed at a safe point: ``sigint.py``),
then the optional ``exit(target)`` runs (as at rmmod) and every probe is removed.
``PARAM=VALUE`` words set the module's global variables before ``init`` runs, like
``insmod mod.ko func=...`` sets ``module_param`` variables; the value is converted to the
type of the variable's default.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

from kprobes.cli.sigint import (
    RunInterrupted,
    SafeInterrupt,
    is_in_trace_stop,
    sigint_ignored,
)
from kprobes.cli.targets import add_target_arguments, open_target
from kprobes.errors import SpecError, TargetError


def add_parser(sub: Any, help: str) -> None:
    p = sub.add_parser("run", help=help)
    p.add_argument("module", help="the module file (MODULE.py)")
    p.add_argument("params", nargs="*", metavar="PARAM=VALUE", help="module parameters")
    add_target_arguments(p, several=False)
    p.add_argument("--follow-forks", action="store_true", help="probe forked children too")
    p.set_defaults(func=run)


def load_module(path: str) -> ModuleType:
    if not os.path.isfile(path):
        raise TargetError(f"no module file {path}")
    name = "kprobes_module_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise TargetError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    if not callable(getattr(module, "init", None)):
        raise SpecError(f"{path} has no init(target) function", column=0, text=path)
    return module


def set_params(module: ModuleType, params: list[str]) -> None:
    for text in params:
        name, sep, value = text.partition("=")
        if not sep or not name.isidentifier():
            raise SpecError(f"module parameter {text!r} is not NAME=VALUE", column=0, text=text)
        if not hasattr(module, name) or name.startswith("_") or callable(getattr(module, name)):
            raise SpecError(f"the module has no parameter {name!r}", column=0, text=text)
        default = getattr(module, name)
        converted: object
        try:
            if isinstance(default, bool):
                converted = value.lower() in ("1", "y", "yes", "true", "on")
            elif isinstance(default, int):
                converted = int(value, 0)
            elif isinstance(default, float):
                converted = float(value)
            else:
                converted = value
        except ValueError as exc:
            raise SpecError(
                f"parameter {name}: {value!r} is not a {type(default).__name__}",
                column=len(name) + 1,
                text=text,
            ) from exc
        setattr(module, name, converted)


def run(args: argparse.Namespace) -> int:
    module = load_module(args.module)
    set_params(module, args.params)
    proc = open_target(args, follow_forks=args.follow_forks)
    exit_fn = getattr(module, "exit", None)
    interrupt = SafeInterrupt(proc.end_run, lambda: proc.is_mid_stop or is_in_trace_stop(proc.pid))
    try:
        with interrupt.installed():
            module.init(proc)
            interrupt.is_placing = False
            # Ctrl-C ends the run, like rmmod
            with contextlib.suppress(KeyboardInterrupt, RunInterrupted):
                if not interrupt.interrupted:
                    proc.run()
        if callable(exit_fn):
            exit_fn(proc)
    finally:
        with sigint_ignored():
            proc.close()
    return 0
