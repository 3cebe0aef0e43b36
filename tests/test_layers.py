"""The package's layers, checked by parsing every import (inside functions and
TYPE_CHECKING blocks too, where cycles like to hide).

Each layer is a folder of ``zeropipe/``, lowest first:

    apps        apps/       the commands, train, bench, data, reference models
    adapters    adapters/   real models cut into stages, LM losses
    planning    planning/   specs, balance, memory plans, cluster search, profiling, auto_plan
    runtime     runtime/    Pipeline, handlers, transports, memory, checkpoints, launch
    autograd    autograd/   split I/W, priority, parallel branches, grad memory
    base        base/       _compat, device, storage: the torch base
    core        core/       the schedule IR and everything that reasons about it (no torch)

A module may import from its own layer and the layers below it, never from a
layer above.  ``zeropipe/__init__.py`` (the public surface) may name anything;
``zeropipe/__main__.py`` belongs to apps.  docs/architecture.md describes the
same table.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "zeropipe"

# Lowest first.  A module's layer is its folder under zeropipe/.
LAYERS: tuple[str, ...] = ("core", "base", "autograd", "runtime", "planning", "adapters", "apps")
# Planning modules that must stay importable without torch (``zeropipe plan`` runs without it).
TORCH_FREE_PLANNING = (
    "zeropipe.planning",
    "zeropipe.planning.specs",
    "zeropipe.planning.catalog",
    "zeropipe.planning.hf_config",
    "zeropipe.planning.balance",
    "zeropipe.planning.cluster",
    "zeropipe.planning.cluster_costs",
    "zeropipe.planning.plan_memory",
    "zeropipe.planning.step_bound",
    "zeropipe.planning.pricing",
    "zeropipe.planning.pricing.links",
    "zeropipe.planning.pricing.moe",
    "zeropipe.planning.pricing.tensor_parallel",
    "zeropipe.planning.pricing.transformer",
)
# The package's __init__ is the public surface: it may name anything (lazily for torch).
TOP = "zeropipe"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    parts = module.split(".")
    if module == "zeropipe.__main__":
        return LAYERS.index("apps")
    if len(parts) < 2 or parts[1] not in LAYERS:
        raise AssertionError(
            f"{module} is in no layer folder: put it in one of zeropipe/{{{','.join(LAYERS)}}}/ "
            f"(docs/architecture.md says which)"
        )
    return LAYERS.index(parts[1])


def _imports(module: str) -> list[tuple[str, list[str], int]]:
    """(imported module, names imported from it, line) for every zeropipe import."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, list[str], int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((alias.name, [], node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            names = [a.name for a in node.names]
            # ``from zeropipe.core.schedules import auto`` imports a module, not a name.
            submodules = [n for n in names if f"{base}.{n}" in MODULES]
            for n in submodules:
                found.append((f"{base}.{n}", [], node.lineno))
            rest = [n for n in names if n not in submodules]
            if rest or not submodules:
                found.append((base, rest, node.lineno))
    return [(m, n, line) for m, n, line in found if m == TOP or m.startswith(TOP + ".")]


def _resolve(name: str) -> str:
    while name not in MODULES and "." in name:
        name = name.rpartition(".")[0]
    return name


def _graph() -> dict[str, set[str]]:
    return {
        m: {_resolve(t) for t, _, _ in _imports(m)} - {m}
        for m in MODULES
        if m != TOP  # the public surface is the one place that names every layer
    }


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        if module != TOP:
            _layer(module)


def test_no_module_imports_a_higher_layer() -> None:
    wrong = []
    for module in MODULES:
        if module == TOP:
            continue
        mine = _layer(module)
        for target, _, line in _imports(module):
            target = _resolve(target)
            if target == TOP:
                wrong.append(f"{module}:{line} imports the package root {TOP!r}")
            elif _layer(target) > mine:
                wrong.append(
                    f"{module}:{line} ({LAYERS[mine]}) imports {target} ({LAYERS[_layer(target)]})"
                )
    assert not wrong, "layer violations:\n" + "\n".join(wrong)


def test_no_import_cycle() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_schedule_registry_does_not_import_the_generators() -> None:
    registry = {_resolve(t) for t, _, _ in _imports("zeropipe.core.schedules.registry")}
    generators = {m for m in MODULES if m.startswith("zeropipe.core.schedules.")} - {
        "zeropipe.core.schedules.registry"
    }
    assert not registry & generators, f"the registry imports {sorted(registry & generators)}"


def test_no_private_name_crosses_modules() -> None:
    crossing = [
        f"{module}:{line} imports {', '.join(n for n in names if n.startswith('_'))} from {target}"
        for module in MODULES
        for target, names, line in _imports(module)
        if any(n.startswith("_") and not n.startswith("__") for n in names)
    ]
    assert not crossing, "\n".join(crossing)


