"""Settings from files and records of any version: a run's config.json, a --config settings file (JSON or
YAML), a sweep cell's flags, read into TrainConfig's fields with the flags' checks (`read_settings`).

A run's config.json holds its configured method as one mapping ("method": {"name": "tes", "objective":
"is", "lambda_": 0.001, ...}: Method.record); it is read back into the method's settings, and so
through the same checks as the flags, into the one configured Method (config.method_for). Older
config.json files read as today's (`settings_of`): those that held the method's settings at the top
level beside the others ("method": "tes", "objective": "is", "lambda_": ...), and before them those
that also held the built-in methods' options there ("gamma": 1.0, ...); settings an older version
recorded and this one dropped (`RETIRED`) are read without a word.

An adapter's adapter_config.json holds the same record as its "router" (on the layers it trained); older
ones held a router spec of their own layout, read as today's record (`adapter_record`).
"""
from __future__ import annotations

import json
from pathlib import Path

from minimoe.core.routing_methods.methods import declaring
from minimoe.runs.config import FIELDS, RECORD_KEYS, check_value

# ---- settings from files and records

# Settings train.py derives from the model and the recipe: a settings file's values of these are not read.
NOT_READ_FROM_FILE = ("pad_token_id", "train_examples")
# Settings older versions recorded and this one dropped: read from any file without a word. The resume
# tests' kill switches (tests/kill.py stops runs now).
RETIRED = ("stop_after_epochs", "stop_after_steps")


def settings_of(mapping: dict, where: Path | None = None) -> dict:
    """TrainConfig fields from a mapping of settings as any version wrote it: a run's config.json, a
    settings file, a sweep cell's flags. A method option at the top level (gamma: 2; config.json had the
    built-in ones there before method_options held every option) joins method_options; other keys are
    left out (a run's config.json holds some for its readers: label, model_config, provenance, ...),
    but those of a settings file of yours (`where`), which are refused, named."""
    settings, top_level = {}, {}
    for key, value in mapping.items():
        if key == "method" and isinstance(value, dict):  # config.json's one record of the configured method
            settings |= method_settings_of(value, where)
        elif key in FIELDS:
            settings[key] = value
        elif declaring(key):
            top_level[key] = value
        elif key in RETIRED:
            continue
        elif where is not None and "model_config" not in mapping:  # not a run's config.json
            raise ValueError(f"{where}: {key!r} is not a setting; expected TrainConfig fields (minimoe/runs/config.py)")
    if top_level:
        settings["method_options"] = {**top_level, **(settings.get("method_options") or {})}
    return settings


def method_settings_of(record: dict, where: Path | None = None) -> dict:
    """The method's settings (config.MethodSettings) from config.json's "method" mapping (its Method.record)."""
    keys = {key: setting for setting, key in RECORD_KEYS.items()}
    if unknown := sorted(set(record) - set(keys)):
        raise ValueError(f"{where or 'config.json'}: method {unknown}: not part of a configured method; expected "
                         f"the keys {sorted(keys)}")
    return {keys[key]: value for key, value in record.items()}


def read_run_config(path: Path):
    """A run's config.json (or a JSON settings file), as written."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); the run's config is truncated or corrupt, so the run "
                         f"cannot be resumed as it was") from None


def read_settings(path: Path) -> dict:
    """A JSON or YAML mapping of TrainConfig fields (a run's config.json is one, of any version), checked
    as the flags are."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such settings file; expected a run's config.json or a JSON/YAML file of "
                                f"TrainConfig fields")
    if path.suffix in (".yaml", ".yml"):
        import yaml
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML ({e})") from None
    else:
        raw = read_run_config(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: holds a {type(raw).__name__}; expected a mapping of TrainConfig fields")
    settings = settings_of(raw, path)
    try:
        return {key: check_value(key, value) for key, value in settings.items()
                if key not in NOT_READ_FROM_FILE and value is not None}
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


# ---- an adapter's method record

def adapter_record(adapter_config: dict) -> dict | None:
    """The method record (methods.Method.record) of an adapter_config.json of any version: today's "router"
    as written; before it, a router spec of "method", "layers", "tune_router", a method of your own's
    "module" and the policy's options beside them (no objective nor lambda: those keys are then absent,
    and load_adapter checks the keys present); before that, an adapter whose native gates were tuned
    by hand held none (native routing, its gate_layers tuned). None: LoRA alone, on native routing."""
    router = adapter_config.get("router")
    if router is None:
        layers = adapter_config.get("gate_layers")
        return {"name": "native", "layers": layers, "tune_router": True} if layers else None
    if "name" in router:
        return router
    options = {k: v for k, v in router.items() if k not in ("method", "layers", "tune_router", "module")}
    return {"name": router["method"], **{k: router[k] for k in ("module", "layers", "tune_router") if k in router},
            "options": options}
