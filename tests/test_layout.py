"""Library hygiene (issue 11): imports point one way, library packages hold library code, and each
shared helper is defined once.

Static checks over the source with `ast`: nothing is imported, so these run in well under a second.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.common.paths import REPO_ROOT

LIBRARY = ("composer_algos", "pipeline")


def _library_files() -> list[Path]:
    return sorted(p for pkg in LIBRARY for p in (REPO_ROOT / pkg).rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every runtime import in the file, lazy ones included."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield node.lineno, mod
            for alias in node.names:  # `from pkg import submodule`
                yield node.lineno, f"{mod}.{alias.name}"


def _offences(files: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    out = []
    for path in files:
        for line, mod in _imports(path):
            if any(mod == f or mod.startswith(f + ".") for f in forbidden):
                out.append(f"{path.relative_to(REPO_ROOT)}:{line} imports {mod}")
    return sorted(set(out))


def test_pipeline_never_imports_composer_algos():
    files = sorted((REPO_ROOT / "pipeline").rglob("*.py"))
    assert not _offences(files, ("composer_algos",)), "the data side must not import the training side"


def test_library_never_imports_tools_or_plotting():
    files = _library_files() + [REPO_ROOT / "train.py"]
    assert not _offences(files, ("tools", "matplotlib")), "library code must not import tools/ or plot"


def test_selection_and_feature_cores_never_import_composer():
    # The pure functional cores take tensors and numbers; only the Algorithm/Callback shells touch State.
    files = sorted((REPO_ROOT / "composer_algos" / "selection").rglob("*.py"))
    files += sorted((REPO_ROOT / "composer_algos" / "features").rglob("*.py"))
    assert not _offences(files, ("composer",)), "the selection and feature cores must not depend on Composer"


def test_only_the_foundry_plugin_touches_llmfoundry():
    # llm-foundry is an optional extra: the main environment never has it, and its plugin module imports
    # it lazily (inside functions), so importing composer_algos.foundry needs no llmfoundry either.
    plugin = REPO_ROOT / "composer_algos" / "foundry.py"
    others = [p for p in _library_files() + [REPO_ROOT / "train.py"] if p != plugin]
    assert not _offences(others, ("llmfoundry",)), "only composer_algos/foundry.py may import llmfoundry"
    top_level = [
        node
        for node in ast.parse(plugin.read_text(encoding="utf-8")).body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        and any(n.startswith("llmfoundry") for n in [getattr(node, "module", None) or "", *(a.name for a in node.names)])
    ]
    assert not top_level, "composer_algos/foundry.py must import llmfoundry inside functions only"


def test_library_holds_no_corpus_generator():
    assert not (REPO_ROOT / "pipeline" / "sample_corpus.py").exists(), (
        "the synthetic corpus belongs in tools/"
    )
    assert (REPO_ROOT / "tools" / "sample_corpus.py").exists()


def _library_graph() -> dict[str, set[str]]:
    files = _library_files()
    modules = {_module_name(p) for p in files}
    graph: dict[str, set[str]] = {}
    for path in files:
        name = _module_name(path)
        graph[name] = {mod for _, mod in _imports(path) if mod in modules and mod != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_library_modules():
    # A package's __init__ re-exporting its submodules, and a submodule importing its own package's
    # __init__, is the usual Python layout and not counted; any other cycle is.
    graph = _library_graph()
    for mod, deps in graph.items():
        graph[mod] = {d for d in deps if not mod.startswith(d + ".") and not d.startswith(mod + ".")}
    assert not _cycles(graph), "library modules import each other in a cycle"


def _assignments(name: str) -> list[str]:
    out = []
    for path in _library_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and any(
                isinstance(t, ast.Name) and t.id == name for t in targets
            ):
                out.append(str(path.relative_to(REPO_ROOT)))
    return out


def _calls(func_name: str, package: str) -> list[str]:
    out = []
    for path in sorted((REPO_ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if called == func_name:
                    out.append(str(path.relative_to(REPO_ROOT)))
    return out


def _files_containing(text: str, package: str) -> list[str]:
    return sorted(
        str(p.relative_to(REPO_ROOT))
        for p in (REPO_ROOT / package).rglob("*.py")
        if text in p.read_text(encoding="utf-8")
    )


def test_ignore_index_is_defined_once_on_the_data_side():
    assert _assignments("IGNORE_INDEX") == ["pipeline/collators.py"]


def test_one_per_example_cross_entropy_in_the_training_side():
    assert sorted(set(_calls("cross_entropy", "composer_algos"))) == ["composer_algos/losses.py"]


def test_one_seed_mixer():
    # The splitmix/golden-ratio constant marks a seed mixer; composer_algos has one module of them.
    assert _files_containing("0x9E3779B97F4A7C15", "composer_algos") == ["composer_algos/seeding.py"]


def test_one_composer_checkpoint_reader():
    readers = _files_containing('["integrations"]', "composer_algos") + _files_containing(
        '["integrations"]', "pipeline"
    )
    assert readers == ["pipeline/evaluation/checkpoint.py"]


@pytest.mark.parametrize("fn", ["validate_inputs", "parse_options", "empty_result"])
def test_strategies_share_one_prologue(fn):
    # Every strategy file gets its validated inputs and options from the `strategy` decorator in
    # types.py instead of repeating the calls.
    assert sorted(set(_calls(fn, "composer_algos/selection"))) == ["composer_algos/selection/types.py"]


# Issue 33: the layers of composer_algos, lowest first. A module may import its own layer and the ones
# below it, never one above: the cores never see the Composer shell, the shell never sees the analysis
# or the wiring. docs/architecture.md draws the same table.
LAYERS = (
    ("composer_algos.losses", "composer_algos.seeding", "composer_algos.mixture_io", "composer_algos.causal_masks"),  # shared vocabulary
    ("composer_algos.selection", "composer_algos.features", "composer_algos.doremi"),  # pure cores
    ("composer_algos.models",),  # the causal LM and its frozen-block caches
    ("composer_algos.data_selection",),  # the Composer shell: DataSelection and its step
    ("composer_algos.analysis", "composer_algos.callbacks"),  # studies' arithmetic; training callbacks
    ("composer_algos.registry", "composer_algos.builders", "composer_algos.foundry"),  # yaml names -> objects
)


def _layer(module: str) -> int | None:
    for level, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    return None


def test_every_library_module_has_a_layer():
    # A new top-level module or package must be placed in LAYERS (and in docs/architecture.md).
    unplaced = [m for m in _library_graph() if m.startswith("composer_algos.") and _layer(m) is None]
    assert not unplaced, f"modules outside the layer table: {unplaced}"


def _upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{mod} (layer {_layer(mod)}) imports {dep} (layer {_layer(dep)})"
        for mod, deps in graph.items()
        if _layer(mod) is not None
        for dep in deps
        if _layer(dep) is not None and _layer(dep) > _layer(mod)
    )


def test_no_library_module_imports_a_higher_layer():
    upward = _upward(_library_graph())
    assert not upward, "imports from a lower layer up:\n" + "\n".join(upward)


def test_the_layer_and_cycle_checks_can_fail():
    # A core importing the shell, and two tools importing each other (bench_step and window_cost did), are caught.
    assert _upward({"composer_algos.selection.partitionsel": {"composer_algos.data_selection.algorithm"}})
    assert _upward({"composer_algos.data_selection.step": {"composer_algos.analysis.compute_plan"}})
    assert not _upward({"composer_algos.data_selection.step": {"composer_algos.selection.types"}})
    assert _cycles({"bench_step": {"window_cost"}, "window_cost": {"bench_step"}}) == [["bench_step", "window_cost"]]


TOOL_FOLDERS = {"tools": "commands", "tools/bench": "bench", "tools/studies": "studies"}


def _tool_modules() -> dict[str, str]:
    """Module name (tools are imported by file name) -> its folder's role."""
    out = {}
    for folder, role in TOOL_FOLDERS.items():
        for p in (REPO_ROOT / folder).glob("*.py"):
            out[p.stem] = role
    return out


