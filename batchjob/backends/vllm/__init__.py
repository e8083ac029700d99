"""``engine.backend = "vllm"``: batchjob's plan executed by vLLM's offline engine.

``backend.py`` (the ``Backend``), ``engine_args.py`` (job settings -> vLLM engine arguments),
``requests.py`` (requests in plan order, outputs as ``FinishedRequest``s) and
``scheduler.py`` (the BatchLLM scheduler class plugged in through ``scheduler_cls``).
Importing this package does not import vLLM; its modules do.
"""

import os

# vLLM logs to stdout at INFO by default: keep stdout for batchjob (`run --json`), warnings
# and errors on stderr. The user's own settings win; read when vLLM is first imported.
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
