"""batchjob: offline batch LLM inference for prefix-shared Parquet datasets."""

__version__ = "0.1.0"
