"""The pieces of bench/gpu_acceptance.py: the stages (stages.py), running one under its own
limit (runner.py), the preflight (preflight.py) and the carried pytest (kernel_tests.py)."""
