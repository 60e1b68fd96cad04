"""python train.py ... is minimoe-train ...: the code is minimoe/cli/train.py (python train.py --help)."""
from minimoe.cli.train import command

if __name__ == "__main__":
    command()
