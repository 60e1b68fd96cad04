"""The model every family shares (config, MoE block, causal LM), generation, and the family records."""
