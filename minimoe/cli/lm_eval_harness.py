"""The command `minimoe-lm-eval` (= `python -m minimoe.integrations.lm_eval`): lm-evaluation-harness's own CLI,
argv as given, in a process where the model "minimoe" is registered (minimoe/integrations/lm_eval.py says why
lm-eval needs that, and what the model takes)."""
from __future__ import annotations

import sys


def main() -> None:
    """lm-eval's own CLI (`lm_eval ...`, argv as given) in a process where "minimoe" is registered."""
    from lm_eval.__main__ import cli_evaluate
    from lm_eval.api.registry import MODEL_REGISTRY
    if "minimoe" not in MODEL_REGISTRY:  # registered already where python -m ran minimoe/integrations/lm_eval.py as __main__
        import minimoe.integrations.lm_eval  # noqa: F401  registers "minimoe"
    cli_evaluate()


def command() -> None:
    """minimoe-lm-eval: main, or one line saying what to install."""
    try:
        import lm_eval  # noqa: F401
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "lm_eval":
            raise
        sys.exit('minimoe-lm-eval: lm-evaluation-harness is not installed; pip install -e ".[lmeval]"')
    main()


if __name__ == "__main__":
    command()