def test_every_folder_of_the_package_is_a_layer() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(LAYERS), f"folders {sorted(folders)} against layers {sorted(LAYERS)}"
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py"], f"modules outside a layer folder: {loose}"


def test_core_and_the_planner_do_not_import_torch() -> None:
    core = [m for m in MODULES if m != TOP and _layer(m) == 0] + list(TORCH_FREE_PLANNING)
    offenders = []
    for module in core:
        tree = ast.parse(MODULES[module].read_text())
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(n == "torch" or n.startswith("torch.") for n in names):
                offenders.append(f"{module}:{node.lineno}")
    assert not offenders, f"core modules import torch: {offenders}"


def _without_torch(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``zeropipe ARGV`` in a fresh interpreter where torch cannot be imported."""
    script = textwrap.dedent(
        f"""
        import sys
        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                return None
        sys.meta_path.insert(0, NoTorch())
        from zeropipe.apps.cli import main
        code = main({argv!r})
        assert "torch" not in sys.modules
        sys.exit(code)
        """
    )
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=cwd
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["schedules"],
        ["simulate", "--schedule", "zbv", "--ranks", "4", "--microbatches", "8"],
        ["simulate", "--schedule", "auto", "--ranks", "2", "--microbatches", "4"],
        [
            "plan",
            "--model",
            "llama-3-8b",
            "--gpus",
            "8",
            "--gpu",
            "h100-sxm",
            "--seq",
            "1024",
            "--global-batch",
            "16",
            "--schedules",
            "1f1b,zbv,auto",
            "--quiet",
        ],
    ],
)
def test_schedule_commands_run_without_torch(tmp_path: Path, argv: list[str]) -> None:
    proc = _without_torch(argv, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), "the command printed nothing"


def test_a_command_that_needs_torch_says_so_in_one_line(tmp_path: Path) -> None:
    proc = _without_torch(["train", "--steps", "1"], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "zeropipe: error: 'zeropipe train' needs PyTorch, which is not installed; install it "
        "first (pip install torch==2.13.0, or the CPU build: see the README)"
    )


def test_modules_stay_under_600_lines_or_say_which_one_concept_they_hold() -> None:
    big = []
    for module, path in MODULES.items():
        text = path.read_text()
        lines = len(text.splitlines())
        doc = ast.get_docstring(ast.parse(text)) or ""
        if lines > 600 and "one concept" not in doc:
            big.append(f"{module}: {lines} lines")
    assert not big, "split these, or name their one concept in the docstring: " + ", ".join(big)


def test_no_function_is_over_80_lines() -> None:
    # Past a screen, a function holds more than one step of its story: split it by concept.
    long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > 80:
                    long.append(f"{module}.{node.name} ({lines} lines, line {node.lineno})")
    assert not long, "split these functions: " + ", ".join(long)


def test_no_folder_holds_more_than_12_modules() -> None:
    crowded = []
    for folder in sorted({path.parent for path in MODULES.values()}):
        modules = sorted(p.name for p in folder.glob("*.py"))
        if len(modules) > 12:
            crowded.append(f"{folder.relative_to(PACKAGE.parent)}: {len(modules)} modules")
    assert not crowded, "group these folders' modules into sub-packages: " + ", ".join(crowded)


# Tests of the package as a whole; every other test sits in the folder of what it tests.
WHOLE_PACKAGE_TESTS = [
    "test_docs.py",
    "test_examples.py",
    "test_gpu.py",
    "test_layers.py",
    "test_package.py",
]


def test_the_tests_mirror_the_package_folders() -> None:
    tests = PACKAGE.parent / "tests"
    package = {p.relative_to(PACKAGE) for p in PACKAGE.rglob("*") if _is_package(p)}
    mirrored = {p.relative_to(tests) for p in tests.rglob("*") if _is_package(p)}
    stray = sorted(str(f) for f in mirrored - package)
    assert not stray, f"test folders that mirror no folder of zeropipe/: {stray}"
    loose = sorted(p.name for p in tests.glob("test_*.py"))
    assert loose == WHOLE_PACKAGE_TESTS, (
        f"tests/ holds {loose}: put a module's tests in the folder mirroring the module's"
    )


def _is_package(path: Path) -> bool:
    return path.is_dir() and (path / "__init__.py").exists()


def test_every_module_opens_with_a_docstring() -> None:
    missing = [
        m for m, path in MODULES.items() if not ast.get_docstring(ast.parse(path.read_text()))
    ]
    assert not missing, missing


def test_the_tokenizer_command_runs_without_torch(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    (tmp_path / "d.txt").write_text("the cat sees a warm bed. " * 200)
    proc = _without_torch(
        ["tokenizer", "--data", "d.txt", "--vocab", "300", "--out", "t"], tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "t" / "tokenizer.json").is_file()
