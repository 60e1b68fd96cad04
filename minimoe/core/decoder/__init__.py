"""The model every family shares (config, MoE block, causal LM), generation, and the family records."""
from minimoe.core.decoder import families_2026, families_2026_hybrids  # noqa: F401  (register the transformers-5 families)
from minimoe.core.decoder import families_2026_deepseek_v4  # noqa: F401
