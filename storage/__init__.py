"""The only place that does IO: the Zarr rollout store, policy versions and MLflow lineage."""