def _tool_imports() -> list[tuple[str, str, int, str, list[str]]]:
    """(file, its role, line, imported tool module, imported names) for each import of a tool module by a tool."""
    modules = _tool_modules()
    out = []
    for folder, role in TOOL_FOLDERS.items():
        for path in sorted((REPO_ROOT / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and not node.level and node.module in modules:
                    out.append((str(path.relative_to(REPO_ROOT)), role, node.lineno, node.module, [a.name for a in node.names]))
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        if alias.name in modules:
                            out.append((str(path.relative_to(REPO_ROOT)), role, node.lineno, alias.name, []))
    return out


def test_tool_module_names_are_unique_across_folders():
    # The tools import each other by file name, so one name must mean one file.
    seen: dict[str, list[str]] = {}
    for folder in TOOL_FOLDERS:
        for p in (REPO_ROOT / folder).glob("*.py"):
            seen.setdefault(p.stem, []).append(folder)
    assert {k: v for k, v in seen.items() if len(v) > 1} == {}


def test_no_tool_imports_another_tools_internals():
    private = [
        f"{file}:{line} imports {', '.join(n for n in names if n.startswith('_'))} from {mod}"
        for file, _, line, mod, names in _tool_imports()
        if any(n.startswith("_") for n in names)
    ]
    assert not private, "a tool reaches into another tool's private names:\n" + "\n".join(private)


def test_the_users_commands_never_import_benchmarks_or_studies():
    # tools/ holds the user's commands and their helpers; tools/bench and tools/studies build on them, not
    # the other way round, and neither imports the other.
    modules = _tool_modules()
    allowed = {"commands": {"commands"}, "bench": {"commands", "bench"}, "studies": {"commands", "studies"}}
    wrong = [
        f"{file}:{line} ({role}) imports {mod} ({modules[mod]})"
        for file, role, line, mod, _ in _tool_imports()
        if modules[mod] not in allowed[role]
    ]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_between_tools():
    modules = _tool_modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for file, _, _, mod, _ in _tool_imports():
        graph[Path(file).stem].add(mod)
    for m in graph:
        graph[m].discard(m)
    assert not _cycles(graph), "tools import each other in a cycle"


# Issue 33: a function a newcomer reads in one screen. Over MAX_FUNCTION_LINES (the `def` line to the
# last, docstring included) only with a comment in it starting `# Long:` that says why the length is the
# clearest form.
MAX_FUNCTION_LINES = 80


def _long_functions(files: list[Path], root: Path = REPO_ROOT) -> list[str]:
    out = []
    for path in files:
        lines = path.read_text(encoding="utf-8").splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                body = lines[node.lineno - 1 : node.end_lineno]
                if length > MAX_FUNCTION_LINES and not any(line.strip().startswith("# Long:") for line in body):
                    out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({length} lines)")
    return sorted(out)


def test_no_function_over_80_lines_without_its_reason():
    files = _library_files() + [REPO_ROOT / "train.py"]
    files += sorted(p for folder in TOOL_FOLDERS for p in (REPO_ROOT / folder).glob("*.py"))
    files += sorted((REPO_ROOT / "examples").glob("*.py"))
    long = _long_functions(files)
    assert not long, "functions over 80 lines without a `# Long:` reason:\n" + "\n".join(long)


def test_the_length_check_can_fail(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "long.py").write_text(f"def long():\n{body}\n")
    (tmp_path / "reasoned.py").write_text(f"def reasoned():\n    # Long: one table, read top to bottom.\n{body}\n")
    (tmp_path / "short.py").write_text("def short():\n    return 1\n")
    files = [tmp_path / name for name in ("long.py", "reasoned.py", "short.py")]
    assert _long_functions(files, root=tmp_path) == ["long.py:1 long (81 lines)"]
