"""HF transformers peer: static padded batches through ``model.generate`` (no prefix sharing).

Runs in the project venv, on small workloads only (it pads every batch to its longest prompt
and decodes every row to the batch's longest ``max_tokens``):

    .venv/bin/python benchmarks/peers/hf_peer.py --model DIR --input W.parquet \\
        --output-json out.json [--batch-size 8] [--sort-prompts] [--threads 2]

Same input and JSON shape as benchmarks/peers/vllm_peer.py: a ``prompt`` column (list<int>), a
``max_tokens`` column, optional ``row_id``. Greedy, fp32 by default, left padding. EOS is
suppressed the way vLLM's ``min_tokens = max_tokens`` suppresses it (``min_new_tokens`` masks
the EOS ids of the generation config), so both peers decode exactly ``max_tokens`` tokens per
row and their ids can be compared token by token. Each row's output is cut to its own
``max_tokens``; ``generated_tokens`` counts only those, ``padded_generated_tokens`` all work.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

# one workload loader for both peers (vllm_peer imports only the stdlib at import time);
# the script's own folder is on sys.path when run as a script
from vllm_peer import load_workload, write_json


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids, mask: [B, max_len], prompts right-aligned (left padding) for batched decoding."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[b, width - len(s) :] = 1
    return ids, mask


def generate_batch(model: Any, seqs: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy ``new_tokens`` tokens for every sequence of one padded batch."""
    gen_cfg = model.generation_config
    pad_id = gen_cfg.pad_token_id
    if pad_id is None:  # any id works: padded positions are masked out
        eos = gen_cfg.eos_token_id
        pad_id = (eos[0] if isinstance(eos, list) else eos) or 0
    ids, mask = left_pad(seqs, pad_id)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # masks EOS, as vLLM's min_tokens does
            do_sample=False,
            pad_token_id=pad_id,
        )
    # out: [B, width + new_tokens]
    return out[:, ids.shape[1] :].tolist()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local HF checkpoint folder")
    p.add_argument("--input", required=True, help="Parquet: prompt list<int>, max_tokens")
    p.add_argument("--output-json", required=True)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--sort-prompts", action="store_true", help="batch in lexicographic order")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import transformers
    from transformers import AutoModelForCausalLM

    if args.batch_size < 1:
        raise SystemExit("--batch-size must be >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    work = load_workload(args.input, args.sort_prompts)

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    model.eval()
    startup_s = time.perf_counter() - t0

    generated: list[list[int]] = [[] for _ in work.prompts]
    padded_gen = 0
    t0, cpu0, load_before = time.perf_counter(), time.process_time(), os.getloadavg()[0]
    for start in range(0, len(work.order), args.batch_size):
        batch = work.order[start : start + args.batch_size]
        new_tokens = max(work.max_tokens[i] for i in batch)
        outs = generate_batch(model, [work.prompts[i] for i in batch], new_tokens)
        padded_gen += new_tokens * len(batch)
        for i, ids in zip(batch, outs, strict=True):
            generated[i] = ids[: work.max_tokens[i]]
    generate_s = time.perf_counter() - t0
    generate_cpu_s, load_after = time.process_time() - cpu0, os.getloadavg()[0]

    n = len(work.prompts)
    prompt_tokens = sum(len(p) for p in work.prompts)
    gen_tokens = sum(len(g) for g in generated)
    return {
        "peer": "hf",
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "model": str(Path(args.model).resolve()),
        "input": str(Path(args.input).resolve()),
        "config": {
            **{k: v for k, v in vars(args).items() if k not in ("model", "input")},
            "torch_threads": torch.get_num_threads(),
        },
        # 1-minute load average around generate: other work on the machine skews timings
        "loadavg_1m": [load_before, load_after],
        "num_requests": n,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": gen_tokens,
        "padded_generated_tokens": padded_gen,
        "startup_s": startup_s,
        "generate_s": generate_s,
        "generate_cpu_s": generate_cpu_s,  # CPU seconds of all torch threads during generate
        "requests_per_s": n / generate_s,
        "prompt_tokens_per_s": prompt_tokens / generate_s,
        "generated_tokens_per_s": gen_tokens / generate_s,
        "total_tokens_per_s": (prompt_tokens + gen_tokens) / generate_s,
        "cached_prompt_tokens": 0,  # no prefix reuse: every prompt token is computed
        "saving_ratio": 0.0,
        "peak_rss_self_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rows": [
            {"row_id": work.row_ids[i], "num_cached_tokens": 0, "output_ids": generated[i]}
            for i in range(n)
        ],
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    write_json(result, Path(args.output_json))
    keys = ("num_requests", "prompt_tokens", "generated_tokens", "startup_s", "generate_s")
    keys += ("generate_cpu_s",)
    keys += ("requests_per_s", "total_tokens_per_s", "peak_rss_self_mib")
    print(json.dumps({k: result[k] for k in keys}), file=sys.stderr)


if __name__ == "__main__":
    main()
