"""The files the replayed tool calls read: real files of a repository (``--repo``), picked deterministically with
``--seed``, and the text each client's tool returns for one (Claude Code's Read, Codex's ``cat`` through
exec_command), as the real clients write it.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("tierlm.bench")
SUFFIXES = (".py", ".md")
SKIPPED_DIRS = frozenset({"__pycache__", "node_modules", "build", "dist", "site-packages", "venv"})
MIN_FILE_CHARS = 200  # shorter files say too little to be worth a tool round
# Codex keeps the first and last 5000 characters of a longer command output (measured on Codex CLI 0.171.0)
CODEX_OUTPUT_LIMIT = 10_000
CODEX_KEPT_EACH_SIDE = 5_000


@dataclass(frozen=True)
class RepoFile:
    """One file a tool round reads: its absolute path, its path in the repository, its (capped) text."""

    path: str
    rel: str
    text: str


def default_repo() -> Path:
    """tierlm's own source tree: the folder above the installed tierlm.runtime package."""
    import tierlm.runtime

    return Path(tierlm.runtime.__file__).resolve().parent.parent


def candidates(repo: Path) -> list[Path]:
    """Readable .py/.md files under ``repo`` (hidden and build folders skipped), in sorted order."""
    out = []
    for root, dirs, files in os.walk(repo):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIPPED_DIRS
                         and not d.endswith(".egg-info"))
        out += [Path(root) / f for f in sorted(files) if f.endswith(SUFFIXES)]
    return out


def _read(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return text if len(text) >= MIN_FILE_CHARS else None


def capped(text: str, max_chars: int) -> str:
    """At most ``max_chars`` characters, cut after the last whole line that fits (a file the agent read in part)."""
    if len(text) <= max_chars:
        return text
    cut = text.rfind("\n", 0, max_chars)
    return text[:cut + 1] if cut > 0 else text[:max_chars]


def pick_files(repo: Path, count: int, rng: Any, max_chars: int) -> list[RepoFile]:
    """``count`` files of ``repo`` in a seeded order (distinct while the repository has enough; then again from the
    start), each capped at ``max_chars``."""
    if not repo.is_dir():
        raise SystemExit(f"tierlm bench agent: --repo {repo} is not a folder")
    paths = candidates(repo)
    order = [int(i) for i in rng.permutation(len(paths))] if paths else []
    out: list[RepoFile] = []
    for i in order:
        if len(out) == count:
            break
        text = _read(paths[i])
        if text is not None:
            out.append(RepoFile(str(paths[i].resolve()), paths[i].relative_to(repo).as_posix(),
                                capped(text, max_chars)))
    if not out:
        raise SystemExit(f"tierlm bench agent: no readable .py or .md file of at least {MIN_FILE_CHARS} characters "
                         f"under --repo {repo}")
    if len(out) < count:
        log.warning("agent: %s has %d usable files for %d tool reads; files are read again by later sessions",
                    repo, len(out), count)
        out = [out[i % len(out)] for i in range(count)]
    log.info("agent: %d files picked from %s (seed order), each capped at %d chars", len(out), repo, max_chars)
    return out


def claude_read_output(text: str) -> str:
    """Claude Code's Read result: every line numbered ``{n}\\t{line}`` from 1 (cat -n style; a final newline gives
    a last empty numbered line, as the real client sends it)."""
    return "\n".join(f"{n}\t{line}" for n, line in enumerate(text.split("\n"), 1))


def codex_exec_output(text: str, chunk_id: str) -> str:
    """Codex's exec_command output for ``cat``: its header (chunk id, wall time, exit code, original token count
    as bytes / 4 rounded up) and the output, the middle cut out past CODEX_OUTPUT_LIMIT characters as Codex does."""
    tokens = -(-len(text.encode("utf-8")) // 4)
    body = text
    if len(text) > CODEX_OUTPUT_LIMIT:
        omitted = len(text) - 2 * CODEX_KEPT_EACH_SIDE
        body = (f"Warning: truncated output (original token count: {tokens})\n"
                f"Total output lines: {len(text.splitlines())}\n\n"
                f"{text[:CODEX_KEPT_EACH_SIDE]}…{omitted} chars truncated…{text[-CODEX_KEPT_EACH_SIDE:]}")
    return (f"Chunk ID: {chunk_id}\nWall time: 0.0000 seconds\nProcess exited with code 0\n"
            f"Original token count: {tokens}\nOutput:\n{body}")
