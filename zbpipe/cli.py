"""The ``zbpipe`` command: one parser tree over its subcommands, each a module exposing
``add_arguments(p)`` and ``run_command(args)`` as a Subcommand: plan / simulate / draw a
schedule (zbpipe/schedule_commands.py), ``bench`` (zbpipe/bench/command.py: the microbenchmark
on emulated devices) and ``train`` when zbpipe.train exists (zbpipe/train/main.py). A user error,
of any subcommand, is a CliError: one line, exit status 2, no traceback."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import os
import sys
from typing import Callable

USAGE_ERROR = 2  # the exit status of a user error, as argparse's


class CliError(Exception):
    """A user error: reported as one line, "<prog>: error: <message>", exit status 2. `prog`:
    the command that reports it (default: the subcommand's error_prog)."""

    def __init__(self, message: str, prog: str | None = None):
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """argparse prints the usage and exits on an error; zbpipe reports one line."""
    error_prog = "zbpipe"

    def error(self, message):
        raise CliError(message, self.error_prog)


@dataclasses.dataclass(frozen=True)
class Subcommand:
    """One subcommand: its arguments, what runs it (an exit status), and its help."""
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run_command: Callable[[argparse.Namespace], int]
    help: str
    error_prog: str = "zbpipe"  # the prefix of its one-line errors
    description: str | None = None
    epilog: str | None = None
    formatter_class: type = argparse.RawDescriptionHelpFormatter
    handles: tuple = ()  # exception types also reported as user errors (zbpipe.ScheduleError, ...)


def _has_train() -> bool:
    return importlib.util.find_spec("zbpipe.train") is not None


def subcommands() -> dict[str, Subcommand]:
    """Every subcommand by name, in the order --help lists them."""
    from . import schedule_commands

    out = dict(schedule_commands.COMMANDS)
    if _has_train():
        out["train"] = importlib.import_module("zbpipe.train.main").COMMAND
    out["bench"] = importlib.import_module("zbpipe.bench.command").COMMAND
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="zbpipe", description="Pipeline schedules: plan, simulate, draw.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, cmd in subcommands().items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.description, epilog=cmd.epilog,
                           formatter_class=cmd.formatter_class)
        p.error_prog = cmd.error_prog
        cmd.add_arguments(p)
        p.set_defaults(subcommand=cmd)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    cmd = None
    try:
        try:
            args, extra = parser.parse_known_args(argv)
        except SystemExit as exc:  # --help
            return int(exc.code or 0)
        cmd = getattr(args, "subcommand", None)
        if extra:  # the subcommand's error, not the root's (parse_args would report it as "zbpipe")
            raise CliError(f"unrecognized arguments: {' '.join(extra)}")
        if cmd is None:
            parser.print_help()
            return USAGE_ERROR
        try:
            return int(cmd.run_command(args) or 0)
        except cmd.handles as exc:
            raise CliError(str(exc)) from None
    except CliError as exc:
        prog = exc.prog or (cmd.error_prog if cmd is not None else "zbpipe")
        print(f"{prog}: error: {str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr)
        return USAGE_ERROR
    except BrokenPipeError:  # `zbpipe ... | head`: the reader left; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def main_of(name: str) -> Callable[[list[str] | None], int]:
    """`name`'s main(argv) for `python -m zbpipe.<name>`: the same as `zbpipe <name> ...`."""
    def run(argv: list[str] | None = None) -> int:
        return main([name, *(sys.argv[1:] if argv is None else argv)])
    return run


if __name__ == "__main__":
    raise SystemExit(main())
