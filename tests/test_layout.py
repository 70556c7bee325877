"""The pack's layout promises: h3_core never imports ComfyUI, V3-only entry point, no torch pin."""

import ast
import re
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_h3_core_never_imports_comfyui():
    comfy_roots = {"comfy", "comfy_api", "comfy_extras", "folder_paths", "nodes", "server", "execution"}
    offenders = {}
    for path in sorted((REPO / "h3_core").rglob("*.py")):
        hits = _imported_modules(path) & comfy_roots
        if hits:
            offenders[str(path.relative_to(REPO))] = sorted(hits)
    assert offenders == {}


def test_h3_core_never_unpickles():
    for path in sorted((REPO / "h3_core").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        assert "pickle" not in _imported_modules(path), path
        assert "torch.load(" not in text, path


# The contract package and the two modules it builds on adapt to ComfyUI, diffusers and vLLM-Omni but import none of
# them, so a contract can be read on either side of a process boundary; facts.py imports nothing at all.
_FRAMEWORK_FREE = ["contract/*.py", "safetensors_header.py", "facts.py"]
_FRAMEWORKS = {"comfy", "comfy_api", "comfy_extras", "folder_paths", "nodes", "diffusers", "vllm", "vllm_omni"}


def test_contract_and_facts_import_no_framework():
    paths = [p for pattern in _FRAMEWORK_FREE for p in sorted((REPO / "h3_core").glob(pattern))]
    assert len(paths) >= 8
    for path in paths:
        assert not _imported_modules(path) & _FRAMEWORKS, path
        calls = {ast.unparse(n.func) for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)}
        assert not {"torch.load", "torch.save", "pickle.load", "pickle.loads"} & calls, path
    assert _imported_modules(REPO / "h3_core" / "facts.py") <= {"__future__"}


def test_root_exports_only_the_v3_entry_point():
    tree = ast.parse((REPO / "__init__.py").read_text(encoding="utf-8"))
    top_level = {
        node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }
    assigned = {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if hasattr(t, "id")}
    assert top_level == {"comfy_entrypoint"}
    assert "NODE_CLASS_MAPPINGS" not in assigned


def test_design_card_layout_exists():
    for name in ("__init__.py", "nodes", "h3_core", "workflows", "tests", "pyproject.toml", "README.md",
                 "requirements.txt", ".ci/run", ".comfyignore", "LICENSE"):
        assert (REPO / name).exists(), name


def test_pyproject_registry_fields():
    data = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    project, comfy = data["project"], data["tool"]["comfy"]
    major, minor, patch = project["version"].split(".")
    assert all(part.isdigit() for part in (major, minor, patch))
    assert project["license"] and project["urls"]["Repository"]
    for key in ("PublisherId", "DisplayName", "Icon", "requires-comfyui"):
        assert comfy[key], key
    assert comfy["requires-comfyui"].startswith(">=0.")


def test_requirements_never_pin_torch():
    for name in ("requirements.txt",):
        lines = [line.split("#")[0].strip() for line in (REPO / name).read_text().splitlines()]
        packages = {line.split(">")[0].split("=")[0].split("<")[0].strip().lower() for line in lines if line}
        assert not packages & {"torch", "torchvision", "torchaudio"}
        assert {"diffusers", "accelerate", "transformers", "safetensors", "av", "numpy"} <= packages
    data = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert not any(dep.lower().startswith("torch") for dep in data["project"]["dependencies"])


