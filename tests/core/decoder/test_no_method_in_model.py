"""The network knows no method: the model's files (the model and every core module it imports, the experts
and the token mixers among them) name no routing method. A method reaches the MoE block only through the
policy it installs (`MoEBlock.router`) and the Routing record that policy returns; the policies' own module
(routing, the block's door to them) is where methods live, so the walk stops there."""
import ast
import importlib
import re
import sys
from pathlib import Path

from minimoe.core.routing_methods.methods import METHODS
from minimoe.core.decoder.model import MoEForCausalLM
from minimoe.core.routing_methods.routing import NativeRouter


def module_file(name: str) -> Path | None:
    """The file of minimoe module `name` (a package: its __init__.py); None for a name that is no module."""
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None
    return Path(spec.origin) if spec is not None and spec.origin else None


def core_imports(path: Path) -> set[str]:
    """The minimoe.core modules a file imports, at any depth of the file (function-level imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:  # `from minimoe.core.layers import experts` imports the module minimoe.core.layers.experts
                sub = f"{node.module}.{a.name}"
                found.add(sub if module_file(sub) is not None else node.module)
    return {m for m in found if m.startswith("minimoe.core.")}


def network_modules() -> dict[str, Path]:
    """The model's module and every core module it reaches by imports, but the policies' (and past it)."""
    stop = NativeRouter.__module__
    seen, todo = {}, [MoEForCausalLM.__module__]
    while todo:
        name = todo.pop()
        if name in seen or name == stop:
            continue
        seen[name] = module_file(name)
        todo += core_imports(seen[name])
    return seen


def method_words() -> set[str]:
    """What names a method: each method with a policy of its own (not the family's NativeRouter: router-only
    tuning and CE are the network's own routing) by its name, its label, its policy's class and that class's
    module (densemixer, esft), each also without spaces or dashes."""
    words = set()
    for m in METHODS.values():
        if m.policy is NativeRouter:
            continue
        words |= {m.name, m.label, m.policy.__name__}
        if m.policy.__module__ != NativeRouter.__module__:
            words.add(sys.modules[m.policy.__module__].__name__.rpartition(".")[2])
    return words | {re.sub(r"[\s-]", "", w) for w in words}


def test_the_model_files_name_no_method():
    network = network_modules()
    assert {"model", "experts", "mixers", "attention"} <= {n.rpartition(".")[2] for n in network}, network
    words = method_words()
    assert {"densemixer", "DenseMixer", "esft", "ESFT", "tes", "dual", "acs"} <= words  # the walk above found them
    pattern = re.compile(r"\b(" + "|".join(sorted(map(re.escape, words), key=len, reverse=True)) + r")\b", re.IGNORECASE)
    named = [f"{path.name}:{i}: {match.group(0)!r} in {line.strip()!r}"
             for path in network.values() for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             for match in [pattern.search(line)] if match]
    assert not named, "the network names a method (it should reach the block through its policy):\n" + "\n".join(named)
