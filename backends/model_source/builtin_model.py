"""The built-in model: llama2.c's stories260K, shipped inside the package (the folder ``stories260K/`` beside this
file, with its MIT licence and provenance in README.md there), so `tierlm serve` with no --model-path serves a real
pretrained model offline. It writes short children's stories; its chat template turns a chat into a story prompt.

The random demo model (demo.py) stays for tests and benchmarks where only shapes matter.
"""
from __future__ import annotations

from pathlib import Path

from tierlm.backends.model_source.errors import ModelSourceError

BUILTIN_MODEL_NAME = "stories260K"  # the name clients use; runtime/server_args.py holds the same string
BUILTIN_MODEL_DIR = Path(__file__).resolve().parent / "stories260K"
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json", "LICENSE")

BUILTIN_MODEL_NOTICE = (
    f"No --model-path given: serving tierlm's built-in model {BUILTIN_MODEL_NAME} (llama2.c's 260K-parameter "
    "TinyStories model, MIT licence): it writes short children's stories, e.g. from the prompt 'Once upon a time'. "
    "For a general model run: tierlm serve --model-path Qwen/Qwen2.5-0.5B-Instruct"
)


def builtin_model_dir() -> Path:
    """The packaged model folder; ModelSourceError when the install lost its files (package data left out)."""
    missing = [name for name in REQUIRED_FILES if not (BUILTIN_MODEL_DIR / name).is_file()]
    if missing:
        raise ModelSourceError(
            f"the built-in model's files are missing from {BUILTIN_MODEL_DIR} ({', '.join(missing)}): this tierlm "
            "install is incomplete; reinstall it (pip install --force-reinstall tierlm), or pass a model with "
            "--model-path (e.g. Qwen/Qwen2.5-0.5B-Instruct)."
        )
    return BUILTIN_MODEL_DIR


# --dtype auto serves it in float32 (serve and doctor alike): 1 MB of weights gains nothing from bfloat16, and
# float32 keeps its greedy text llama2.c run.c's on every device
BUILTIN_DTYPE_WHY = "--dtype auto on the built-in model: float32, as trained (its greedy text stays llama2.c run.c's)"


def is_builtin_model(folder: Path) -> bool:
    return Path(folder).resolve() == BUILTIN_MODEL_DIR
