"""`tierlm bench agent`'s own options, and their checks (one line naming the fix, before any server starts)."""
from __future__ import annotations

import argparse

from tierlm.server.commands.bench.peers import AgainstAction, parse_against

CLIENT_CHOICES = ("claude-code", "codex", "both")
OWN = "tierlm"


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("agent replay (coding-agent sessions in the recorded wire shapes of the real clients)")
    g.add_argument("--client", choices=CLIENT_CHOICES, default="claude-code",
                   help="whose recorded shape to replay (both: each client's sessions, all at once)")
    g.add_argument("--sessions", type=int, default=2, help="parallel sessions per client")
    g.add_argument("--turns", type=int, default=3, help="tool rounds per session after its first request")
    g.add_argument("--subagent", action="store_true",
                   help="claude-code: at turn 1 the session calls the Agent tool; an Explore sub-agent runs its own "
                        "short session before the main one continues")
    g.add_argument("--subagent-reads", type=int, default=1, help="Read rounds of each sub-agent (with --subagent)")
    g.add_argument("--side-requests", action=argparse.BooleanOptionalAction, default=None,
                   help="a short request without tools sent with each session's first (long) request, as Claude "
                        "Code's title and summary requests; default: on for claude-code, off for codex")
    g.add_argument("--side-tokens", type=int, default=500, help="about how many tokens a side request's text has")
    g.add_argument("--continued", action=argparse.BooleanOptionalAction, default=True,
                   help="end each session with a continued-session turn (claude -p --continue, codex exec resume "
                        "--last)")
    g.add_argument("--restart", action="store_true",
                   help="restart tierlm's server after the sessions (its L3 writes finished first) and send each "
                        "session's continued turn to the restarted server: its prefix comes from L3")
    g.add_argument("--against", action=AgainstAction, type=parse_against, default=[], metavar="NAME=URL",
                   help="another server to replay the same sessions against after tierlm, e.g. "
                        "vllm=http://127.0.0.1:8000 (repeatable; it must serve the same model folder)")
    g.add_argument("--repo", default=None, metavar="DIR",
                   help="the repository whose .py/.md files the tool rounds read (default: tierlm's own source tree)")
    g.add_argument("--max-file-chars", type=int, default=16000, help="cap on one file read by a tool round")
    g.add_argument("--trim-tools", type=int, default=None, metavar="N",
                   help="keep N tools per request (the ones the replay calls kept): a smaller prompt, same shape")
    g.add_argument("--instructions-chars", type=int, default=None, metavar="N",
                   help="cut the client's instruction texts and tool descriptions to N characters each")
    g.add_argument("--context-length", type=int, default=None,
                   help="tierlm's context length (default: the model's, raised to the longest prompt where that is "
                        "shorter)")
    g.add_argument("--max-new-tokens", type=int, default=16,
                   help="max_tokens / max_output_tokens of every request (the clients ask for 32000)")
    g.add_argument("--hicache-ratio", type=float, default=2.0,
                   help="tierlm's host tier as a multiple of its device pool")
    r = p.add_argument_group("recording a client's shape (needs the client's CLI; no model, no server)")
    r.add_argument("--record", choices=("claude-code", "codex"), default=None,
                   help="run the real CLI against a capture server and write its wire shape (the format of the "
                        "recorded/*.json files this replay reads)")
    r.add_argument("--record-out", default=None, metavar="FILE", help="where --record writes the shape")
    r.add_argument("--record-model", default="tiny-coder", help="the model name the CLI is told to use")
    r.add_argument("--record-timeout", type=float, default=300.0, help="seconds one CLI run may take")


def side_requests(ns: argparse.Namespace, client: str) -> bool:
    """--side-requests as given, else on for claude-code only (its interactive title/summary requests)."""
    return ns.side_requests if ns.side_requests is not None else client == "claude-code"


def clients(ns: argparse.Namespace) -> list[str]:
    return ["claude-code", "codex"] if ns.client == "both" else [ns.client]


def check(ns: argparse.Namespace) -> None:
    """SystemExit naming the fix for options that cannot run."""
    prog = "tierlm bench agent"
    if ns.sessions < 1 or ns.turns < 0 or ns.max_new_tokens < 1 or ns.max_file_chars < 1 or ns.side_tokens < 1:
        raise SystemExit(f"{prog}: need --sessions >= 1, --turns >= 0, --max-new-tokens >= 1, --max-file-chars >= 1 "
                         "and --side-tokens >= 1")
    if ns.subagent and (ns.turns < 1 or ns.subagent_reads < 1):
        raise SystemExit(f"{prog}: --subagent calls the Agent tool at turn 1: it needs --turns >= 1 and "
                         "--subagent-reads >= 1")
    if ns.trim_tools is not None and ns.trim_tools < 1:
        raise SystemExit(f"{prog}: --trim-tools must be >= 1")
    if ns.instructions_chars is not None and ns.instructions_chars < 1:
        raise SystemExit(f"{prog}: --instructions-chars must be >= 1")
    if ns.restart and not ns.continued:
        raise SystemExit(f"{prog}: --restart sends each session's continued turn to the restarted server; drop "
                         "--no-continued")
    if any(name == OWN for name, _ in ns.against):
        raise SystemExit(f"{prog}: the name {OWN!r} is tierlm's own column; give the peer another name")
    if ns.record_out and not ns.record:
        raise SystemExit(f"{prog}: --record-out goes with --record claude-code|codex")
