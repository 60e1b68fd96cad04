"""Run identity: a run is named after its model, benchmark, row (`Method.row`) and every ablation
setting its method reads that is off its default (`ablation_settings`), so that a sweep can name a
run before it exists and the report can key its rows.
"""
from __future__ import annotations

from pathlib import Path

from minimoe.core.routing_methods.methods import Method, declaring
from minimoe.runs.config import FIELDS, flag_name, method_settings

# ---- run identity

# Settings that tell an ablation's runs apart, with their short names in run names and report keys. The
# one table of them: sweep.py's --set takes those with a value by their train.py flag (flag_name).
ABLATION_SETTINGS = {"lambda_": "lambda", "layers": "layers", "transform": "transform", "gamma": "gamma",
                     "error_head_lr": "ehlr", "depth_scaled_lambda": "depthscaled", "aux_coef": "aux",
                     "esft_criterion": "esft", "esft_p": "esftp",
                     "esft_form": "esftform", "esft_lr": "esftlr"}

# Settings that only a supervised method reads (Method.prediction set).
SUPERVISION_SETTINGS = ("objective", "lambda_", "depth_scaled_lambda", "is_eps")


def reads(method: Method, setting: str) -> bool:
    """Whether `method` reads `setting`: a setting a method does not read is no part of its identity (CE
    at lambda 1e-2 is CE). Supervision settings are the supervised methods'; a method option or head
    learning rate (Method.declared) is its methods'; every other setting, every method's."""
    if setting in SUPERVISION_SETTINGS:
        return method.prediction is not None
    return setting in method.declared or not declaring(setting)


def unread_flags(settings: dict, method: Method) -> list[str]:
    """The flags of the supervision settings given (not None) that `method` does not read, for train.py's
    warning: CE and Dual Affinity supervise nothing, so --objective enll changes nothing there."""
    return [flag_name(k) for k in SUPERVISION_SETTINGS if settings.get(k) is not None and not reads(method, k)]


def ablation_settings(settings: dict, method: Method) -> dict:
    """The settings of ABLATION_SETTINGS off their defaults, by short name (e.g. {"lambda": 0.01}), for the
    run's configured `method` (its lambda, layer scope and option values) and its other `settings` (a
    run's config.json, a sweep cell's flags). A method registered from your own file adds its options
    that are off their defaults, under their own names."""
    settings, changed = {**settings, **method_settings(method)}, {}
    for key, short in ABLATION_SETTINGS.items():
        if not reads(method, key):
            continue
        value, default = ((method.values.get(key), method.settings[key]) if key in method.declared
                          else (settings.get(key), FIELDS[key].default))
        if value is None or value == default:
            continue
        changed[short] = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value
    if method.module is not None:
        changed |= {k: v for k, v in method.values.items() if k not in ABLATION_SETTINGS and v != method.settings[k]}
    return changed


def run_name(settings: dict, method: Method) -> str:
    """<model>-<data>-<row>[-<setting><value>...]-seed<seed>: every ablation setting off its default is in the
    name. As for ablation_settings, so that a sweep names a run before it exists."""
    parts = [Path(str(settings["model"])).name, Path(str(settings["data"])).name,
             method.row.replace(" + ", "+").replace(" ", "_")]
    for short, value in ablation_settings(settings, method).items():
        parts.append(short if value is True else f"{short}{value:g}" if isinstance(value, float) else f"{short}{value}")
    return "-".join([*parts, f"seed{settings['seed']}"])
