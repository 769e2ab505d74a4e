"""The `spotguard` command. Each subcommand lives in its part's own module, which exposes
`register(subparsers)`; this file only lists them, so `--help` imports nothing heavy.

The product commands are always installed. The test-double commands (`emulate`, `demo`: the
emulator; `dry-run`: the trainer) come from parts a product-only install leaves out
(setup.py's SPOTGUARD_PARTS=product): they are registered by module name only, and where the
part is missing the command still parses and exits 2 with a message saying so.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from spotguard import __version__
from spotguard.config import ConfigError

COMMAND_MODULES = (
    "spotguard.agent.watch",  # watch
    "spotguard.agent.cli",  # agent
    "spotguard.hooks.sidecar.cli",  # sidecar
    "spotguard.hooks.launch",  # launch
    "spotguard.supervisor.cli",  # supervisor
    "spotguard.supervisor.status_cli",  # status
    "spotguard.injector.cli",  # injector
    "spotguard.bench_cli",  # bench
)
KUBECTL_COMMAND_MODULES = ("spotguard.supervisor.status_cli",)  # `kubectl spotguard status`
# command -> (module, the part that provides it, help): parts not in the product image
OPTIONAL_COMMANDS = {
    "emulate": ("spotguard.emulator.cli", "spotguard.emulator", "run a cloud metadata emulator"),
    "dry-run": ("spotguard.trainer.dryrun_cli", "spotguard.trainer", "run a training job locally through "
                                                                      "simulated reclaims"),
    "demo": ("spotguard.emulator.demo", "spotguard.emulator", "emulate a cloud, schedule a reclaim, watch it"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spotguard",
        description="Turn spot reclaim notices and GPU faults into consistent training checkpoints.")
    parser.add_argument("--version", action="version", version=f"spotguard {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    for command, (module_name, part, help_text) in OPTIONAL_COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name not in (part, module_name):
                raise
            _register_missing(subparsers, command, part, help_text)
            continue
        module.register(subparsers)
    return parser


def _register_missing(subparsers: argparse._SubParsersAction, command: str, part: str, help_text: str) -> None:
    """`command` for a part this installation lacks: takes any arguments, exits 2 saying why."""
    # No option prefix: every argument, `--help` included, is taken as-is and the command says why it cannot run.
    p = subparsers.add_parser(command, help=f"{help_text} (not installed here)", prefix_chars="\0", add_help=False)
    p.add_argument("args", nargs="*", help=argparse.SUPPRESS)

    def not_installed(_args: argparse.Namespace) -> int:
        raise ConfigError(command, f"{part} is not installed (a product-only install, SPOTGUARD_PARTS=product); "
                                   "install the full spotguard package to use it")

    p.set_defaults(func=not_installed)


def main(argv: list[str] | None = None) -> int:
    return dispatch(build_parser(), argv)


def build_kubectl_parser() -> argparse.ArgumentParser:
    """The parser of `kubectl spotguard ...`: the commands that read the cluster as a user."""
    parser = argparse.ArgumentParser(prog="kubectl spotguard", description="spotguard as a kubectl plugin")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in KUBECTL_COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def kubectl_main(argv: list[str] | None = None) -> int:
    """`kubectl-spotguard` on PATH: kubectl runs it for `kubectl spotguard ...`; it offers the
    commands that read the cluster as a user (`status`)."""
    return dispatch(build_kubectl_parser(), argv)


def dispatch(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    """Runs the parsed command; a ConfigError exits 2 naming its field."""
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
