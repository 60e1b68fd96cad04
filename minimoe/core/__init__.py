"""The model and the methods: what a training step computes. Imports nothing of minimoe outside core/."""
