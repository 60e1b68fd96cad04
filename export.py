"""python export.py ... is minimoe-export ...: the code is minimoe/cli/export.py (python export.py --help)."""
from minimoe.cli.export import command

if __name__ == "__main__":
    command()
