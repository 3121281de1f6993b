"""The import direction of the layout: runtime/ talks to tensors only through the backend contract."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_runtime_never_imports_torch_or_mlx():
    offenders = []
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        for mod in _imported_modules(path):
            if mod.split(".")[0] in ("torch", "mlx", "mlx_lm"):
                offenders.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert offenders == []


def test_backends_and_platforms_do_not_import_the_server():
    offenders = []
    for folder in ("backends", "platforms", "runtime"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for mod in _imported_modules(path):
                if mod.startswith("tierlm.server"):
                    offenders.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert offenders == []
