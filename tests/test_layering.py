"""The import direction of the layout.

server -> runtime -> backends, platforms beside them. runtime/ talks to tensors only through the backend
contract (backends/base.py): the composition root (the load plan runtime/load_plan.py and the builder that
executes it, runtime/engine_setup.py) names concrete backends, model sources and the platform layer. backends/ and platforms/ never import the runtime or the server. In server/
only the tools (doctor, bench) read model folders and the machine, never through a concrete backend, and no file
there imports another package's private names.
"""
import ast
from pathlib import Path

from tierlm.runtime.engine_api import EngineAPI

ROOT = Path(__file__).resolve().parent.parent
# the load plan decides, the builder executes it: the two files that name backends, model sources and platforms
COMPOSITION_ROOT = ("runtime/load_plan.py", "runtime/engine_setup.py")
TENSOR_LIBRARIES = ("torch", "mlx", "mlx_lm", "transformers")


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):  # function-level and TYPE_CHECKING imports count too
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            names.add("." * node.level + (node.module or ""))
    return names


def _imports(folder: str):
    for path in sorted((ROOT / folder).rglob("*.py")):
        for mod in sorted(_imported_modules(path)):
            yield path.relative_to(ROOT).as_posix(), mod


def test_runtime_reaches_tensors_only_through_the_backend_contract():
    offenders = []
    for path, mod in _imports("runtime"):
        if path in COMPOSITION_ROOT:
            continue
        if mod.split(".")[0] in TENSOR_LIBRARIES:
            offenders.append(f"{path} imports {mod}")
        if mod.startswith(("tierlm.backends", "tierlm.platforms")) and mod != "tierlm.backends.base":
            offenders.append(f"{path} imports {mod} (only {' and '.join(COMPOSITION_ROOT)} wire backends and platforms)")
    assert offenders == []


def test_the_composition_root_never_imports_tensor_libraries_itself():
    # It picks a concrete backend; the backend brings its own libraries.
    assert [m for _, m in _imports("runtime") if _ in COMPOSITION_ROOT and m.split(".")[0] in TENSOR_LIBRARIES] == []


def test_lower_layers_do_not_import_upper_ones():
    offenders = []
    for folder, forbidden in (("backends", ("tierlm.runtime", "tierlm.server")),
                              ("platforms", ("tierlm.runtime", "tierlm.server", "tierlm.backends")),
                              ("runtime", ("tierlm.server",))):
        for path, mod in _imports(folder):
            if mod.startswith(forbidden):
                offenders.append(f"{path} imports {mod}")
    assert offenders == []


# the commands that read models and machines themselves
SERVER_TOOLS = ("server/commands/doctor.py", "server/commands/bench/")
CONCRETE_BACKENDS = ("tierlm.backends.torch", "tierlm.backends.mlx")


def _private_imports(path: Path) -> list[str]:
    """``from <module> import _name`` where <module> is not in the importing file's own package."""
    package = "tierlm." + ".".join(path.relative_to(ROOT).parent.parts)
    tree = ast.parse(path.read_text(), filename=str(path))
    return [f"{node.module}.{alias.name}" for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
            and node.module.rsplit(".", 1)[0] != package for alias in node.names if alias.name.startswith("_")]


def test_the_server_reaches_backends_and_platforms_only_from_its_tools():
    # The HTTP layer talks to an engine (EngineAPI); doctor and bench read model folders and the machine, through
    # model_source and platforms, never through a concrete backend (the composition root chooses one).
    offenders = []
    for path, mod in _imports("server"):
        if mod.startswith(CONCRETE_BACKENDS):
            offenders.append(f"{path} imports {mod} (a concrete backend)")
        elif mod.startswith(("tierlm.backends", "tierlm.platforms")) and not path.startswith(SERVER_TOOLS):
            offenders.append(f"{path} imports {mod} (only {', '.join(SERVER_TOOLS)} may)")
    assert offenders == []


def test_the_server_imports_no_private_names_of_other_packages():
    offenders = [f"{path.relative_to(ROOT).as_posix()} imports {name}"
                 for path in sorted((ROOT / "server").rglob("*.py")) for name in _private_imports(path)]
    assert offenders == []


def test_imports_are_absolute():
    relative = [f"{p} imports {m}" for folder in ("runtime", "backends", "platforms", "server")
                for p, m in _imports(folder) if m.startswith(".")]
    assert relative == []


def test_engine_and_the_fake_engine_both_satisfy_the_engine_api():
    from fake_engine import FakeEngine

    from tierlm.runtime.engine import Engine
    from tierlm.runtime.server_args import ServerArgs

    assert isinstance(Engine(ServerArgs()), EngineAPI)
    assert isinstance(FakeEngine(), EngineAPI)


def _package_import_cycles(folder: str) -> list[list[str]]:
    """The import cycles among the modules under ``folder`` (every import counts, function-level ones too: a lazy
    import that closes a circle is still one)."""
    modules = {}
    for path in (ROOT / folder).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(("tierlm", *(parts[:-1] if parts[-1] == "__init__" else parts)))] = path
    graph = {}
    for name, path in modules.items():
        found = set()
        for mod in _imported_modules(path):
            found |= {mod} & modules.keys()
        tree = ast.parse(path.read_text())
        found |= {f"{node.module}.{alias.name}" for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.module for alias in node.names} & modules.keys()
        graph[name] = {m for m in found if m != name and not name.startswith(m + ".")}  # a package's own parents
    cycles, done = [], set()

    def visit(node: str, trail: list[str]) -> None:
        if node in trail:
            cycle = trail[trail.index(node):]
            if frozenset(cycle) not in done:
                done.add(frozenset(cycle))
                cycles.append(cycle + [node])
            return
        for nxt in sorted(graph[node]):
            visit(nxt, trail + [node])

    for start in sorted(graph):
        visit(start, [])
    return cycles


def test_the_backends_have_no_import_circle():
    # ops.py (the op schemas) sits at the bottom of backends/torch: a kernel never imports the compile path that
    # records it, nor the compile path the kernels.
    assert _package_import_cycles("backends") == []
