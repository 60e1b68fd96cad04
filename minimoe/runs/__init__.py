"""A run: its settings, the training loop, its folder, adapters, provenance and tracking."""
