"""jaxrl.data: SFT datasets (grain pipelines)."""
