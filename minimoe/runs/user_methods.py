"""Methods and objectives from your own files: `register_method`, `register_objective`, finding them
again in a fresh process, and the one resolution of a method's name.

A file (or module) of your own defines a policy and calls `minimoe.register_method(Method(...))` at
import (README: Adding a routing method; examples/my_method.py). train.py's --method-module imports
it; the record then remembers where it came from (`Method.module`), and the configured method's
record (`Method.record`: config.json's "method", every adapter's "router") holds it too, so that evaluate.py, --resume and load_adapter import it
again in a fresh process (`resolve_method`, `method_of`: a method record to its configured Method).

An objective of your own (`register_objective`, examples/my_objective.py) comes the same way: its file
is the run's --method-module (one file may register methods and objectives both), recorded in
config.json, so that --resume and evaluate.py import it again before --objective is read.

A file is imported under a name of its own in sys.modules (`minimoe_method_<hash of its path>`), so
that importing it twice, from a relative and an absolute path, registers it once.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch.nn as nn

from minimoe.core.routing_methods.methods import ALIASES, METHODS, Method, get_method
from minimoe.core.routing_methods.objectives import OBJECTIVES, Objective

_source: list[str] = []  # the file or module being imported by import_method_module, while it registers


def register_method(method: Method) -> Method:
    """Add `method` to METHODS: set_router, training, saved adapters, evaluation and train.py's --method
    then take it as they take a built-in one. Called at import of the file that defines it; a fresh
    process finds that file again through `Method.module`, recorded here (train.py --method-module)."""
    if not (isinstance(method, Method) and isinstance(method.name, str) and method.name.isidentifier()):
        raise ValueError(f"register_method: expected a Method whose name is an identifier; got {method!r}")
    if not (isinstance(method.policy, type) and issubclass(method.policy, nn.Module)
            and hasattr(method.policy, "from_gate")):
        raise ValueError(f"register_method: {method.name!r}: policy {method.policy!r} is not an nn.Module class "
                         f"with a from_gate(gate, config, **options) classmethod (subclass NativeRouter)")
    bad = [lr for lr, _ in method.heads.values() if not lr.endswith("_lr")]
    if bad:
        raise ValueError(f"register_method: {method.name!r}: learning-rate option(s) {bad} must end in '_lr'")
    if "tune_router" in method.options:
        raise ValueError(f"register_method: {method.name!r}: tune_router is set_router's own option for every "
                         f"method; leave it out of options")
    if _source:
        method.module = _source[-1]
    elif method.module is None and method.policy.__module__.split(".")[0] != "minimoe":
        method.module = None if method.policy.__module__ == "__main__" else method.policy.__module__
    known = METHODS.get(method.name)
    if method.name in ALIASES or (known is not None and (known.module is None or known.module != method.module)):
        raise ValueError(f"register_method: a method named {method.name!r} is registered already"
                         + (f" (from {known.module})" if known is not None and known.module else " (built in)"))
    METHODS[method.name] = method
    return method


def register_objective(objective: Objective) -> Objective:
    """Add `objective` to objectives.OBJECTIVES: --objective, config.json, the training step and the row
    labels then take it as they take IS and ENLL. Called at import of the file that defines it, which a
    run names as its --method-module (recorded here as `Objective.module`)."""
    if not (isinstance(objective, Objective) and isinstance(objective.name, str) and objective.name.isidentifier()
            and callable(objective.loss)):
        raise ValueError(f"register_objective: expected an Objective whose name is an identifier and whose loss is "
                         f"a function (pred, observed, eps) -> per-token loss; got {objective!r}")
    if _source:
        objective = replace(objective, module=_source[-1])
    known = OBJECTIVES.get(objective.name)
    if known is not None and (known.module is None or known.module != objective.module):
        raise ValueError(f"register_objective: an objective named {objective.name!r} is registered already"
                         + (f" (from {known.module})" if known.module else " (built in)"))
    OBJECTIVES[objective.name] = objective
    return objective


@contextmanager
def _registering(where: str):
    _source.append(where)
    try:
        yield
    finally:
        _source.pop()


def import_method_module(where: str):
    """Import the Python file (a path ending in .py) or module (a dotted name) that registers a method."""
    if where.endswith(".py"):
        path = Path(where).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"method module {where}: no such file; expected a Python file that calls "
                                    f"minimoe.register_method")
        name = f"minimoe_method_{abs(hash(str(path)))}"
        if name in sys.modules:
            return
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            with _registering(str(path)):
                spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return
    try:
        with _registering(where):
            importlib.import_module(where)
    except ModuleNotFoundError as e:
        if e.name is None or not where.startswith(e.name):
            raise
        raise ModuleNotFoundError(f"method module {where!r}: no such module; expected an importable module name "
                                  f"or a path to a .py file that calls minimoe.register_method") from None


def import_registering(name: str, module: str | None):
    """Import `module` (a file or module that registers the method `name`; None: nothing to import), and
    refuse it if it registers no such method. Importing is done once per process, and also when the name
    is known already, so that a missing file fails wherever it is named."""
    if module is None:
        return
    import_method_module(module)
    if ALIASES.get(name, name) not in METHODS:
        raise ValueError(f"unknown method {name!r}: {module} was imported but registers no method {name!r}; "
                         f"the registered ones are {list(METHODS)}")


def resolve_method(name: str, module: str | None = None) -> Method:
    """The registered method `name` ("ce" is native), `module` imported first (`import_registering`)."""
    import_registering(name, module)
    return get_method(name)


def method_of(record: dict | None) -> Method | None:
    """The configured Method a method record describes (Method.record's shape: config.json's "method", an
    adapter's "router"), its "module" imported first: every builder of a configured method comes through
    here (a run's settings: config.MethodSettings.configured; a saved adapter: load_adapter, export,
    evaluate.py) to Method.from_record. None: no record."""
    if record is None:
        return None
    if "name" in record:
        import_registering(record["name"], record.get("module"))
    return Method.from_record(record)
