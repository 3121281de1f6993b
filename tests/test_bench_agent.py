"""`tierlm bench agent`: coding-agent sessions replayed in the recorded wire shapes of Claude Code and Codex CLI.

The session builder is checked against the recorded shapes themselves (the first request is the recorded one but
for the per-session ids, each turn appends exactly what the client appends, cache_control moves as Claude Code
moves it); the client's stream parsing against canned streams; one end-to-end run on the demo model checks
behaviour (every request answered, turns reuse the previous prompt, the turn after a restart reads L3). Timings
are never asserted.
"""
from __future__ import annotations

import asyncio
import copy
import json
import re
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest

from tierlm.server.commands.bench import command as bench_cmd
from tierlm.server.commands.bench.agent import client as agent_client
from tierlm.server.commands.bench.agent.claude_code import BILLING_RE
from tierlm.server.commands.bench.agent.files import RepoFile, claude_read_output, codex_exec_output, pick_files
from tierlm.server.commands.bench.agent.plan import CONTINUED, MAIN, SIDE, SUBAGENT, PlannedRequest
from tierlm.server.commands.bench.agent.prompts import diverged_at, previous_in_chain
from tierlm.server.commands.bench.agent.sessions import SessionOptions, build_sessions, files_needed
from tierlm.server.commands.bench.agent.shapes import load_shape, trim
from tierlm.server.commands.bench.openai_load import Endpoint

MAX_NEW = 16


