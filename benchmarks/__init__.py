"""ekit's benchmark suite: the library timed against its baselines, side by side.

Run ``python -m benchmarks.run`` (see ``docs/performance.md``).
"""
