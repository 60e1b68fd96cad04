"""The study: the sweep grid, paired comparisons and the results kept in the repository."""
