"""`python -m tierlm.launch_server --model-path ...`: the SGLang-style way to start the server."""
from __future__ import annotations

import sys
from typing import Sequence

from tierlm.cli import cap_torch_isa


def main(argv: Sequence[str] | None = None) -> None:
    cap_torch_isa()
    from tierlm.server.commands.cli_args import parse_args
    from tierlm.server.commands.serve import run_server

    run_server(parse_args(sys.argv[1:] if argv is None else argv, prog="python -m tierlm.launch_server"))


if __name__ == "__main__":
    main()
