"""The `tierlm` command: `tierlm serve ...`, `tierlm doctor`, `tierlm bench ...`."""
from __future__ import annotations

import importlib
import os
import sys
from typing import Sequence

from tierlm.platforms.cpu_features import torch_env_for_cap

USAGE = """usage: tierlm <command> [options]

commands:
  serve    start the OpenAI-compatible server (tierlm serve --help for flags)
  doctor   check this machine: devices, memory, installed backends
  bench    run benchmarks (starts its own servers): prefix, multiturn, decode

Run `tierlm <command> --help` for a command's options."""

# Commands implemented in their own modules, imported only when used (keeps `tierlm serve` start-up lean).
_LAZY_COMMANDS = {"doctor": "tierlm.server.commands.doctor", "bench": "tierlm.server.commands.bench.command"}


def cap_torch_isa() -> None:
    """TIERLM_CPU_ISA reaches torch's own kernels too: set before anything imports torch."""
    os.environ.update(torch_env_for_cap(os.environ))


def _run_lazy(command: str, argv: list[str]) -> int:
    module_name = _LAZY_COMMANDS[command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise  # the command exists but one of its dependencies is missing: show the real error
        print(f"tierlm {command}: this command is not available in this build ({module_name} is missing)",
              file=sys.stderr)
        return 2
    result = module.main(argv)
    return int(result or 0)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    cap_torch_isa()
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        from importlib.metadata import version

        print(f"tierlm {version('tierlm')}")
        return 0
    command, rest = args[0], args[1:]
    if command == "serve":
        from tierlm.server.commands.cli_args import parse_args
        from tierlm.server.commands.serve import run_server

        run_server(parse_args(rest, prog="tierlm serve"))
        return 0
    if command in _LAZY_COMMANDS:
        return _run_lazy(command, rest)
    print(f"tierlm: unknown command '{command}'\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
