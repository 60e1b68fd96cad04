"""The study: the sweep grid, paired comparisons, diagnostics and the kept results."""
