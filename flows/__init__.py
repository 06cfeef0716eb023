"""Dask graphs of grpoflow: one iteration, the loop, cluster set-up and the CLI."""
