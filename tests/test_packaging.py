"""Package boundaries: import names nothing shadows, a layering that reads one way, and a
wheel that works on its own.

PyPA's `build` is installed in the test environment (the dev extra), so the whole suite
already runs beside it; these tests also put regular packages named like every top-level
folder first on `sys.path`, and run the entry points from an installed wheel.
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = {"runtime": REPO / "runtime", "plugins": REPO / "plugins", "build": REPO / "build"}
FOLDER_NAMES = ("build", "runtime", "plugins", "scripts", "model_repo", "tests")


def run(command: list[str], env: dict | None = None, cwd: Path = REPO, timeout: int = 300):
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


# --- shadowing ------------------------------------------------------------------------

def test_pypa_build_is_the_build_that_imports():
    import build

    assert hasattr(build, "ProjectBuilder"), "PyPA's build should be installed (dev extra)"
    assert "site-packages" in build.__file__


@pytest.fixture(scope="module")
def shadowing_env(tmp_path_factory) -> dict:
    """PYTHONPATH with regular packages named like every top-level folder, first; each one
    fails loudly if anything imports it."""
    shadows = tmp_path_factory.mktemp("shadows")
    for name in FOLDER_NAMES:
        (shadows / name).mkdir()
        (shadows / name / "__init__.py").write_text(
            f"raise ImportError('the shadowing package {name!r} was imported')\n")
    return {**os.environ, "PYTHONPATH": str(shadows)}


@pytest.mark.parametrize("script", ["generate", "bench", "build_engines", "make_models", "serve",
                                    "client", "prepare_model_repo", "serve_dynamo", "dynamo_cluster",
                                    "bench_dynamo", "flip_rate", "compare_engines"])
def test_entry_points_start_with_shadowing_packages_first(shadowing_env, script):
    result = run([sys.executable, str(REPO / "scripts" / f"{script}.py"), "--help"], env=shadowing_env)
    assert "usage:" in result.stdout


def test_generation_and_tests_run_with_shadowing_packages_first(shadowing_env, tiny_pair):
    result = run([sys.executable, str(REPO / "scripts" / "generate.py"), "--target", str(tiny_pair / "target"),
                  "--draft", str(tiny_pair / "draft"), "--max-tokens", "6", "--json"], env=shadowing_env)
    assert len(json.loads(result.stdout)["output_ids"]) == 6
    tests = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                 "tests/test_plugins_reference.py", "tests/test_budget.py"], env=shadowing_env)
    assert " passed" in tests.stdout


# --- layering -------------------------------------------------------------------------

def saguaro_modules() -> dict[str, Path]:
    modules = {}
    for root in SOURCE_ROOTS.values():
        for path in sorted((root / "saguaro").rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def saguaro_imports(path: Path, module: str, top_level: bool, named: bool = False) -> set[str]:
    """The `saguaro.*` modules a file imports, at module level or inside functions; with
    `named`, also those it names in a string (what it imports through importlib)."""
    tree = ast.parse(path.read_text())
    function_nodes = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                      for node in ast.walk(fn) if node is not fn}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and (id(node) in function_nodes) != top_level:
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                names = [f"{base}.{alias.name}" for alias in node.names] + [base]
            else:
                names = [alias.name for alias in node.names]
            found |= {name for name in names if name.startswith("saguaro.")}
    if named:
        found |= {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                  and isinstance(node.value, str) and re.fullmatch(r"saguaro(\.\w+)+", node.value)}
    return found


def import_graph(named: bool = False) -> dict[str, set[str]]:
    """Module -> the saguaro modules it imports at module level (`named`: and those it
    imports through importlib, which load later, at a call, so they make no import cycle)."""
    modules = saguaro_modules()
    return {name: {target for target in saguaro_imports(path, name, top_level=True, named=named) if target in modules}
            for name, path in modules.items()}


def test_no_import_cycle():
    graph, state = import_graph(), {}

    def visit(name, trail):
        if state.get(name) == "done":
            return
        assert state.get(name) != "open", f"import cycle: {' -> '.join(trail + [name])}"
        state[name] = "open"
        for target in graph[name]:
            visit(target, trail + [name])
        state[name] = "done"

    for name in graph:
        visit(name, [])


LOOPS = ("saguaro.runtime.decoding", "saguaro.runtime.pipeline")
PRODUCT_OF_BUILD = ("saguaro.compiler", "saguaro.modelmaker")


@pytest.mark.parametrize("importer, forbidden", [
    ("saguaro.plugins", ("saguaro.runtime", "saguaro.serving", "saguaro.benchmarks", *PRODUCT_OF_BUILD)),
    ("saguaro.runtime", ("saguaro.serving", "saguaro.benchmarks", *PRODUCT_OF_BUILD)),
    ("saguaro.serving", ("saguaro.benchmarks", *PRODUCT_OF_BUILD)),
    ("saguaro.compiler", (*LOOPS, "saguaro.runtime.control.load_policy", "saguaro.serving", "saguaro.benchmarks",
                          "saguaro.modelmaker")),
    # engines are a leaf: backends implement the engine protocol and import no loop
    ("saguaro.runtime.engines", (*LOOPS, "saguaro.runtime.control.load_policy", "saguaro.runtime.control.budget")),
    ("saguaro.runtime.core", (*LOOPS, "saguaro.runtime.engines", "saguaro.runtime.models")),
    ("saguaro.runtime.models", (*LOOPS, "saguaro.runtime.engines", "saguaro.runtime.control")),
    ("saguaro.runtime.control", (*LOOPS, "saguaro.runtime.engines")),
    # the batch loop sees engines only through the contracts (the TensorRT-LLM request
    # loop opens its own draft engine)
    *[(f"saguaro.runtime.decoding.{loop}", ("saguaro.runtime.engines",))
      for loop in ("decoder", "requests", "rounds", "speculator", "verifier", "scheduler")],
])
def test_layering_reads_one_way(importer, forbidden):
    graph = import_graph(named=True)
    edges = [(name, target) for name, targets in graph.items() if name == importer or name.startswith(importer + ".")
             for target in targets if any(target == f or target.startswith(f + ".") for f in forbidden)]
    assert not edges, f"imports against the layering: {edges}"


def test_no_deferred_imports_of_our_own_modules():
    """A function-level import of a saguaro module would hide a cycle. The one kind allowed:
    loading the OpenAI Triton kernels, which import `triton` (GPU machines), only where
    they run: in a TensorRT plugin's implementation when TensorRT runs the plugin, and in
    the kernel benchmark when a GPU is there."""
    deferred = {name: saguaro_imports(path, name, top_level=False) for name, path in saguaro_modules().items()}
    deferred = {name: targets for name, targets in deferred.items() if targets}
    assert set(deferred) <= {"saguaro.plugins.fused_verify.tensorrt_plugin", "saguaro.plugins.branch_draft.tensorrt_plugin",
                             "saguaro.benchmarks.kernel_bench"}
    assert all(".triton_kernel" in target for targets in deferred.values() for target in targets), deferred


def test_scripts_are_thin_entry_points():
    for script in sorted((REPO / "scripts").glob("*.py")):
        tree = ast.parse(script.read_text())
        definitions = [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
        assert not definitions, f"{script.name} defines {definitions}: library code belongs in the package"
        assert "sys.path" not in script.read_text(), f"{script.name} edits sys.path"


# --- the installed wheel --------------------------------------------------------------

@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory) -> tuple[Path, dict]:
    """The project's wheel built offline and installed into a folder of its own, and an
    environment in which Python sees that folder and the venv's dependencies, but not the
    editable install (`-S` skips the `.pth` files that point at this checkout)."""
    work = tmp_path_factory.mktemp("wheel")
    run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(work / "dist"), str(REPO)])
    wheel = next((work / "dist").glob("saguaro_trt-*.whl"))
    run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target",
         str(work / "site"), str(wheel)])
    env = {**os.environ, "PYTHONPATH": f"{work / 'site'}:{sysconfig.get_paths()['purelib']}"}
    return work, env


def test_wheel_holds_the_package_and_the_templates(installed_wheel):
    work, env = installed_wheel
    probe = run([sys.executable, "-S", "-c",
                 "import saguaro, saguaro.serving.model_repo as r, saguaro.compiler.config as c;"
                 "print(list(saguaro.__path__)); print(r.templates_dir()); print(c.config_path('tiny'))"],
                env=env, cwd=work)
    paths, templates, config = probe.stdout.splitlines()
    assert str(REPO) not in paths and str(work / "site") in paths
    assert templates.startswith(str(work / "site")) and config.startswith(str(work / "site"))


def test_installed_wheel_builds_generates_and_prepares_serving(installed_wheel, tiny_pair):
    work, env = installed_wheel
    python = [sys.executable, "-S", "-m"]
    run(python + ["saguaro.compiler.cli", "--config", "tiny", "--target", str(tiny_pair / "target"),
                  "--draft", str(tiny_pair / "draft"), "--out", str(work / "engines"), "--quiet"], env=env, cwd=work)
    generated = run(python + ["saguaro.runtime.cli", "--engines", str(work / "engines"), "--max-tokens", "5",
                              "--json"], env=env, cwd=work)
    assert len(json.loads(generated.stdout)["output_ids"]) == 5
    prepared = run(python + ["saguaro.serving.model_repo", "--engines", str(work / "engines"),
                             "--out", str(work / "repo")], env=env, cwd=work)
    config = (Path(prepared.stdout.strip()) / "ssd" / "config.pbtxt").read_text()
    assert str(work / "engines") in config and "${" not in config
