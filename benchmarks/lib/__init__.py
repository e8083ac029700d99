"""The benchmark scripts' shared code, under thin scripts in benchmarks/.

    workloads  what runs: the benchmark workloads and models, attention batch shapes
    peers      how each system runs once: batchjob, its vLLM backend, vLLM, HF (RunResult)
    matrix     the systems x workloads x repeats of one model: in which order and processes
    timing     child processes timed and reaped, repeats, cProfile time splits
    reports    the comparison table (rows, markdown) and its plot

A script imports it as ``lib`` (``python benchmarks/x.py`` puts benchmarks/ first on
sys.path); tests import the scripts the same way (benchmarks/ on sys.path).
"""
