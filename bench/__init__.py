"""atedevd benchmarks: `python -m bench` (what `make bench` runs)."""
