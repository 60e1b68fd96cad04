"""The routing methods: the policies, the Method records, the baselines and the supervision objectives."""
