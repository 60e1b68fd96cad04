"""The token mixers, one per layer kind: attention, MLA, Mamba-2, Gated DeltaNet, and the MIXERS table."""