def _files(n: int, chars: int = 300) -> list[RepoFile]:
    rng = np.random.default_rng(7)
    return [RepoFile(f"/repo/pkg/f{i}.py", f"pkg/f{i}.py",
                     "\n".join(f"line {j} {rng.integers(1000)}" for j in range(chars // 12)) + "\n")
            for i in range(n)]


def _sessions(client: str, *, sessions: int = 2, turns: int = 3, subagent: int = 0, side: bool = True,
              shape=None):
    o = SessionOptions(sessions, turns, subagent, True, side, MAX_NEW)
    files = _files(files_needed(client, o))
    plans, solo = build_sessions(shape or load_shape(client), o, files, np.random.default_rng(0), lambda t: t[:200])
    return plans, solo, files


def _cache_points(body: dict) -> list[tuple[int, int]]:
    return [(i, j) for i, m in enumerate(body["messages"]) if isinstance(m["content"], list)
            for j, b in enumerate(m["content"]) if "cache_control" in b]


def _without_cache(messages: list[dict]) -> list[dict]:
    out = copy.deepcopy(messages)
    for m in out:
        for b in m["content"] if isinstance(m["content"], list) else []:
            b.pop("cache_control", None)
    return out


def _billing_suffix(body: dict) -> str:
    return BILLING_RE.search(body["system"][0]["text"]).group(2)


def _session_id(body: dict) -> str:
    return json.loads(body["metadata"]["user_id"])["session_id"]


# ---------------------------------------------------------------- Claude Code's shape
def test_claude_code_first_request_is_the_recorded_one_but_for_its_session() -> None:
    recorded = load_shape("claude-code").data
    plans, _, _ = _sessions("claude-code")
    for plan in plans:
        body = copy.deepcopy(plan.requests[0].body)
        assert (body.pop("max_tokens"), body.pop("temperature")) == (MAX_NEW, 0)
        assert body["messages"][0]["content"][-1]["text"] == f"Review {plan.files[0]}"
        # put back what is per session: the ids, the billing suffix, the user's prompt
        text = json.dumps(body).replace(_session_id(body), _session_id(recorded["first_request"]))
        text = text.replace(f".{_billing_suffix(body)};", f".{_billing_suffix(recorded['first_request'])};")
        body = json.loads(text)
        body["messages"][0]["content"][-1]["text"] = recorded["first_request"]["messages"][0]["content"][-1]["text"]
        assert body == {k: v for k, v in recorded["first_request"].items() if k != "max_tokens"}
        assert plan.requests[0].headers["x-claude-code-session-id"] == _session_id(plan.requests[0].body)
        assert (plan.requests[0].path, plan.requests[0].query) == ("/v1/messages", "beta=true")


def test_claude_code_ids_are_per_session_and_the_billing_suffix_constant_within_one() -> None:
    plans, solo, _ = _sessions("claude-code", subagent=1)
    for plan in plans:
        main = [r for r in plan.all_requests() if r.kind in (MAIN, CONTINUED, SIDE)]
        sub = [r for r in plan.requests if r.kind == SUBAGENT]
        assert {_billing_suffix(r.body) for r in main} == {_billing_suffix(main[0].body)}
        assert {_session_id(r.body) for r in main + sub} == {r.headers["x-claude-code-session-id"] for r in main + sub}
        assert len({_session_id(r.body) for r in main + sub}) == 1  # a sub-agent keeps its session's id
        assert {_billing_suffix(r.body) for r in sub} != {_billing_suffix(main[0].body)}  # ...not its suffix
        assert "cc_is_subagent=true" in sub[0].body["system"][0]["text"]
        assert sub[0].headers["x-claude-code-agent-id"].startswith("a")
    a, b = plans[0].requests[0], plans[1].requests[0]
    assert _session_id(a.body) != _session_id(b.body) and _billing_suffix(a.body) != _billing_suffix(b.body)
    assert a.body["messages"][0]["content"][-1]["text"] != b.body["messages"][0]["content"][-1]["text"]
    assert solo is not None and solo.kind == SIDE and "tools" not in solo.body


def test_claude_code_cache_control_sits_on_the_last_user_block_only() -> None:
    plans, _, _ = _sessions("claude-code", subagent=1)
    for r in (r for p in plans for r in p.all_requests() if r.kind != SIDE):  # a side request is no session's
        last_user = max(i for i, m in enumerate(r.body["messages"]) if m["role"] == "user")
        assert _cache_points(r.body) == [(last_user, len(r.body["messages"][last_user]["content"]) - 1)], r.kind


def test_claude_code_turns_append_exactly_the_recorded_turns() -> None:
    shape = load_shape("claude-code")
    recorded = shape.data
    plans, _, files = _sessions("claude-code", turns=3, subagent=1)
    plan = plans[0]
    main = [r for r in plan.requests if r.kind == MAIN]
    sub = [r for r in plan.requests if r.kind == SUBAGENT]
    reads = iter(files[:2])  # session 0: two main reads (turn 1 is the Agent call), then the sub-agent's read
    for prev, cur in zip(main, main[1:]):
        assert {k: v for k, v in cur.body.items() if k != "messages"} == \
            {k: v for k, v in prev.body.items() if k != "messages"}  # tools, system, thinking: unchanged
        n = len(prev.body["messages"])
        assert _without_cache(cur.body["messages"][:n]) == _without_cache(prev.body["messages"])
        assistant, user = cur.body["messages"][n:]
        if cur.turn == 1:  # the Agent call, with the sub-agent's answer as its result
            expect = copy.deepcopy(recorded["subagent_call"])
            tool = next(b for b in assistant["content"] if b["type"] == "tool_use")
            assert tool["name"] == "Agent" and tool["input"]["prompt"] == sub[0].body["messages"][0]["content"][-1][
                "text"]
        else:
            f = next(reads)
            expect = copy.deepcopy(recorded["tool_turn"])
            tool = next(b for b in assistant["content"] if b["type"] == "tool_use")
            assert tool["input"] == {"file_path": f.path}
            assert user["content"][0]["content"] == claude_read_output(f.text)
            expect[1]["content"][0]["content"] = user["content"][0]["content"]
        for b_exp, b in zip(expect[0]["content"] + expect[1]["content"], assistant["content"] + user["content"]):
            for key in ("signature", "id", "tool_use_id", "input"):  # fresh ids, this turn's file
                if key in b_exp:
                    b_exp[key] = b[key]
        assert [assistant, user] == expect
    cont = plan.continued
    assert cont is not None and cont.kind == CONTINUED and cont.turn == 4
    final = cont.body["messages"][len(main[-1].body["messages"]):]
    expect = copy.deepcopy(recorded["final_turn"])
    expect[0]["content"][0]["signature"] = final[0]["content"][0]["signature"]
    assert final == expect
    # the sub-agent: its own recorded first request, then a Read round without thinking (it has none)
    first = copy.deepcopy(sub[0].body)
    rec = recorded["subagent_first_request"]
    assert first["tools"] == rec["tools"] and first["system"][1:] == rec["system"][1:] and "thinking" not in first
    appended = sub[1].body["messages"][len(first["messages"]):]
    assert [b["type"] for b in appended[0]["content"]] == ["text", "tool_use"]


def test_claude_read_output_numbers_lines_as_the_recorded_prompt() -> None:
    assert claude_read_output("a\nb\n") == "1\ta\n2\tb\n3\t"
    recorded = load_shape("claude-code").data["first_request"]
    assert "cat -n format" in json.dumps(recorded["tools"])  # the Read tool's own description of its output


# ---------------------------------------------------------------- Codex's shape
def test_codex_first_request_is_the_recorded_one_but_for_its_session() -> None:
    recorded = load_shape("codex").data
    plans, solo, _ = _sessions("codex", side=False)
    keys = set()
    for plan in plans:
        r = plan.requests[0]
        body = copy.deepcopy(r.body)
        assert (body.pop("max_output_tokens"), body.pop("temperature")) == (MAX_NEW, 0)
        assert body["prompt_cache_key"] == r.headers["session-id"] != recorded["first_request"]["prompt_cache_key"]
        keys.add(body["prompt_cache_key"])
        assert body["input"][-1]["content"][0]["text"] == f"Review {plan.files[0]}"
        body["input"][-1]["content"] = recorded["first_request"]["input"][-1]["content"]
        uuid = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
        assert uuid.sub("ID", json.dumps(body)) == uuid.sub("ID", json.dumps(recorded["first_request"]))
        assert "01a252fd" not in json.dumps([r.body, r.headers])  # no id of the recorded session is left
    assert len(keys) == 2 and solo is None


def test_codex_turns_append_exactly_the_recorded_items() -> None:
    recorded = load_shape("codex").data
    plans, _, files = _sessions("codex", turns=2, side=False)
    main = plans[0].requests
    for k, (prev, cur) in enumerate(zip(main, main[1:])):
        n = len(prev.body["input"])
        assert cur.body["input"][:n] == prev.body["input"]
        new = cur.body["input"][n:]
        assert [i["type"] for i in new] == [i["type"] for i in recorded["tool_turn"]]
        f = files[k]
        assert json.loads(new[1]["arguments"]) == {"cmd": f"cat {f.path}"} and new[1]["call_id"] == new[2]["call_id"]
        assert new[2]["output"].endswith("Output:\n" + f.text) and new[2]["output"].startswith("Chunk ID: ")
    final = plans[0].continued.body["input"][len(main[-1].body["input"]):]
    assert [(i["type"], i.get("role")) for i in final] == [(i["type"], i.get("role")) for i in recorded["final_turn"]]


def test_codex_exec_output_cuts_the_middle_of_long_outputs() -> None:
    short = codex_exec_output("abcd\n" * 3, "a1b2c3")
    assert short == ("Chunk ID: a1b2c3\nWall time: 0.0000 seconds\nProcess exited with code 0\nOriginal token count: "
                     "4\nOutput:\nabcd\nabcd\nabcd\n")
    text = "x" * 12_000 + "\n"
    long = codex_exec_output(text, "000000")
    assert "Warning: truncated output (original token count: 3001)\nTotal output lines: 1\n\n" in long
    assert "…2001 chars truncated…" in long and long.endswith("x" * 4999 + "\n")


# ---------------------------------------------------------------- trimming, files, prompts
def test_trimming_keeps_the_called_tools_and_the_structure() -> None:
    shape = trim(load_shape("claude-code"), 2, 100)
    first = shape.data["first_request"]
    assert [t["name"] for t in first["tools"]] == ["Agent", "Read"]
    assert all(len(t["description"]) <= 100 for t in first["tools"])
    assert len(first["system"]) == 3 and first["system"][0]["text"].startswith("x-anthropic-billing-header")
    assert [m["role"] for m in first["messages"]] == ["user", "system"] and len(first["messages"][1]["content"]) == 100
    assert [t["name"] for t in shape.data["subagent_first_request"]["tools"]] == ["Bash", "Read"]
    assert shape.trimmed and "2 tools per request" in shape.trimmed[0]
    cx = trim(load_shape("codex"), 1, 50).data["first_request"]
    assert [t["name"] for t in cx["tools"]] == ["exec_command"]
    assert cx["input"][-1]["content"][0]["text"] == "Review runtime/scheduler.py"  # the prompt is not cut
    assert all(len(p["text"]) <= 50 for it in cx["input"][:-1] for p in it["content"])
    assert load_shape("codex").data["first_request"]["tools"][0]["name"] == "exec_command"  # the shape is untouched


def test_files_are_picked_deterministically_and_capped(tmp_path: Path) -> None:
    for i in range(6):
        (tmp_path / f"m{i}.py").write_text(f"# module {i}\n" + "x = 1\n" * 100)
    (tmp_path / "tiny.py").write_text("x = 1\n")  # too short to be worth a round
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "h.py").write_text("y = 2\n" * 100)
    a = pick_files(tmp_path, 4, np.random.default_rng(3), 100)
    b = pick_files(tmp_path, 4, np.random.default_rng(3), 100)
    assert a == b and len({f.rel for f in a}) == 4
    assert all(f.rel.startswith("m") and len(f.text) <= 100 and f.text.endswith("\n") for f in a)


def test_diverged_at_and_conversation_chains() -> None:
    assert diverged_at(None, [1, 2]) is None
    assert diverged_at([1, 2, 3], [1, 2, 3, 4]) == 3 and diverged_at([1, 2, 3], [1, 9, 3]) == 1
    plans, solo, _ = _sessions("claude-code", turns=2, subagent=1)
    every = [r for p in plans for r in p.all_requests()] + [solo]
    prev = previous_in_chain(every)
    p0 = plans[0]
    main = [r for r in p0.requests if r.kind == MAIN]
    sub = [r for r in p0.requests if r.kind == SUBAGENT]
    assert prev[id(main[1])] is main[0] and prev[id(sub[1])] is sub[0] and id(sub[0]) not in prev
    assert prev[id(p0.continued)] is main[-1] and id(p0.side) not in prev and id(solo) not in prev


STRICT_CHATML = "strict-system"  # chatml-tools, but refusing a system message after the first (as many templates)


@pytest.mark.parametrize("template", ["chatml-tools", STRICT_CHATML])
@pytest.mark.parametrize("client", ["claude-code", "codex"])
def test_every_recorded_turn_extends_the_previous_prompt(client: str, template: str, tmp_path: Path) -> None:
    """Issue 59: a continued session recomputed ~5k tokens. On the recorded shapes, untrimmed, as tierlm renders them
    (billing header left out, a late system message folded where it stays): every request of a conversation (tool
    rounds, the sub-agent's, the continued turn) starts with the whole previous prompt, so a prefix cache reuses
    all of it."""
    from tierlm.backends.model_source.chat_templates import CHATML_TOOLS_TEMPLATE
    from tierlm.backends.model_source.demo import ensure_demo_model
    from tierlm.server.commands.bench.agent.prompts import PromptRenderer, server_args_of

    if template == STRICT_CHATML:
        refuse = ("{%- for m in messages %}{%- if m['role'] == 'system' and not loop.first %}"
                  "{{ raise_exception('System message must be at the beginning.') }}{%- endif %}{%- endfor %}")
        path = tmp_path / "strict.jinja"
        path.write_text(refuse + CHATML_TOOLS_TEMPLATE)
        template = str(path)
    renderer = PromptRenderer(server_args_of(["--model-path", str(ensure_demo_model()), "--chat-template",
                                              template]), ensure_demo_model())
    plans, _, _ = _sessions(client, turns=2, subagent=1 if client == "claude-code" else 0, side=False)
    every = [r for p in plans for r in p.all_requests()]
    prev = previous_in_chain(every)
    rendered = {id(r): renderer.render(r) for r in every}
    assert any(x.folded for x in rendered.values()) == (template != "chatml-tools" and client == "claude-code")
    checked = 0
    for r in every:
        if id(r) in prev:
            before, now = rendered[id(prev[id(r)])].ids, rendered[id(r)].ids
            assert diverged_at(before, now) == len(before) < len(now), (r.label, r.kind, r.turn)
            checked += 1
    assert checked >= 2 * len(plans)


# ---------------------------------------------------------------- the client's stream parsing
def _sse(events: list[dict]) -> bytes:
    return b"".join(b"event: " + e["type"].encode() + b"\ndata: " + json.dumps(e).encode() + b"\n\n"
                    for e in events if "type" in e)


def _send(handler, req: PlannedRequest, path: str):
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await agent_client.send(http, Endpoint("x", "http://peer", "m"), req, path, 4)
    return asyncio.run(go())


def _req(path: str) -> PlannedRequest:
    body = {"model": "recorded", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True} \
        if path == "/v1/messages" else {"model": "recorded", "input": "hi", "stream": True}
    return PlannedRequest(0, MAIN, 0, "s0", path, "beta=true" if path == "/v1/messages" else "",
                          {"x-claude-code-session-id": "abc", "host": "wrong"}, body)


def test_anthropic_ttft_is_the_first_content_delta_and_usage_has_the_tiers() -> None:
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["url"], seen["body"] = str(request.url), json.loads(request.content)
        seen["session"] = request.headers.get("x-claude-code-session-id")
        return httpx.Response(200, content=_sse([
            {"type": "message_start", "message": {"usage": {"input_tokens": 100}}},
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "a"}},
            {"type": "message_delta", "usage": {"input_tokens": 10, "output_tokens": 4, "cache_read_input_tokens": 80,
                                                "cache_creation_input_tokens": 10,
                                                "cache_read_input_tokens_details": {"device": 48, "host": 0,
                                                                                   "storage": 32}}}]))
    out = _send(handler, _req("/v1/messages"), "/v1/messages")
    assert seen["url"] == "http://peer/v1/messages?beta=true" and seen["body"]["model"] == "m"
    assert seen["session"] == "abc"
    assert out.first is not None and out.ttft <= out.latency
    assert (out.prompt_tokens, out.cached_tokens, out.completion_tokens) == (100, 80, 4)
    assert out.tiers == {"device": 48, "host": 0, "storage": 32}


