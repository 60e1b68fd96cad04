"""A run: its settings, the training loop, its evaluation folders, its folder, adapters, provenance and tracking."""
