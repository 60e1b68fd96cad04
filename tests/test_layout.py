"""The house as the README draws it: the folders' imports run downwards only, core imports nothing outside
core, core's rooms import downwards only too, and the README's layout names every module where it is
(README "Layout")."""
import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "minimoe"
# The README's architecture picture: each folder and the folders drawn right below it.
BELOW = {"cli": {"study", "integrations", "making"}, "study": {"runs"}, "integrations": {"runs"}, "making": {"runs"},
         "runs": {"loading", "evaluation"}, "loading": {"data"}, "data": {"core"}, "evaluation": {"core"},
         "core": set()}
# core's rooms (its sub-folders) and the rooms drawn right below each, as the README's core box draws them
CORE_BELOW = {"adaptation": {"decoder"}, "task": {"routing_methods"}, "decoder": {"token_mixers", "routing_methods"},
              "token_mixers": {"layers"}, "routing_methods": set(), "layers": set()}
# minimoe/atomic.py and minimoe/process_memory.py: beside the folders, for every one but core; they import no minimoe
BESIDE = {"atomic", "process_memory"}


def reached(edges: dict, start) -> set:
    """Every node `start`'s edges reach, at any depth (`start` itself only through a circle)."""
    seen, todo = set(), list(edges[start])
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo += edges[node]
    return seen


def reachable(folder: str, below: dict = BELOW) -> set[str]:
    """What a folder may import: the folders below it, at any depth (an arrow may skip a level)."""
    return reached(below, folder)


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


def room_of(module: str) -> str | None:
    """minimoe.core.decoder.model -> "decoder"; a module outside core's rooms -> None."""
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[1] == "core" else None


def test_imports_run_downwards_only_and_core_imports_nothing_outside_core():
    assert set(BELOW) == {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = folder_of(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        if here not in BELOW:  # minimoe/__init__.py (the package's face), atomic.py and process_memory.py
            if here in BESIDE:
                wrong += [f"{here}.py -> {m}" for m in imported_modules(path)]
            continue
        allowed = reachable(here) | {here} | (BESIDE if here != "core" else set()) | ({None} if here == "cli" else set())
        wrong += [f"{path.relative_to(PACKAGE)} -> {m}" for m in sorted(imported_modules(path))
                  if folder_of(m) not in allowed]
    assert not wrong, wrong


def test_cores_rooms_import_downwards_only():
    """core's rooms as the README's core box draws them: a room imports only the rooms below it (at any depth),
    and every module of core is in a room."""
    core = PACKAGE / "core"
    assert set(CORE_BELOW) == {p.name for p in core.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert [p.name for p in core.glob("*.py")] == ["__init__.py"], "a module of core outside its rooms"
    wrong = []
    for path in sorted(core.rglob("*.py")):
        here = room_of(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        if here is None:
            continue
        allowed = reachable(here, CORE_BELOW) | {here}
        wrong += [f"{path.relative_to(PACKAGE)} -> {m}" for m in sorted(imported_modules(path))
                  if room_of(m) not in allowed]
    assert not wrong, wrong


def test_no_two_files_or_folders_of_the_package_share_a_name():
    """A name finds one room: no two modules (their stems, __init__ aside) or folders of minimoe share a name,
    and no folder shares its name with a module (core/routing/ beside a routing.py would)."""
    names = [p.stem for p in PACKAGE.rglob("*.py") if p.stem != "__init__"]
    names += [p.name for p in PACKAGE.rglob("*") if p.is_dir() and (p / "__init__.py").is_file()]
    shared = sorted({n for n in names if names.count(n) > 1})
    assert not shared, f"names held by more than one file or folder of minimoe/: {shared}"


def test_the_readme_layout_names_every_module_in_its_folder():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    tree = text[text.index("## Layout"):]
    tree = tree[tree.index("```text\n") + 8:]
    tree = tree[:tree.index("```")]
    listed, folder, room = set(), None, None
    for line in tree.splitlines():
        head, sub = re.match(r"^  (\w+)/", line), re.match(r"^    (\w+)/", line)
        if head:
            folder, room = head.group(1), None
        elif sub and folder:  # a room of the folder (core/decoder/)
            room = sub.group(1)
        elif re.match(r"^\S", line):  # back at the repository's top level
            folder = room = None
        names = re.findall(r"\b(\w+)\.py\b", line)
        if re.match(r"^  \w+\.py", line):  # a module beside the folders (minimoe/atomic.py)
            listed |= {f"{n}.py" for n in names}
        elif folder:
            listed |= {f"{folder}/{room}/{n}.py" if room else f"{folder}/{n}.py" for n in names}
    modules = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    assert modules == listed, (sorted(modules - listed), sorted(listed - modules))


def test_the_readme_architecture_box_names_every_file_of_each_folder():
    """Each folder's box in the README's architecture picture names its files, all and only (core's 9 of 16
    once), and a folder with rooms (core/) names each room followed by the room's files. A box is read from its
    `| folder/` line down to its bottom edge, between its walls."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    picture = text[text.index("```text\n", text.index("**Architecture.**")) + 8:]
    lines = picture[:picture.index("```")].splitlines()
    wrong = {}
    for folder in BELOW:
        (row, col), = [(i, line.index(f"| {folder}/")) for i, line in enumerate(lines) if f"| {folder}/" in line]
        named, open_rooms = {}, []  # what each folder or room names; the rooms the current line continues
        while lines[row][col] == "|":
            inside = lines[row][col + 1:lines[row].index("|", col + 1)]
            marks = [(m.start(), m.group(1)) for m in re.finditer(r"(\w+)/", inside)]
            if marks:  # a floor: "folder/ a, b" or "room/ a, b   room/ c": its rooms, left to right
                open_rooms = marks
            for word in re.finditer(r"\b(\w+)\b(?!/)", inside):
                if word.group(1) != "v" and open_rooms:  # "v": an arrow; a word belongs to the room left of it
                    where = [name for start, name in open_rooms if start <= word.start()][-1]
                    named.setdefault(where, set()).add(word.group(1))
            row += 1
        top = PACKAGE / folder
        rooms = {folder: top, **{p.name: p for p in top.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}}
        for where, path in rooms.items():
            files = {p.stem for p in path.glob("*.py") if p.stem != "__init__"}
            if named.get(where, set()) != files:
                wrong[f"{folder}/{where}" if where != folder else folder] = (
                    sorted(files - named.get(where, set())), sorted(named.get(where, set()) - files))
        if set(named) - set(rooms):
            wrong[folder] = ([], sorted(set(named) - set(rooms)))
    assert not wrong, f"folder: (files the box leaves out, names it has that are no file): {wrong}"


def test_tests_import_the_oracles_so_that_a_plain_install_skips_only_their_tests():
    """.ci/run's second environment (a plain pip install -e .) has no oracle package. A test
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
    """No two files of minimoe import each other, at any length of the circle and lazily or not, in any folder
    (mla.py and model.py once did in core/; runs/adapters.py and runs/sharding.py in runs/, one of them from
    inside a function)."""
    circles = import_circles(PACKAGE)
    assert not circles, f"modules that reach themselves through their imports: {circles}"