def test_h3_core_imports_itself_relatively():
    # Inside ComfyUI the pack is imported as `<folder>.h3_core`: an absolute `h3_core` import would fail there.
    offenders = [
        str(path.relative_to(REPO))
        for path in sorted((REPO / "h3_core").rglob("*.py"))
        if "h3_core" in _imported_modules(path)
    ]
    assert offenders == []


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute name an `ImportFrom` reads from, seen from `module`."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _module_level_imports(tree: ast.Module) -> list[ast.stmt]:
    """Imports that run when the module is imported: top level and inside top-level `try` / `if` (but not
    `if TYPE_CHECKING:`, which never runs); imports inside functions are not module-level."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + [s for h in getattr(node, "handlers", []) for s in h.body]
            todo += getattr(node, "finalbody", [])
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
    return found


# A private import the `remote` work package removes (encode-ahead's client factory, injected at install).
def test_no_module_imports_another_modules_private_names():
    """A name that two modules share is public: an underscore import across modules means the underscore lies."""
    offenders = []
    for path in sorted([*(REPO / "h3_core").rglob("*.py"), *(REPO / "nodes").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                where = str(path.relative_to(REPO))
                if private:
                    offenders.append(f"{where}:{node.lineno} imports {alias.name}")
    assert offenders == []


def _runtime_imports(tree: ast.Module) -> list[ast.stmt]:
    """Every import that can run, at any depth (inside functions too), but not those under `if TYPE_CHECKING:`."""
    guarded = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.If)
               and "TYPE_CHECKING" in ast.unparse(node.test) for inner in ast.walk(node)}
    return [node for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in guarded]


@pytest.mark.parametrize("depth", ["module level", "anywhere"])
def test_h3_core_module_imports_have_no_cycle(depth):
    """h3_core's modules form layers: no cycle among the imports that run at import time, nor among all imports,
    those inside functions included (a lazy import keeps torch-heavy code off a light path; it must not hide a cycle
    between two of the pack's modules). A package's `from . import x` counts as an import of the submodule `x`."""
    paths = {_module_name(p): p for p in sorted((REPO / "h3_core").rglob("*.py"))}
    graph = {name: set() for name in paths}
    imports = _module_level_imports if depth == "module level" else _runtime_imports
    for name, path in paths.items():
        for node in imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _absolute(name, path.name == "__init__.py", node)
                modules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in paths]
                targets = modules + ([base] if len(modules) < len(node.names) else [])
            graph[name].update(t for t in targets if t in paths and t != name)

    def cycle_from(start: str) -> list[str] | None:
        stack, on_path = [(start, iter(sorted(graph[start])))], [start]
        while stack:
            _, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                on_path.pop()
            elif child == start:
                return [*on_path, start]
            elif child not in on_path and child > start:  # each cycle is reported from its smallest member
                stack.append((child, iter(sorted(graph[child]))))
                on_path.append(child)
        return None

    cycles = [cycle for cycle in map(cycle_from, sorted(graph)) if cycle]
    assert cycles == []


def _defined_names(tree: ast.Module) -> set[str]:
    """Names a module defines itself: functions, classes, assignments at top level, and the names its module-level
    `__getattr__` serves (a lazily built table, e.g. safetensors_header.DTYPES)."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if node.name == "__getattr__":
                strings = (c.value for c in ast.walk(node) if isinstance(c, ast.Constant))
                names.update(value for value in strings if isinstance(value, str))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def test_names_are_imported_from_the_module_that_defines_them():
    """A module imports a name from the module that defines it, not from one that imported it in turn (a re-export
    hides where the name lives, and moves with that module's imports). Packages' `__init__` re-exports are their
    declared API and are allowed."""
    paths = {_module_name(p): p for p in sorted([*(REPO / "h3_core").rglob("*.py"), *(REPO / "nodes").rglob("*.py")])}
    trees = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in paths.items()}
    defined = {name: _defined_names(tree) for name, tree in trees.items()}
    offenders = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = _absolute(name, paths[name].name == "__init__.py", node)
            if base not in paths or paths[base].name == "__init__.py":
                continue
            offenders += [f"{paths[name].relative_to(REPO)}:{node.lineno} imports {alias.name} from {base}"
                          for alias in node.names
                          if alias.name != "*" and f"{base}.{alias.name}" not in paths
                          and alias.name not in defined[base]]
    assert offenders == []


def test_no_test_module_imports_another():
    """Shared test code lives in tests/support/: a test module importing another (`from test_x import helper`, or a
    fixture) ties one module's collection to another's and hides what is shared. tests/support/ imports no test
    module either."""
    tests = REPO / "tests"
    modules = {path.stem for path in tests.glob("test_*.py")}
    # import test_x / import tests.test_x / from test_x import ... / from tests.test_x import ... / from tests import
    imports = re.compile(r"^\s*(?:import|from)\s+(?:tests\.)?(test_\w+)|^\s*from\s+tests\s+import\s+(test_\w+)", re.M)
    offenders = {}
    for path in sorted([*tests.glob("test_*.py"), *(tests / "support").glob("*.py"), tests / "conftest.py"]):
        hits = {name for match in imports.finditer(path.read_text(encoding="utf-8")) for name in match.groups()
                if name in modules}
        if hits:
            offenders[str(path.relative_to(REPO))] = sorted(hits)
    assert offenders == {}, f"move what these share into tests/support/: {offenders}"
    assert not [path.name for path in tests.glob("*.py") if not path.name.startswith("test_")
                and path.name != "conftest.py"], "support modules belong in tests/support/"


