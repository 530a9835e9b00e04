"""Benchmarks: each prints a table, writes JSON and a PNG plot under bench/out, and measures the
machine's own limit in the same run. Run from the repository root as `python -m bench.NAME`
(bench/gpu_check.py also as `PYTHONPATH=. python3 bench/gpu_check.py`, what a lent GPU runs)."""
