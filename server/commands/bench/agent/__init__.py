"""`tierlm bench agent`: coding-agent sessions replayed in the exact wire shapes of the real clients (Claude Code,
Codex CLI), recorded from the real CLIs (recorded/*.json; `--record` records them again).

The bench module interface (command.py): ``add_arguments(p)`` and ``run(ns, ctx) -> Report``; ``needs_model(ns)``
and ``run_without_model(ns)`` for ``--record``, which runs a CLI against a capture server and needs no model.
The files, each with one job: shapes.py (the recorded shapes, trimming), files.py (the files tool rounds read),
ids.py, plan.py, claude_code.py / codex.py (one session's requests), sessions.py (all sessions), prompts.py (tierlm's
prompt of each request), workload.py, translate.py (chat completions for peers), client.py (HTTP), replay.py (the
run), tables.py (the report); capture.py, extract.py and record.py (--record).
"""
from __future__ import annotations

import argparse

from tierlm.server.commands.bench.agent.options import add_arguments
from tierlm.server.commands.bench.agent.replay import run

__all__ = ["add_arguments", "run", "needs_model", "run_without_model"]


def needs_model(ns: argparse.Namespace) -> bool:
    """--record runs a client's CLI against a capture server: no model, no tierlm server."""
    return ns.record is None


def run_without_model(ns: argparse.Namespace) -> int:
    from tierlm.server.commands.bench.agent.record import main

    return main(ns)
