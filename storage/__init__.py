"""The IO of a run: the Zarr stores, policy versions, HF model folders, prompt files, the run folder
and MLflow lineage."""
