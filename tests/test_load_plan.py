"""Startup as plan, then build (runtime/load_plan.py, runtime/engine_setup.py): the plan is made from the model
folder, the machine and the flags without loading weights or a tensor library; the builder executes the plan it is
given without deciding again; `tierlm doctor` prints the plan serve builds."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest

from tierlm.backends.base import Choice
from tierlm.runtime import engine_setup, load_plan
from tierlm.server.commands import doctor as doctor_cmd
from tierlm.server.commands.cli_args import parse_args
from test_tier_sizing import CPU_BOX, ENV


def test_the_plan_is_made_without_weights_or_tensor_libraries(tiny_llama):
    script = textwrap.dedent(f"""
        import json, sys
        from tierlm.backends.model_source.model_folder import ModelFolder
        from tierlm.platforms import Facts
        from tierlm.runtime.load_plan import plan_load
        from tierlm.server.commands.cli_args import parse_args
        facts = Facts.from_dict(json.loads({json.dumps(CPU_BOX.to_dict())!r}))
        args = parse_args(["--model-path", {str(tiny_llama)!r}])
        plan = plan_load(args, facts, ModelFolder.read(args.model_path), {{"TIERLM_BACKEND": "torch"}})
        print(json.dumps({{"plan": plan.to_dict(), "loaded": sorted(m for m in ("torch", "mlx", "transformers")
                                                                    if m in sys.modules)}}, default=str))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["loaded"] == []
    plan = result["plan"]
    assert plan["backend"]["value"] == "torch on cpu"
    for name in ("attention", "dtype", "compile", "context_length"):
        assert plan[name]["why"], name  # every choice says why
    assert plan["sizes"]["weight_bytes"] > 0 and plan["sizes"]["kv_bytes_per_token"] > 0
    assert plan["tiers"]["device_pages"] > 0
    assert plan["kernels"]["kernel_library"]["why"]  # the CPU plan, from the install's manifest alone


def _build(flags: list[str], monkeypatch, edit=None):
    """A real engine setup of the built-in model (torch on CPU, the recorded machine), its plan edited by ``edit``."""
    monkeypatch.setattr(engine_setup, "detect", lambda: CPU_BOX)
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    planned = {}

    def plan_load(*a, **k):
        plan = load_plan.plan_load(*a, **k)
        planned["plan"] = edit(plan) if edit else plan
        return planned["plan"]

    monkeypatch.setattr(engine_setup, "plan_load", plan_load)
    args = parse_args([*flags, "--skip-warmup", "--grammar-backend", "none"])
    return engine_setup.build_engine_parts(args, emit=lambda req, out: None), planned["plan"]


def test_the_builder_executes_the_plan_it_is_given(monkeypatch):
    def edit(plan):
        part = replace(plan.backend, dtype=Choice("bfloat16", "the test's plan"))
        return replace(plan, backend=part, attention=Choice("torch_native", "the test's attention"))

    parts, plan = _build([], monkeypatch, edit)
    try:
        assert parts.model_info.dtype == "bfloat16" and parts.dtype_reason == "the test's plan"
        assert parts.attention == ("torch_native", "the test's attention")
        assert parts.describe()["dtype_chosen_by"] == "the test's plan"
    finally:
        parts.close()


def test_the_builder_compiles_as_planned_for_the_weights_planned(monkeypatch):
    """The compile choice is the plan's where the weights load as the folder counted them; where they do not (here
    the plan's bytes are edited), the backend's rule is asked again for the weights as loaded."""
    def edit(plan, **sizes):
        part = replace(plan.backend, compile=Choice(False, "the test's plan: eager"),
                       sizes=replace(plan.backend.sizes, **sizes))
        return replace(plan, backend=part)

    parts, plan = _build([], monkeypatch, edit)
    try:
        assert parts.torch_compile == {"enabled": False, "chosen_by": "default", "why": "the test's plan: eager"}
    finally:
        parts.close()
    parts, plan = _build([], monkeypatch, lambda p: edit(p, weight_bytes=p.backend.sizes.weight_bytes + 1))
    try:
        assert parts.torch_compile["why"] != "the test's plan: eager"  # the rule, asked again
    finally:
        parts.close()


