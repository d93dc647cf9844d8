"""Benchmarks: one script per subject, each prints a table and writes JSON to bench/results/."""
