"""Only architectures whose output the reference tests verify are served (backends/verified_architectures.py).

Hybrids (Qwen3.5, Qwen3-Next, Granite-4.0-H, Nemotron-H: linear-attention / Mamba layers with a recurrent state)
used to load on the torch backend and answer wrong on every prompt. Now both backends refuse any architecture
outside the verified list before a weight loads, with a message naming the list and the flag (the tiny hybrids,
now verified through a state pool, taken off the list stand for any recurrent model type that is not on it);
--trust-unverified-architecture loads one anyway, with a warning in the log and in /server_info. The list itself
may only name architectures the reference tests build and check, and docs/models.md shows exactly that list.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import test_hybrid_models
from backends_under_test import BACKEND_NAMES
from engine_harness import greedy, run, start_engine
from model_factory import FAMILIES, HYBRIDS, build_tiny_hybrid, hybrid_available

from tierlm.backends import verified_architectures
from tierlm.backends.verified_architectures import (FLAG, RECURRENT_MODEL_TYPES, VERIFIED_ARCHITECTURES,
                                                    UnverifiedArchitectureError, assess_architecture,
                                                    check_architecture, verified_for)
from tierlm.runtime.errors import StartupError

DOCS = Path(__file__).resolve().parent.parent / "docs" / "models.md"


@pytest.fixture(scope="module", params=sorted(HYBRIDS))
def hybrid(request, tiny_models_root) -> Path:
    """A tiny checkpoint of each hybrid class the installed transformers has (2 layers, hidden 32)."""
    if not hybrid_available(request.param):
        pytest.skip(f"transformers has no {request.param}")
    return build_tiny_hybrid(request.param, tiny_models_root / f"hybrid_{request.param}")


@pytest.fixture
def hybrids_unverified(monkeypatch):
    """The verified list without the hybrids: the tiny hybrids then stand for any recurrent model type that is not
    on it (falcon_h1, jamba, ...), which must be refused on every backend."""
    monkeypatch.setattr(verified_architectures, "VERIFIED_ARCHITECTURES", tuple(
        v for v in VERIFIED_ARCHITECTURES if v.model_type not in RECURRENT_MODEL_TYPES))


def _architecture(model_dir: Path) -> str:
    return json.loads((model_dir / "config.json").read_text())["architectures"][0]


def assert_names_the_list_and_the_flag(message: str, architecture: str, backend: str) -> None:
    assert architecture in message and f"{backend} backend" in message
    for v in verified_architectures.VERIFIED_ARCHITECTURES:
        if backend in v.backends:
            assert f"{v.architecture} ({v.model_type})" in message
    assert "docs/models.md" in message and FLAG in message
    assert "recurrent state" in message  # says why a hybrid in particular answers wrong


# ------------------------------------------------------------------------------------------ hybrids refused


def test_engine_refuses_a_hybrid_before_loading_anything(hybrid, backend_name, hybrids_unverified, monkeypatch):
    from tierlm.runtime import engine_setup

    def must_not_run(*a, **k):
        raise AssertionError("loaded before the architecture check refused the model")

    monkeypatch.setattr(engine_setup, "tokenizer_for", must_not_run)
    monkeypatch.setattr(engine_setup, "load_backend", must_not_run)
    with pytest.raises(StartupError) as e:
        start_engine(hybrid, backend_name)
    assert_names_the_list_and_the_flag(str(e.value), _architecture(hybrid), backend_name)


def test_torch_backend_refuses_a_hybrid_before_its_weights_load(hybrid, hybrids_unverified, monkeypatch):
    from tierlm.backends.torch import backend as torch_backend

    monkeypatch.setattr(torch_backend, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(UnverifiedArchitectureError) as e:
        torch_backend.TorchBackend(hybrid, dtype="float32", device="cpu")
    assert_names_the_list_and_the_flag(str(e.value), _architecture(hybrid), "torch")


@pytest.mark.mlx
def test_mlx_backend_refuses_a_hybrid_before_mlx_lm_sees_it(hybrid, hybrids_unverified, monkeypatch):
    """mlx-lm knows some of these model types and not others; either way tierlm's check answers first."""
    from tierlm.backends.mlx import backend as mlx_backend

    monkeypatch.setattr(mlx_backend, "load_mlx_model", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(UnverifiedArchitectureError) as e:
        mlx_backend.MLXBackend(hybrid, dtype="float32")
    assert_names_the_list_and_the_flag(str(e.value), _architecture(hybrid), "mlx")


def test_trusted_hybrid_loads_on_torch_with_a_warning_in_the_log_and_server_info(hybrid, hybrids_unverified,
                                                                                 caplog):
    with caplog.at_level(logging.WARNING):
        engine = start_engine(hybrid, "torch", trust_unverified_architecture=True, dtype="float32")
    try:
        info = engine.server_info()
        assert info["architecture"] == _architecture(hybrid)
        assert info["architecture_verified"] is False
        assert len(info["warnings"]) == 1 and FLAG in info["warnings"][0]
        assert _architecture(hybrid) in info["warnings"][0] and "recurrent state" in info["warnings"][0]
        assert any(FLAG in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
        assert len(run(engine, [[5, 6, 7, 8]], greedy(3))[0].token_ids) == 3  # it runs
    finally:
        engine.shutdown()


def test_doctor_says_whether_the_architecture_is_verified(hybrid, tiny_llama, hybrids_unverified, monkeypatch,
                                                          capsys):
    from tierlm.server.commands import doctor as doctor_cmd

    monkeypatch.delenv("SGLANG_USE_MLX", raising=False)
    monkeypatch.setenv("TIERLM_BACKEND", "torch")
    assert doctor_cmd.main(["--json", "--model-path", str(hybrid)]) == 1  # serve would refuse it
    report = json.loads(capsys.readouterr().out)
    assert report["architecture"] == {"architecture": _architecture(hybrid),
                                      "model_type": HYBRIDS[_architecture(hybrid)]["model_type"], "verified": False}
    assert any(FLAG in e and "docs/models.md" in e for e in report["errors"])

    assert doctor_cmd.main(["--model-path", str(hybrid), "--trust-unverified-architecture"]) == 0
    text = capsys.readouterr().out
    assert f"{_architecture(hybrid)} (" in text and "NOT verified on torch" in text and FLAG in text

    assert doctor_cmd.main(["--json", "--model-path", str(tiny_llama)]) == 0
    assert json.loads(capsys.readouterr().out)["architecture"]["verified"] is True


# ------------------------------------------------------------------------------------------ what stays served


def test_a_verified_model_shows_no_warning_in_server_info(tiny_llama):
    engine = start_engine(tiny_llama, "torch")
    try:
        info = engine.server_info()
        assert info["architecture_verified"] is True and info["warnings"] == []
    finally:
        engine.shutdown()


@pytest.mark.parametrize("backend", ["torch", "mlx"])
@pytest.mark.parametrize("source", ["demo", "synthetic", "stories260K"])
def test_demo_synthetic_and_stories_models_stay_accepted(source, backend, tmp_path, request):
    from tierlm.backends.model_source.demo import ensure_demo_model
    from tierlm.backends.model_source.synthetic import SPECS, ensure_synthetic_model

    if source == "demo":
        folder = ensure_demo_model(tmp_path)
    elif source == "synthetic":
        folder = ensure_synthetic_model("tiny", tmp_path)
        for name, spec in SPECS.items():  # every bench model, without building the large ones
            assert verified_for(backend).get(spec["architectures"][0]) == spec["model_type"], name
    else:
        folder = request.getfixturevalue("stories_dir")  # skips where ../shared/models is absent
    check = check_architecture(folder, backend)
    assert check.verified and check.warning is None and check.refusal is None


def test_the_check_reads_model_type_architectures_and_remote_code(tmp_path):
    def folder(**config) -> Path:
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        return d

    assert check_architecture(folder(model_type="qwen3"), "torch").verified  # no architectures: the model_type's
    # The backends build from model_type, so a verified class name on another model_type is not verified.
    mismatch = folder(model_type="qwen3_next", architectures=["Qwen3ForCausalLM"])
    with pytest.raises(UnverifiedArchitectureError, match=FLAG):
        check_architecture(mismatch, "torch")
    with pytest.raises(UnverifiedArchitectureError, match="no model_type"):
        check_architecture(folder(architectures=["LlamaForCausalLM"]), "mlx")
    remote = folder(model_type="llama", architectures=["LlamaForCausalLM"],
                    auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    assert check_architecture(remote, "torch").verified  # without --trust-remote-code the remote class is unused
    with pytest.raises(UnverifiedArchitectureError, match="remote code"):
        check_architecture(remote, "torch", trust_remote_code=True)
    trusted = check_architecture(remote, "torch", trust_unverified=True, trust_remote_code=True)
    assert not trusted.verified and FLAG in trusted.warning
    unreadable = tmp_path / "unreadable"
    unreadable.mkdir()
    (unreadable / "config.json").write_text("not json")
    with pytest.raises(UnverifiedArchitectureError, match="no readable config.json"):
        assess_architecture(unreadable, "torch")


# ------------------------------------------------------------------------------------------ the list itself


def _reference_tested() -> dict[str, tuple[str, list[str]]]:
    """Architecture -> (model_type, backends) of every model the reference tests build and check."""
    import transformers

    # test_backend_conformance and test_gpt_oss run on conftest's backend_name fixture: every backend
    tested = {spec["architectures"][0]: (spec["model_type"], list(BACKEND_NAMES))
              for spec in FAMILIES.values()}
    gpt_oss_type = transformers.GptOssConfig.model_type  # model_factory.build_tiny_gpt_oss, tests/test_gpt_oss.py
    tested[transformers.GptOssForCausalLM.__name__] = (gpt_oss_type, list(BACKEND_NAMES))
    for architecture, spec in HYBRIDS.items():  # model_factory.build_tiny_hybrid, tests/test_hybrid_models.py
        tested[architecture] = (spec["model_type"], test_hybrid_models.BACKEND_NAMES)
    return tested


def test_every_verified_architecture_has_reference_tests_on_its_backends():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    tested = _reference_tested()
    for v in VERIFIED_ARCHITECTURES:
        assert v.architecture in tested, f"{v.architecture} is listed as verified but no reference test builds it"
        model_type, backends = tested[v.architecture]
        assert v.model_type == model_type
        assert set(v.backends) <= set(backends), f"{v.architecture}: verified on {v.backends}, tested on {backends}"
        # The class AutoModelForCausalLM builds for that model_type is the listed one.
        assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[v.model_type] == v.architecture
    assert len({v.architecture for v in VERIFIED_ARCHITECTURES}) == len(VERIFIED_ARCHITECTURES)
    # And the reference models themselves are served (else their own tests would be refused).
    for architecture, (model_type, backends) in tested.items():
        for backend in backends:
            assert verified_for(backend).get(architecture) == model_type, (architecture, backend)


def _docs_table() -> set[tuple[str, str, str]]:
    """(architecture, model_type, backend) of every "yes" in docs/models.md's table of supported models."""
    rows = [line for line in DOCS.read_text(encoding="utf-8").splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    col = {name: header.index(name) for name in ("architecture", "`model_type`", "torch backend", "MLX backend")}
    listed = set()
    for line in rows[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != len(header):
            break  # the next table
        for architecture in re.findall(r"`(\w+)`", cells[col["architecture"]]):
            model_type = cells[col["`model_type`"]].strip("`")
            for backend, column in (("torch", "torch backend"), ("mlx", "MLX backend")):
                if cells[col[column]].startswith("yes"):
                    listed.add((architecture, model_type, backend))
    return listed


def test_docs_list_exactly_the_verified_architectures():
    verified = {(v.architecture, v.model_type, b) for v in VERIFIED_ARCHITECTURES for b in v.backends}
    assert _docs_table() == verified
    assert FLAG in DOCS.read_text(encoding="utf-8")
