"""An in-memory model's answer-choice accuracy and routing diagnostics, and where evaluations are written."""
