"""Where a job's bytes live and how they get there safely.

- ``stores``: local paths and object-store URIs (``s3://``, ``gs://``) behind one small store
  interface (``store_for(path)``), plus the filesystems pyarrow reads through.
- ``settings``: the ``[storage]`` section (endpoint, region, credentials from the environment).
- ``atomic``: writes that readers see whole or not at all (temp file + rename; one PUT).
- ``lock``: one run per output (fcntl locally, a conditional put on object stores).
- ``faults``: named kill points the fault-injection tests use (off unless set).

Imports nothing from the stages above it.
"""
