"""The benchmark lab: scripts run as `python -m benchmarks.<name>` from the repository root.

Not the product's `helexa bench` (apps/bench), and not installed with the wheel. Every script prints
JSON and withholds a speed whose output failed its correctness check; benchmarks/README.md lists them.
"""
