"""NGRAM speculative decoding through a real server on stories260K: the openai client's greedy completion is the
text transformers gives, /generate reports SGLang's spec_* meta_info, /server_info the algorithm and its settings,
/metrics the acceptance (tierlm_spec_* and SGLang's sglang:spec_* names)."""
from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import STORIES_PROMPT, STORIES_TEXT
from e2e_server import start_server

pytestmark = pytest.mark.slow

STORY = STORIES_PROMPT + STORIES_TEXT


def test_ngram_server_answers_like_the_reference_and_reports_acceptance(stories_dir: Path, tmp_path: Path) -> None:
    args = ["--model-path", str(stories_dir), "--served-model-name", "stories", "--skip-warmup", "--speculative-algorithm", "NGRAM",
            "--speculative-num-draft-tokens", "8", "--speculative-ngram-max-match-window-size", "6"]
    with start_server(args, env={"TIERLM_NO_PROGRESS": "1"}, log_dir=tmp_path) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x")
        out = client.completions.create(model="stories", prompt=STORIES_PROMPT, max_tokens=30, temperature=0)
        assert out.choices[0].text == STORIES_TEXT[:len(out.choices[0].text)] and len(out.choices[0].text) > 60

        # the story, then its opening again: stories260K goes on copying it and the drafts are accepted
        r = httpx.post(f"{server.url}/generate", timeout=60, json={
            "text": STORY + " " + STORIES_PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 24}})
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        assert meta["spec_verify_ct"] > 0 and meta["spec_accept_length"] > 1.5
        assert 0 < meta["spec_accept_token_num"] <= meta["spec_draft_token_num"]

        info = httpx.get(f"{server.url}/server_info", timeout=10).json()
        spec = info["speculative"]
        assert spec["algorithm"] == "NGRAM" and spec["max_draft_tokens"] == 7 and spec["accepted_tokens"] > 0
        assert info["server_args"]["speculative_ngram_max_match_window_size"] == 6

        metrics = {s.name: s.value for fam in text_string_to_metric_families(
            httpx.get(f"{server.url}/metrics", timeout=10).text) for s in fam.samples}
        assert metrics["tierlm_spec_accepted_tokens_total"] == spec["accepted_tokens"]
        assert metrics["sglang:spec_accept_length"] > 1.0
        assert "NGRAM" in server.log_text()
