"""From prompt batches to token ids: the boundary between reading and planning.

- ``tokenizer``: the model's ``tokenizer.json``, loaded once per job; encode and decode.
- ``batched.load_prompts``: reads the input, tokenizes in batches, applies the per-row
  settings and rejects rows that cannot run (too long, empty, bad token ids).
- ``prompts.TokenizedPrompts``: the result, flat token arrays plus per-row settings; what
  the planner and every backend take.
"""
