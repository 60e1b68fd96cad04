"""train.py's flags, made from TrainConfig's fields, MethodSettings' (the flags that build its one
configured method) and the methods' records (`add_flags`): each field's default, check, --help group
and text become its flag; the built-in methods' options get a flag each
(`--gamma 2` is `--method-option gamma=2`). The sweep reads a cell's flags with the same parser
(`flags_parser`), so it lives here beside the settings, below the command lines.
"""
from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

from minimoe.core.routing_methods.methods import METHODS, declaring
from minimoe.runs.config import GROUPS, MethodSettings, TrainConfig, flag_name
from minimoe.runs.recipes import by_recipe

# ---- train.py's flags, made from the fields and the methods' records

def flag_type(check):
    """An argparse type from a check: its ValueError becomes argparse's own error (exit 2, naming the flag)."""
    def parse(text):
        try:
            return check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = getattr(check, "__name__", "value")
    return parse


class MethodOption(argparse.Action):
    """--method-option NAME=VALUE, or a built-in option's own flag (`name`: --gamma 2 is --method-option
    gamma=2): one entry of method_options, over those of a settings file read before."""

    def __init__(self, option_strings, dest, name: str | None = None, **kwargs):
        self.name = name
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, value, option_string=None):
        name, value = (self.name, value) if self.name else value
        setattr(namespace, self.dest, {**(getattr(namespace, self.dest, None) or {}), name: value})


def read_by(name: str) -> str:
    """The methods whose record reads the setting `name`, for its flag's help."""
    return ", ".join(m.name for m in declaring(name))


def add_flags(parser: argparse.ArgumentParser) -> dict:
    """Every setting's flag (MethodSettings' fields, which build TrainConfig.method, then TrainConfig's), in
    its group (GROUPS), with its default, check and help; after --method-option, one flag per built-in
    method option (methods.METHODS). Returns the groups."""
    groups = {key: parser.add_argument_group(title) for key, title in GROUPS.items()}
    # TrainConfig's fields in order, its method's flags where the method stands (so --help and usage keep it)
    settings = [g for f in fields(TrainConfig) for g in (fields(MethodSettings) if f.name == "method" else [f])]
    for f in settings:
        if "group" not in f.metadata:
            continue  # derived by train.py: pad_token_id, train_examples
        meta = dict(f.metadata)
        group, text = groups[meta.pop("group")], meta.pop("help")
        flag = meta.pop("flag", None) or flag_name(f.name)
        if "type" in meta:
            meta["type"] = flag_type(meta["type"])
        if f.name == "method_options":
            meta["action"] = MethodOption
        elif isinstance(f.default, bool) and "action" not in meta:
            meta["action"] = "store_false" if f.default else "store_true"
        if f.default is MISSING:  # the recipe's: None until resolved
            text += f" ({by_recipe(f.name)})"
        elif f.default is not None and not isinstance(f.default, bool) and text != argparse.SUPPRESS:
            text += " (default: %(default)s)"
        group.add_argument(flag, dest=f.name, default=None if f.default is MISSING else f.default, help=text, **meta)
        if f.name == "method_options":
            add_option_flags(group)
    return groups


def add_option_flags(group) -> None:
    """--gamma, --tau, ...: each built-in method option's flag, from its record (methods.Option)."""
    declared = {name: o for m in METHODS.values() if m.module is None for name, o in m.declared.items()}
    for name, o in declared.items():
        group.add_argument(flag_name(name), dest="method_options", action=MethodOption, name=name,
                           type=flag_type(o.check) if o.check else None, choices=o.choices or None,
                           metavar=name.upper() if not o.choices else None,
                           help=f"{read_by(name)}: {o.help}, i.e. --method-option {name}=... (default: {o.default})")


def flags_parser(**kwargs) -> argparse.ArgumentParser:
    """A parser of the settings' flags alone (the sweep's view of a cell's train.py flags)."""
    parser = argparse.ArgumentParser(**kwargs)
    add_flags(parser)
    return parser
