"""`pip install '.[ray]'` as DEPLOY.md and the README say, into a fresh virtual environment.

An encoder machine installs torch first (as scripts/setup_env.sh does: the pack never pulls torch), then the pack
with its Ray extra. Here the fresh venv sees the project venv's packages as its base (a `.pth` file: what
`--system-site-packages` does over a base interpreter that already holds the heavy dependencies), and pip runs with
`--no-index`: every dependency pyproject.toml declares must already be installed under its name and version range,
and the pack itself is built from a copy of this checkout (a fresh clone) and installed into the fresh venv.

Then, from outside the checkout, the installed copy must import every module of `h3_core` (the encoder server, both
engines, the quantised-weight kernels), build the Ray Serve application `serve --engine ray` deploys, and answer
`serve --help`; and every distribution those imports loaded must be one the install declared (the requirement
closure of `minimax-h3-split[ray]`), or torch's own: a dependency missing from pyproject.toml fails here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")
tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parents[1]
DIST = "minimax-h3-split"

CHECK = textwrap.dedent("""
    import importlib, importlib.metadata as md, json, pkgutil, re, sys, sysconfig
    import h3_core
    names = [m.name for m in pkgutil.walk_packages(h3_core.__path__, "h3_core.") if m.name != "h3_core.__main__"]
    for name in names:
        importlib.import_module(name)
    from h3_core.cli import build_parser
    from h3_core.remote.engines import ray_run, ray_serve as ray_engine
    args = build_parser().parse_args(["serve", "--engine", "ray", "--models", sys.argv[1], "--replicas", "2"])
    app = ray_engine.application(ray_run.settings_from_args(args, "127.0.0.1"))
    # The distributions h3_core's own imports come from (libraries import optional extras when they happen to be
    # installed: those are theirs, not ours), and the closure of what the install declared.
    import ast, pathlib
    tops = set()
    for path in pathlib.Path(h3_core.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                tops.add(node.module.split(".")[0])
    owners = md.packages_distributions()
    used = {dist for top in tops - set(sys.stdlib_module_names) for dist in owners.get(top, [])}
    assert tops - set(sys.stdlib_module_names) - {"h3_core"} <= set(owners), sorted(tops - set(owners))
    def closure(root, extras=()):
        seen, todo = set(), [(root, tuple(extras))]
        while todo:
            name, wanted = todo.pop()
            key = re.sub(r"[-_.]+", "-", name).lower()
            if (key, wanted) in seen:
                continue
            seen.add((key, wanted))
            try:
                requires = md.requires(name) or []
            except md.PackageNotFoundError:
                continue
            for line in requires:
                req, _, marker = line.partition(";")
                extra = re.search(r"extra\\s*==\\s*['\\"]([^'\\"]+)", marker)
                if extra and extra.group(1) not in wanted:
                    continue
                m = re.match(r"\\s*([A-Za-z0-9_.-]+)(\\[([^\\]]*)\\])?", req)
                todo.append((m.group(1), tuple(x.strip() for x in (m.group(3) or "").split(",") if x.strip())))
        return {key for key, _ in seen}
    norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
    # Declared: the install with every extra the pack offers (an optional feature imports its extra lazily, e.g.
    # cache-dit for step caching: it must be declared as an extra, not missing).
    declared = closure("minimax-h3-split", tuple(md.metadata("minimax-h3-split").get_all("Provides-Extra") or ()))
    torchs = closure("torch") | closure("torchvision")
    print(json.dumps({"file": h3_core.__file__, "modules": len(names), "app": type(app).__name__,
                      "undeclared": sorted(norm(d) for d in used if norm(d) not in declared | torchs),
                      "declared": sorted(declared)}))
""")


def _fresh_clone(dest: Path) -> Path:
    """The checkout's files as a fresh clone has them (tracked and new, never ignored build output or venvs)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, (entry.decode() for entry in listed)):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def test_requirements_txt_and_pyproject_declare_the_same_runtime_dependencies():
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    listed = [line.split("#")[0].strip() for line in (REPO / "requirements.txt").read_text().splitlines()]
    assert sorted(declared) == sorted(filter(None, listed))


def test_pip_install_ray_extra_into_a_fresh_venv_imports_what_serve_engine_ray_needs(tmp_path, tiny_dir):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs the git checkout (the install is made from a fresh copy of its files)")
    clone = _fresh_clone(tmp_path / "clone")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    fresh_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                capture_output=True, text=True, check=True).stdout.strip()
    base_site = sysconfig.get_paths()["purelib"]
    Path(fresh_site, "h3-base.pth").write_text(base_site + "\n")  # the base's heavy packages (torch, ...)
    install = subprocess.run([str(python), "-m", "pip", "install", "--no-index", "--no-build-isolation",
                              "--disable-pip-version-check", ".[ray]"], cwd=clone, capture_output=True, text=True,
                             timeout=600)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    assert f"Successfully installed {DIST}-" in install.stdout

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "H3_THREADS": "1"}
    check = subprocess.run([str(python), "-c", CHECK, str(tiny_dir)], cwd=outside, capture_output=True, text=True,
                           timeout=600, env=env)
    assert check.returncode == 0, check.stderr[-4000:]
    found = json.loads(check.stdout.strip().splitlines()[-1])
    assert found["file"].startswith(fresh_site), found["file"]  # the installed copy, not the checkout
    assert found["modules"] > 50 and found["app"] == "Application"
    assert found["undeclared"] == [], f"imported but not declared in pyproject.toml: {found['undeclared']}"
    for needed in ("ray", "prometheus-client", "xxhash", "comfy-kitchen", "starlette", "aiohttp"):
        assert needed in found["declared"]
    helped = subprocess.run([str(python), "-m", "h3_core", "serve", "--help"], cwd=outside, capture_output=True,
                            text=True, timeout=300, env=env)
    assert helped.returncode == 0 and f"{DIST}[ray]" in " ".join(helped.stdout.split())
    # The installed package holds h3_core only: ComfyUI's `nodes` module must not be shadowed.
    installed = Path(fresh_site)
    assert (installed / "h3_core" / "remote" / "ray_engine.py").is_file() and not (installed / "nodes").exists()
