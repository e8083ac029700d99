"""The model to run, read once per job from its local Hugging Face folder.

- ``info.ModelInfo``: ``config.json`` and ``generation_config.json`` parsed (``hf_config``),
  the weights' files, the dtype for this host, the context length.
- ``host_cpu``: the CPU's model name and ISA flags, for the dtype choice and the benchmark
  tables.

Torch-free: backends load the weights themselves.
"""
