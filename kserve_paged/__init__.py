"""KServe predictor for the kserve-paged engine."""