def test_every_test_module_is_in_a_tier():
    """tests/conftest.py's TIERS classifies every test module (a forgotten one would silently join the fast tier),
    names no module that does not exist, and uses only the markers pyproject.toml registers."""
    from conftest import SLOW_TESTS, TIERS

    modules = {path.stem for path in (REPO / "tests").glob("test_*.py")}
    assert sorted(modules - set(TIERS)) == [], "add these to TIERS in tests/conftest.py"
    assert sorted(set(TIERS) - modules) == []
    assert {key.split("::")[0] for key in SLOW_TESTS} <= modules
    registered = {line.split(":")[0] for line in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]
                  ["pytest"]["ini_options"]["markers"]}
    used = {marker for markers in [*TIERS.values(), *SLOW_TESTS.values()] for marker in markers}
    assert used <= registered == {"slow", "comfyui", "ray", "process"}


# ComfyUI's public surface (the V3 node API and the model-folder registry) may be used by any node module; its
# internals only where this table says, each for one reason (docs/ARCHITECTURE.md §1). A new internal import, or
# an entry no longer needed, fails here: the table is the rule, kept true.
COMFY_PUBLIC = {"comfy_api.latest", "folder_paths"}
COMFY_ROOTS = {"comfy", "comfy_api", "comfy_execution", "comfy_extras", "folder_paths", "server", "execution",
               "nodes", "latent_preview", "node_helpers", "app"}
COMFY_INTERNALS = {
    # model management, progress bars, previews (core's own H3 tiny decoder via latent_preview, where core has one),
    # the VIDEO/AUDIO types, the prompt server's messages
    "nodes/comfy_bridge.py": {"comfy.cli_args", "comfy.latent_formats", "comfy.model_management",
                              "comfy.model_patcher", "comfy.nested_tensor", "comfy.utils", "latent_preview", "server"},
    # the queue and executor state encode-ahead reads, feature-detected (off when it is not as expected)
    "nodes/comfy_queue_seam.py": {"comfy_execution", "comfy_execution.progress", "nodes", "server"},
    # the load / offload device of each loader
    "nodes/loaders.py": {"comfy.model_management"},
    # ComfyUI's cast-weights protocol for streaming the DiT's and text encoder's layers
    "nodes/low_vram.py": {"comfy.model_management", "comfy.model_patcher", "comfy.ops", "comfy.patcher_extension"},
    # ComfyUI's own inference minimum, added to what a node asks to keep free
    "nodes/memory.py": {"comfy.model_management"},
    # the progress bar and its text line of the running node; ComfyUI's interrupt exception, to say "cancelled"
    "nodes/progress_text.py": {"comfy.model_management", "comfy.utils", "comfy_execution.utils", "server"},
    # the POST /prompt middleware: one validation error per problem
    "nodes/validation_errors.py": {"nodes", "server"},
}


def _comfy_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found |= {name for name in names if name.split(".")[0] in COMFY_ROOTS}
    return found


def test_comfyui_internals_are_imported_only_where_the_table_allows():
    seen = {}
    for path in sorted((REPO / "nodes").glob("*.py")):
        internal = _comfy_imports(path) - COMFY_PUBLIC
        if internal:
            seen[str(path.relative_to(REPO))] = internal
    assert seen == COMFY_INTERNALS


def test_the_architecture_module_index_names_every_module():
    """docs/ARCHITECTURE.md §10 is the map's index: one row per module of h3_core/ and nodes/, none stale."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text().split("## 10. Module index", 1)[1]
    listed = {line.split("`")[1] for line in text.splitlines() if line.startswith("| `")}
    modules = {str(path.relative_to(REPO)) for folder in ("h3_core", "nodes") for path in (REPO / folder).rglob("*.py")
               if "__pycache__" not in path.parts and path.name != "__main__.py"}
    assert sorted(modules - listed) == [], "add these modules to docs/ARCHITECTURE.md §10"
    assert sorted(listed - modules) == [], "these rows of docs/ARCHITECTURE.md §10 name no module"