def test_the_builder_allocates_the_planned_tiers(monkeypatch):
    parts, plan = _build([], monkeypatch, lambda p: replace(p, tiers=replace(p.tiers, device_pages=37)))
    try:
        assert parts.cache.accounting()["total_pages"] == 37
    finally:
        parts.close()


def test_a_loaded_model_the_folder_counted_otherwise_is_sized_from_the_load(monkeypatch, caplog):
    """Where the loaded model's bytes differ from the folder's count, the tiers are sized from what loaded (and
    the log says so), by the same rule."""
    def edit(plan):
        sizes = replace(plan.backend.sizes, weight_bytes=plan.backend.sizes.weight_bytes + 4096)
        return replace(plan, backend=replace(plan.backend, sizes=sizes), tiers=replace(plan.tiers, device_pages=37))

    with caplog.at_level(logging.INFO, logger="tierlm.runtime.engine_setup"):
        parts, plan = _build([], monkeypatch, edit)
    try:
        assert "memory plan: sized from the loaded model" in caplog.text
        unedited = load_plan.size_tiers(parts.args, CPU_BOX, plan.decision, parts.backend.weight_bytes(),
                                        parts.backend.kv_bytes_per_token(), parts.context_length)
        assert parts.cache.accounting()["total_pages"] == unedited.device_pages != 37
    finally:
        parts.close()


@pytest.mark.parametrize("flags", [[], ["--enable-hierarchical-cache", "--hicache-ratio", "2"],
                                   ["--context-length", "256", "--kv-cache-dtype", "bf16"]])
def test_doctor_prints_the_plan_serve_builds(flags, monkeypatch):
    report = doctor_cmd.diagnose(CPU_BOX, dict(ENV), ["--json", *flags])
    assert report["errors"] == [], report["errors"]
    printed = report["plan"]
    parts, plan = _build(flags, monkeypatch)
    try:
        assert printed == json.loads(json.dumps(replace(plan, chat_format=parts.chat_format).to_dict()))
        assert printed["dtype"]["value"] == parts.model_info.dtype
        assert printed["attention"]["value"] == parts.attention[0]
        assert printed["compile"] == {"value": parts.torch_compile["enabled"], "why": parts.torch_compile["why"]}
        assert printed["context_length"]["value"] == parts.context_length
        acc = parts.cache.accounting()
        assert printed["tiers"]["device_pages"] == acc["total_pages"]
        assert printed["tiers"]["host_pages"] == acc.get("host_total_pages", 0)
        assert printed["chat_format"]["reasoning_parser"]["value"] == parts.chat_format.reasoning_parser
    finally:
        parts.close()
    assert "Load plan" in doctor_cmd.render_text(report)


def test_a_context_length_the_folder_did_not_name_is_taken_from_the_loaded_model(monkeypatch, caplog):
    """A config.json without max_position_embeddings leaves it to the model class's default, which the folder alone
    cannot know: the builder takes the loaded model's and sizes the tiers by it (logged)."""
    def edit(plan):
        return replace(plan, model_max=99999, context_length=Choice(99999, "the test's folder count"))

    with caplog.at_level(logging.INFO, logger="tierlm.runtime.engine_setup"):
        parts, plan = _build([], monkeypatch, edit)
    try:
        assert parts.context_length == parts.backend.info.max_position_embeddings != 99999
        assert "the loaded model's max_position_embeddings" in caplog.text
        tiers = load_plan.size_tiers(parts.args, CPU_BOX, plan.decision, parts.backend.weight_bytes(),
                                     parts.backend.kv_bytes_per_token(), parts.context_length)
        assert parts.cache.accounting()["total_pages"] == tiers.device_pages
    finally:
        parts.close()
