"""``engine.backend = "vllm"``: batchjob's plan executed by vLLM's offline engine.

``backend.py`` (the ``Backend``), ``engine_args.py`` (job settings -> vLLM engine arguments),
``requests.py`` (requests in plan order, outputs as ``FinishedRequest``s) and
``scheduler.py`` (the BatchLLM scheduler class plugged in through ``scheduler_cls``).
Importing this package does not import vLLM; its modules do.
"""
