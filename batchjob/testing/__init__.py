"""Test fixtures that ship with the package so that examples, benchmarks and users' own
tests can use them: tiny random-weight Llama-family checkpoints with a locally trained
tokenizer (``tiny_model``), and the BatchLLM paper's synthetic and natural workloads
(``workloads``). Nothing here is used by a job.
"""
