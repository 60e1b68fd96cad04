"""Settings from files and records of any version: a run's config.json, a --config settings file (JSON or
YAML), a sweep cell's flags, read into TrainConfig's fields with the flags' checks (`read_settings`).

Older config.json files (before options moved into method_options, they held the built-in
methods' options at the top level: "gamma": 1.0, ...) read as today's (`settings_of`); settings an
older version recorded and this one dropped (`RETIRED`) are read without a word.
"""
from __future__ import annotations

import json
from pathlib import Path

from minimoe.core.methods import declaring
from minimoe.runs.config import FIELDS, check_value

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
        if key in FIELDS:
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
