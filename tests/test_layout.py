"""The house as the README draws it: the folders' imports run downwards only, core imports nothing outside
core, and the README's layout names every module where it is (README "Layout")."""
import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "minimoe"
# The README's architecture picture: each folder and the folders drawn right below it.
BELOW = {"cli": {"study", "integrations", "making"}, "study": {"runs"}, "integrations": {"runs"}, "making": {"runs"},
         "runs": {"loading", "evaluation"}, "loading": {"data"}, "data": {"core"}, "evaluation": {"core"},
         "core": set()}
ATOMIC = "atomic"  # minimoe/atomic.py: beside the folders, for every one but core


def reached(edges: dict, start) -> set:
    """Every node `start`'s edges reach, at any depth (`start` itself only through a circle)."""
    seen, todo = set(), list(edges[start])
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo += edges[node]
    return seen


def reachable(folder: str) -> set[str]:
    """What a folder may import: the folders below it, at any depth (an arrow may skip a level)."""
    return reached(BELOW, folder)


def imported_modules(path: Path) -> set[str]:
    """Every minimoe module a file imports, at any depth of the file (function-level imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("minimoe")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("minimoe"):
            for a in node.names:  # `from minimoe.runs import eval_run` imports the module minimoe.runs.eval_run
                sub = f"{node.module}.{a.name}"
                found.add(sub if (PACKAGE.parent / (sub.replace(".", "/") + ".py")).is_file() else node.module)
    return found


def folder_of(module: str) -> str | None:
    """minimoe.runs.config -> "runs"; minimoe.atomic -> "atomic"; the package's face (top, for cli/) -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_imports_run_downwards_only_and_core_imports_nothing_outside_core():
    assert set(BELOW) == {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = folder_of(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        if here not in BELOW:  # minimoe/__init__.py (the package's face) and atomic.py
            if here == ATOMIC:
                wrong += [f"atomic.py -> {m}" for m in imported_modules(path)]
            continue
        allowed = reachable(here) | {here} | ({ATOMIC} if here != "core" else set()) | ({None} if here == "cli" else set())
        wrong += [f"{path.relative_to(PACKAGE)} -> {m}" for m in sorted(imported_modules(path))
                  if folder_of(m) not in allowed]
    assert not wrong, wrong


def test_the_readme_layout_names_every_module_in_its_folder():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    tree = text[text.index("## Layout"):]
    tree = tree[tree.index("```text\n") + 8:]
    tree = tree[:tree.index("```")]
    listed, folder = set(), None
    for line in tree.splitlines():
        head = re.match(r"^  (\w+)/", line)
        if head:
            folder = head.group(1)
        elif re.match(r"^\S", line):  # back at the repository's top level
            folder = None
        names = re.findall(r"\b(\w+)\.py\b", line)
        if re.match(r"^  \w+\.py", line):  # a module beside the folders (minimoe/atomic.py)
            listed |= {f"{n}.py" for n in names}
        elif folder:
            listed |= {f"{folder}/{n}.py" for n in names}
    modules = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    assert modules == listed, (sorted(modules - listed), sorted(listed - modules))


def test_the_readme_architecture_box_names_every_file_of_each_folder():
    """Issue 50 item 4: each folder's box in the README's architecture picture names its files, all and only
    (core's 9 of 16 once). A box is read from its `| folder/` line down to its bottom edge, between its walls."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    picture = text[text.index("```text\n", text.index("**Architecture.**")) + 8:]
    lines = picture[:picture.index("```")].splitlines()
    wrong = {}
    for folder in BELOW:
        (row, col), = [(i, line.index(f"| {folder}/")) for i, line in enumerate(lines) if f"| {folder}/" in line]
        named = set()
        while lines[row][col] == "|":
            named |= set(re.findall(r"\w+", lines[row][col + 1:lines[row].index("|", col + 1)]))
            row += 1
        files = {p.stem for p in (PACKAGE / folder).glob("*.py") if p.stem != "__init__"}
        if named - {folder} != files:
            wrong[folder] = (sorted(files - named), sorted(named - files - {folder}))
    assert not wrong, f"folder: (files the box leaves out, names it has that are no file): {wrong}"


def test_tests_import_the_oracles_so_that_a_plain_install_skips_only_their_tests():
    """Issue 41 item 4: .ci/run's second environment (a plain pip install -e .) has no oracle package. A test
    file that imports one at module level (not through conftest's oracle() or after a module-level
    importorskip) fails to collect there, losing every test in it."""
    from tests.conftest import ORACLES
    bad = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        skipped = set()
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            calls = [n for n in ast.walk(node)
                     if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "importorskip"]
            skipped |= {c.args[0].value.split(".")[0] for c in calls if c.args and isinstance(c.args[0], ast.Constant)}
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            bad += [f"{path.name}:{node.lineno}: {n}" for n in names if n.split(".")[0] in ORACLES
                    and n.split(".")[0] not in skipped]
    assert not bad, f"module-level imports of oracle packages (use conftest.oracle): {bad}"


def module_of(path: Path) -> str:
    """minimoe/runs/config.py -> minimoe.runs.config; minimoe/cli/__init__.py -> minimoe.cli."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_circles(package: Path) -> list[str]:
    """The modules of `package` that reach themselves through their imports, at any length (two files that
    import each other are the shortest circle) and lazily or not (an import inside a function counts)."""
    files = {module_of(p): p for p in package.rglob("*.py")}
    edges = {m: {i for i in imported_modules(p) if i in files and i != m} for m, p in files.items()}
    return sorted(m for m in edges if m in reached(edges, m))


def test_no_files_import_each_other_in_any_folder():
    """Issue 49 item 2, issue 50 item 4: no two files of minimoe import each other, at any length of the
    circle and lazily or not, in any folder (mla.py and model.py once did in core/; runs/adapters.py and
    runs/sharding.py in runs/, one of them from inside a function)."""
    circles = import_circles(PACKAGE)
    assert not circles, f"modules that reach themselves through their imports: {circles}"
