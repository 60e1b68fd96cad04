"""python sweep.py ... is minimoe-sweep ...: the code is minimoe/cli/sweep.py (python sweep.py --help)."""
from minimoe.cli.sweep import command

if __name__ == "__main__":
    command()
