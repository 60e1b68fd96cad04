"""The model's building blocks: norms, rope, masks, the MLP and the expert banks, and the CPU's memory measures."""
