"""The model every family shares (config, MoE block, causal LM), generation, and the family records."""
from minimoe.core.decoder import families_2026  # noqa: F401  (registers the transformers-5 families on any import)
