"""The paper's per-backbone presets over TrainConfig's defaults (`RECIPES`), and --help's words for them.

Recipe decisions (paper, Experimental Configuration table):
- Training examples are the recipe's, per backbone: the registered train split (2000 ARC, 5000
  others, shared by both backbones) is cut to `train_examples` (Granite 2000 / 4992, OLMoE 2000 /
  5000), so that steps per epoch are the paper's 125/312 (Granite, 16 per step) and 250/625
  (OLMoE, 8 per step). A count that does not divide keeps its partial last step: every example is
  seen once per epoch (`steps_per_epoch`, a ceiling).
- A recipe holds no family's facts: LoRA's targets are the model's family's (family_record.Family.lora_targets,
  the paper's Q/K/V for Granite and Q/K/V/O for OLMoE, plus the routed experts), so one recipe trains every
  family that names it (the hybrids' targets take in their recurrent layers) and --recipe changes the
  optimisation, never what is adapted (--lora-targets does).
"""
from __future__ import annotations

from minimoe.core.adaptation.lora import ALPHA, DROPOUT, RANK

# ---- the paper's presets

PAPER_LORA = dict(lora_rank=RANK, lora_alpha=ALPHA, lora_dropout=DROPOUT)  # on the family's own targets


# The paper's Experimental Configuration table, one preset per backbone over TrainConfig's defaults;
# "tiny" is `--model tiny`'s (smoke runs, tests). train_examples: {benchmark: count} with "default" for
# the others; None keeps the whole train split.
RECIPES = {
    "granite": dict(**PAPER_LORA, lr=1e-4, batch_size=8, grad_accum=2, schedule="cosine", warmup=0.05,
                    weight_decay=0.0, clip=1.0, epochs=3,
                    train_examples={"arc_challenge": 2000, "arc_easy": 2000, "default": 4992}),
    "olmoe": dict(**PAPER_LORA, lr=2e-5, batch_size=8, grad_accum=1, schedule="linear", warmup=0.03,
                  weight_decay=0.0, clip=1.0, epochs=3,
                  train_examples={"arc_challenge": 2000, "arc_easy": 2000, "default": 5000}),
    # Random tiny weights learn nothing at 2e-5: a larger step so the smoke run visibly trains.
    "tiny": dict(**PAPER_LORA, lr=2e-3, batch_size=8, grad_accum=1, schedule="linear", warmup=0.03,
                 weight_decay=0.0, clip=1.0, epochs=2, train_examples=None),
}
# The recipes whose "+ affinity tuning" rows the paper reports at the validation-selected epoch (OLMoE's
# affinity-tuned group); every other row at the last (TrainConfig.test_checkpoint's default).
SELECTED_WHEN_TUNED = ("olmoe",)



def show(value) -> str:
    """A value as --help shows argparse defaults (str), a list as the flag takes it (q,k,v)."""
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def by_recipe(key: str) -> str:
    """'default: 0.0001 granite, 2e-05 olmoe, 0.002 tiny' from RECIPES (one value when they agree)."""
    values = {name: show(recipe[key]) for name, recipe in RECIPES.items()}
    if len(set(values.values())) == 1:
        return f"default: {next(iter(values.values()))}"
    return "default: " + ", ".join(f"{value} {name}" for name, value in values.items())


def by_recipe_counts() -> str:
    """--max-train-examples' default from RECIPES: 'granite: 2000 arc_challenge, ..., 4992 other; ...; tiny: all'."""
    parts = []
    for name, recipe in RECIPES.items():
        counts = recipe["train_examples"] or {"default": "all"}
        named = [f"{count} {bench}" for bench, count in counts.items() if bench != "default"]
        parts.append(f"{name}: " + ", ".join([*named, f"{counts['default']}" + (" other" if named else "")]))
    return "; ".join(parts)
