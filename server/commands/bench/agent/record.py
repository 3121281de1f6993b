"""`tierlm bench agent --record {claude-code,codex} --record-out FILE`: run the real client CLI against the capture
server (capture.py) in a temporary project folder holding two real files, and write its wire shape (extract.py) in
the format of recorded/*.json, which the replay reads.

Claude Code: ``claude -p "Review runtime/scheduler.py"`` (two Read rounds), ``claude -p --continue "Review it
again"``, and ``claude -p "Use an agent to summarize request.py"`` (an Explore sub-agent with one Read round), with
HOME in a temporary folder, ANTHROPIC_BASE_URL at the capture server and Claude Code's own switches for its traffic
to Anthropic turned off. Codex: ``codex exec --skip-git-repo-check "Review runtime/scheduler.py"`` (two exec_command
rounds) then ``codex exec --skip-git-repo-check resume --last "Review again"``, with a temporary CODEX_HOME whose
config.toml points a provider at the capture server. Secrets (x-api-key, authorization) never reach the file.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierlm.server.commands.bench.agent.capture import CaptureServer, Captured, Script
from tierlm.server.commands.bench.agent.extract import ExtractError, claude_code, codex
from tierlm.server.commands.bench.agent.files import default_repo

log = logging.getLogger("tierlm.bench")
PROJECT_FILES = ("runtime/scheduler.py", "runtime/request.py")  # copied from tierlm's own source tree
INSTALL = {"claude": "npm install -g @anthropic-ai/claude-code", "codex": "npm install -g @openai/codex"}
CODEX_CONFIG = """model = "{model}"
model_provider = "tierlm"
check_for_update_on_startup = false

[analytics]
enabled = false

[model_providers.tierlm]
name = "tierlm"
base_url = "{base_url}/v1"
wire_api = "responses"
"""
CLAUDE_QUIET = {"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
                "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1"}


class RecordError(RuntimeError):
    pass


@dataclass
class Folders:
    """The temporary project (two real files) and the CLI's home folders."""

    root: Path

    @property
    def project(self) -> Path:
        return self.root / "proj"

    @property
    def home(self) -> Path:
        return self.root / "home"

    def file(self, rel: str) -> str:
        return str(self.project / rel)

    def make(self) -> "Folders":
        for rel in PROJECT_FILES:
            (self.project / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(default_repo() / rel, self.project / rel)
        self.home.mkdir(parents=True, exist_ok=True)
        return self


def cli(name: str) -> str:
    """The CLI's path; a RecordError naming how to install it where it is not on PATH."""
    path = shutil.which(name)
    if path is None:
        raise RecordError(f"the `{name}` CLI is not installed (not on PATH); install it ({INSTALL[name]}) to record "
                          "its shape")
    return path


def version(exe: str) -> str:
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    return (out.stdout.strip() or out.stderr.strip()).splitlines()[0] if out.returncode == 0 else "unknown version"


def run_cli(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> None:
    """One CLI run; its output is logged (a failing run is judged by what it sent, in extract.py)."""
    log.info("record: running %s", " ".join(cmd[:1] + [repr(a) if " " in a else a for a in cmd[1:]]))
    try:
        done = subprocess.run(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RecordError(f"{Path(cmd[0]).name} did not finish within {timeout:.0f} s (--record-timeout)") from None
    if done.returncode != 0:
        log.warning("record: %s exited with status %d: %s", Path(cmd[0]).name, done.returncode,
                    (done.stderr or done.stdout).strip()[-600:])


def record_claude_code(folders: Folders, model: str, timeout: float) -> dict[str, Any]:
    exe = cli("claude")
    scheduler, request = (folders.file(rel) for rel in PROJECT_FILES)
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(folders.home), "ANTHROPIC_API_KEY": "none",
           "ANTHROPIC_DEFAULT_HAIKU_MODEL": model, **CLAUDE_QUIET}
    args = ["--model", model, "--allowedTools", "Read", "Agent"]
    runs: list[list[Captured]] = []
    with CaptureServer(Script(reads=[scheduler, request])) as cap:
        env["ANTHROPIC_BASE_URL"] = cap.url
        for prefix, prompt, script in (
                (["-p"], f"Review {PROJECT_FILES[0]}", Script(reads=[scheduler, request])),
                (["--continue", "-p"], "Review it again", Script(reads=[scheduler, request])),
                (["-p"], "Use an agent to summarize request.py", Script(reads=[request],
                                                                         agent_target=PROJECT_FILES[1]))):
            cap.script = script
            run_cli([exe, *prefix, prompt, *args], folders.project, env, timeout)
            runs.append(cap.take())
    label = version(exe)
    return claude_code(*runs, client=f"Claude Code {label.split()[0]}",
                       recorded=f"{datetime.date.today()}, claude -p against a capture server "
                                "(tierlm bench agent --record claude-code)")


def record_codex(folders: Folders, model: str, timeout: float) -> dict[str, Any]:
    exe = cli("codex")
    scheduler, request = (folders.file(rel) for rel in PROJECT_FILES)
    codex_home = folders.root / "codex_home"
    codex_home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))}
    env.update(CODEX_HOME=str(codex_home), HOME=str(folders.home), NO_BROWSER="1")
    runs: list[list[Captured]] = []
    with CaptureServer(Script(reads=[scheduler, request])) as cap:
        (codex_home / "config.toml").write_text(CODEX_CONFIG.format(model=model, base_url=cap.url))
        for args in (["exec", "--skip-git-repo-check", f"Review {PROJECT_FILES[0]}"],
                     ["exec", "--skip-git-repo-check", "resume", "--last", "Review again"]):
            run_cli([exe, *args], folders.project, env, timeout)
            runs.append(cap.take())
    label = version(exe)
    return codex(*runs, client=f"Codex CLI {label.split()[-1]}",
                 recorded=f"{datetime.date.today()}, codex exec / codex exec resume --last against a capture server")


def record(client: str, out: Path, model: str, timeout: float) -> dict[str, Any]:
    """Record ``client``'s shape into ``out``; the shape."""
    with tempfile.TemporaryDirectory(prefix="tierlm-agent-record-") as tmp:
        folders = Folders(Path(tmp)).make()
        shape = (record_claude_code if client == "claude-code" else record_codex)(folders, model, timeout)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(shape, indent=1, ensure_ascii=False))
    log.info("record: %s shape written to %s (%d bytes)", shape["client"], out, out.stat().st_size)
    return shape


def main(ns: argparse.Namespace) -> int:
    """`tierlm bench agent --record`: 0 when the shape was written, 1 with one line saying why not."""
    if not ns.record_out:
        print("tierlm bench agent: --record needs --record-out FILE (where the shape goes)", file=sys.stderr)
        return 2
    try:
        shape = record(ns.record, Path(ns.record_out), ns.record_model, ns.record_timeout)
    except (RecordError, ExtractError) as e:
        print(f"tierlm bench agent --record {ns.record}: {e}", file=sys.stderr)
        return 1
    print(f"{shape['client']}: shape written to {ns.record_out}")
    return 0