def test_anthropic_usage_only_in_message_start_is_read_as_llama_server_sends_it() -> None:
    """llama-server's message_start has the input and cached tokens, its message_delta only output_tokens."""
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=_sse([
            {"type": "message_start", "message": {"usage": {"input_tokens": 30, "cache_read_input_tokens": 70,
                                                            "output_tokens": 0}}},
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "x"}},
            {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 1}}]))
    out = _send(handler, _req("/v1/messages"), "/v1/messages")
    assert (out.prompt_tokens, out.cached_tokens, out.completion_tokens, out.tiers) == (100, 70, 1, None)


def test_responses_usage_and_a_peer_without_tier_details() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=_sse([
            {"type": "response.created", "response": {}},
            {"type": "response.output_text.delta", "delta": "a"},
            {"type": "response.incomplete", "response": {"usage": {"input_tokens": 50, "output_tokens": 4,
                                                                   "input_tokens_details": {"cached_tokens": 32}}}}]))
    out = _send(handler, _req("/v1/responses"), "/v1/responses")
    assert (out.prompt_tokens, out.cached_tokens, out.tiers) == (50, 32, None) and out.first is not None


def test_a_peer_without_the_clients_endpoint_gets_chat_completions() -> None:
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/chat/completions":
            return httpx.Response(404, json={"detail": "Not Found"})
        seen["body"] = json.loads(request.content)
        chunks = [{"choices": [{"delta": {"role": "assistant"}}]}, {"choices": [{"delta": {"content": "a"}}]},
                  {"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 4,
                                            "prompt_tokens_details": {"cached_tokens": 16}}}]
        return httpx.Response(200, content=b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
                              + b"data: [DONE]\n\n")

    async def route():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await agent_client.routes(http, Endpoint("x", "http://peer", "m"), ["/v1/responses"])
    r = asyncio.run(route())
    assert r.paths == {"/v1/responses": "/v1/chat/completions"} and r.translated() == ["/v1/responses"]
    plans, _, _ = _sessions("codex", sessions=1, turns=1, side=False, shape=trim(load_shape("codex"), 2, 50))
    out = _send(handler, plans[0].requests[1], r.paths["/v1/responses"])
    assert (out.prompt_tokens, out.cached_tokens) == (30, 16)
    body = seen["body"]
    assert body["model"] == "m" and body["max_tokens"] == 4 and body["stream_options"] == {"include_usage": True}
    assert [m["role"] for m in body["messages"]] == ["system", "system", "user", "user", "assistant", "tool"]
    assert body["messages"][4]["tool_calls"][0]["function"]["name"] == "exec_command"
    assert {t["function"]["name"] for t in body["tools"]} == {"exec_command", "write_stdin"}


