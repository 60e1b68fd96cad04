"""Scoring a model or a run on a split, and where evaluations are written."""
