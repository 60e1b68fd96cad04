"""python evaluate.py ... is minimoe-eval ...: the code is minimoe/cli/evaluate.py (python evaluate.py --help)."""
from minimoe.cli.evaluate import command

if __name__ == "__main__":
    command()