# ---------------------------------------------------------------- the command line
def test_agent_is_a_bench_subcommand_with_its_options() -> None:
    ns = bench_cmd.build_parser().parse_args(["agent", "--synthetic", "tiny"])
    assert (ns.client, ns.sessions, ns.turns, ns.subagent, ns.side_requests, ns.restart, ns.max_new_tokens) == \
        ("claude-code", 2, 3, False, None, False, 16)
    assert bench_cmd.SUBCOMMANDS["agent"][0] == "tierlm.server.commands.bench.agent"


def test_record_names_a_missing_cli_without_a_model(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no claude, no codex
    code = bench_cmd.main(["agent", "--record", "claude-code", "--record-out", str(tmp_path / "s.json")])
    assert code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("tierlm bench agent --record claude-code: the `claude` CLI is not installed")
    assert not (tmp_path / "s.json").exists()


# ---------------------------------------------------------------- end to end (real servers, real CLIs)
def _keys(x, path: str = "") -> set[str]:
    if isinstance(x, dict):
        return {f"{path}.{k}" for k in x} | {p for k, v in x.items() for p in _keys(v, f"{path}.{k}")}
    if isinstance(x, list):
        return {p for v in x for p in _keys(v, f"{path}[]")}
    return set()


@pytest.mark.slow
@pytest.mark.parametrize("client, cli", [("claude-code", "claude"), ("codex", "codex")])
def test_recording_gives_the_stored_shape(client: str, cli: str, tmp_path: Path) -> None:
    if shutil.which(cli) is None:
        pytest.skip(f"the {cli} CLI is not installed (npm install -g "
                    f"{'@anthropic-ai/claude-code' if cli == 'claude' else '@openai/codex'})")
    out = tmp_path / "shape.json"
    assert bench_cmd.main(["agent", "--record", client, "--record-out", str(out)]) == 0
    new, stored = json.loads(out.read_text()), load_shape(client).data
    assert _keys(new) == _keys(stored)
    assert "x-api-key" not in new["headers"] and "authorization" not in new["headers"]
    load_shape(client, out.read_text())  # the replay reads it


@pytest.mark.slow
def test_agent_bench_replays_sessions_and_resumes_from_l3(capsys, tmp_path: Path) -> None:
    from tierlm.backends.model_source.demo import ensure_demo_model

    demo = ensure_demo_model()
    page = 16
    assert bench_cmd.main([
        "agent", "--model-path", str(demo), "--sessions", "2", "--turns", "2", "--subagent", "--restart",
        "--trim-tools", "2", "--instructions-chars", "300", "--max-file-chars", "400",
        "--server-arg=--chat-template=chatml-tools", "--server-arg=--hicache-storage-prefetch-policy=wait_complete",
        "--page-size", str(page), "--work-dir", str(tmp_path), "--json", "--no-progress"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["benchmark"] == "agent"
    summary, turns, requests = rep["tables"]
    rows = requests["rows"]
    columns = {"server", "session", "kind", "turn", "ttft_s", "prompt_tokens", "new_tokens", "cached_device",
               "cached_host", "cached_storage", "cached_tokens", "computed_tokens", "diverged_at", "ideal_s"}
    assert columns <= set(rows[0])
    # every request answered: a solo side request, then per session 3 main turns, 2 sub-agent requests, a side
    # request and the continued turn on the restarted server
    kinds = sorted((r["session"], r["kind"], r["turn"]) for r in rows)
    expect = [("solo", "side", 0)] + sorted((f"s{i}", k, t) for i in range(2) for k, t in (
        ("main", 0), ("main", 1), ("main", 2), ("subagent", 0), ("subagent", 1), ("side", 0),
        ("resumed-after-restart", 3)))
    assert kinds == sorted(expect)
    assert all(r["prompt_tokens"] > 0 and r["completion_tokens"] >= 1 and r["server"] == "tierlm" for r in rows)
    assert all(r["prompt_tokens"] == r["tierlm_prompt_tokens"] for r in rows)  # the bench renders as the server
    assert "TRIMMED" in " ".join(requests["notes"]) and "context length raised" in " ".join(requests["notes"])
    by = {(r["session"], r["kind"], r["turn"]): r for r in rows}
    for s in ("s0", "s1"):
        for turn in (1, 2):  # each turn reuses the previous prompt (whole pages of it)
            prev, cur = by[(s, "main", turn - 1)], by[(s, "main", turn)]
            assert cur["diverged_at"] == prev["prompt_tokens"]
            assert cur["cached_tokens"] >= prev["prompt_tokens"] - page
            assert cur["new_tokens"] == cur["prompt_tokens"] - prev["prompt_tokens"]
        resumed = by[(s, "resumed-after-restart", 3)]
        assert resumed["cached_storage"] > 0 and resumed["phase"] == "after restart"  # L3, after the restart
        assert resumed["cached_tokens"] >= by[(s, "main", 2)]["prompt_tokens"] - page
        assert by[(s, "subagent", 1)]["diverged_at"] == by[(s, "subagent", 0)]["prompt_tokens"]
    assert rep["settings"]["servers"]["tierlm"]["restarted"] is True
    assert {r["key"] for r in summary["rows"]} >= {"main_ttft_p50_s", "main_ttft_p90_s", "side_ttft_s",
                                                   "side_solo_ttft_s", "sessions_wall_s"}
    assert len(turns["rows"]) == len(rows)
    reuse = next(t for t in rep["targets"] if t["name"] == "appended turns reuse the previous prompt")
    assert reuse["met"] is True, reuse  # counts, not timings: the fairness and resume targets are not asserted
