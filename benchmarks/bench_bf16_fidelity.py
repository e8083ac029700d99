"""How faithful each system's bfloat16 greedy output is to the float32 model: batchjob's native
engine, vLLM and HF transformers, on real checkpoints' shapes (random weights).

    .venv/bin/python benchmarks/bench_bf16_fidelity.py        # both shapes, 24 rows: ~7 min
    .venv/bin/python benchmarks/bench_bf16_fidelity.py --docs 8 --questions 8   # 64: ~19 min
    .venv/bin/python benchmarks/bench_bf16_fidelity.py --model-shapes smollm2-135m --docs 1 \\
        --questions 2 --prefix-len 64 --max-tokens 8           # the code path, ~1.5 min

The question: batchjob's bf16 outputs differ from vLLM's bf16 outputs token for token; is that
bf16 rounding that every bf16 implementation shows (vLLM and HF bf16 as far from float32,
and from each other), or does batchjob's bf16 path lose more precision? Every system decodes
the same token-id prompts greedily (temperature 0, EOS ignored, ``--max-tokens`` each):
``--docs`` documents of ~``--prefix-len`` tokens, each followed by ``--questions`` questions of
~``--question-len`` tokens (rows sharing a document share its prefix: batchjob's prefix-shared
attention and vLLM's prefix cache both run), seeded. Systems (``--systems``):

- ``batchjob-bf16`` / ``batchjob-fp32``: ``batchjob.generate`` (native engine, batchllm plan,
  the CPU's default attention and linear paths), model.dtype bfloat16 / float32 (the float32
  row is the sanity row: it should sit at ~100%);
- ``vllm-bf16``: vLLM's ``LLM.generate`` (dtype bfloat16, prefix caching), in a child process
  of this script (VLLM_CPU_OMP_THREADS_BIND=0-1);
- ``vllm-bf16-eager`` (named in ``--systems`` only): the same with ``enforce_eager=True``, no
  torch.compile. vllm-bf16's inductor graph on the CPU sums the residual stream in float32 (it
  recomputes embedding + every sublayer's output inside each fused add + RMSNorm kernel and
  never reads the bf16-rounded residual the model code asks for); eager vLLM rounds it to bf16
  at every add, as HF and batchjob do;
- ``hf-bf16``: HF transformers (``torch_dtype=torch.bfloat16``, sdpa), one prompt at a time (no
  padding): the whole prompt in one forward, then one token per step on its KV cache.

The reference is HF transformers float32 on the same folder (``hf-fp32``). Each system's
sequence (prompt + its generated tokens) is run teacher-forced through the float32 model (the
document's KV cache computed once, then the question, then every system's continuation in one
batch), which gives at each generated position the float32 argmax, the float32 log-prob of
the system's token and the float32 gap between the best two tokens. The float32 greedy output
itself is the longest prefix of some system's output that float32 agrees with, continued one
greedy step at a time where no system's output goes on (with batchjob-fp32 in the run it is
usually batchjob-fp32's whole output, verified).

How to read a shape's table (the CPU is named above it):

- ``rows = fp32``: share of rows whose whole output equals the float32 greedy output;
  ``tokens = fp32 argmax``: share of generated tokens that are the float32 argmax given the
  system's own preceding tokens (after a row diverges it keeps being scored on its own path);
  ``first diff``: over the rows that differ from float32 greedy, the mean index of the first
  generated token that differs (``-``: no row differs);
- ``regret``: float32 log-prob of the float32 argmax minus that of the system's token, nats,
  over every generated token (0 where they agree): how much worse the token it picked is, in
  the float32 model's eyes; mean, p99, max;
- ``|logprob err|``: the system's own log-prob of its token against float32's log-prob of the
  same token at the same position (mean, p99): the numeric error at the logits, independent of
  whether the argmax flipped. A bf16 path losing more precision than the others shows here first;
- ``run s``: wall seconds of the system's generate (batchjob: ``generate()`` with its model
  load and plan; vLLM: ``LLM.generate`` after start-up; HF: the greedy loop after the load):
  a guide to the script's run time, not a throughput comparison (bench_peers.py is that);
- the second table: share of rows whose whole output two systems share (the symmetric matrix);
- the line under it: float32's gap between its best two tokens on the float32 greedy path
  (random weights over a 49k-152k vocabulary give nearly flat distributions: the smaller the
  gaps against the bf16 log-prob error, the more argmax flips any bf16 implementation makes).

Per-row data (every system's tokens, and per generated token: argmax agreement, regret,
log-probs, float32 gap) goes to ``--out`` (default out/bench_bf16_fidelity): ``rows.parquet``
and ``summary.json``; each system's raw outputs to ``<shape>/<system>.json`` (``--reuse``
takes them back instead of rerunning a system with the same prompts and settings).
"""

from __future__ import annotations

import copy
import gc
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent

from lib.timing import run_child  # noqa: E402

from batchjob.model.host_cpu import cpu_summary  # noqa: E402
from batchjob.testing.model_shapes import SHAPES, make_shaped_model  # noqa: E402

PY = sys.executable
SYSTEMS = ("batchjob-bf16", "vllm-bf16", "hf-bf16", "batchjob-fp32")
MORE_SYSTEMS = ("vllm-bf16-eager",)  # by name in --systems only
REF = "hf-fp32"


@dataclass(frozen=True)
class Row:
    row_id: int
    doc: int
    question: int
    doc_ids: list[int]
    question_ids: list[int]

    @property
    def prompt(self) -> list[int]:
        return self.doc_ids + self.question_ids


@dataclass
class Output:
    """One system's greedy tokens per row, with its own log-prob of each (nan: not known)."""

    ids: dict[int, list[int]]
    logprobs: dict[int, list[float]]
    seconds: float


@dataclass
class Scored:
    """A system's tokens scored by the float32 model, per row and generated position."""

    argmax_eq: dict[int, np.ndarray] = field(default_factory=dict)  # bool
    regret: dict[int, np.ndarray] = field(default_factory=dict)  # nats
    fp32_logprob: dict[int, np.ndarray] = field(default_factory=dict)  # of the system's token
    fp32_gap: dict[int, np.ndarray] = field(default_factory=dict)  # best two, nats


def make_rows(
    vocab: int, docs: int, questions: int, prefix_len: int, question_len: int, seed: int
) -> list[Row]:
    """``docs`` documents of prefix_len +-10% random ids, each with ``questions`` questions of
    question_len +-25%, doc-major; ids in [5, vocab) (the specials below stay out)."""
    rng = np.random.default_rng(seed)
    rows: list[Row] = []
    for d in range(docs):
        n = int(rng.integers(int(prefix_len * 0.9), int(prefix_len * 1.1) + 1))
        doc = rng.integers(5, vocab, n).tolist()
        for q in range(questions):
            m = int(rng.integers(max(1, int(question_len * 0.75)), int(question_len * 1.25) + 1))
            rows.append(Row(len(rows), d, q, doc, rng.integers(5, vocab, m).tolist()))
    return rows


def prompts_table(rows: list[Row], max_tokens: int) -> pa.Table:
    return pa.table(
        {
            "row_id": pa.array([r.row_id for r in rows], pa.int64()),
            "prompt": pa.array([r.prompt for r in rows], pa.list_(pa.int32())),
            "max_tokens": pa.array([max_tokens] * len(rows), pa.int32()),
        }
    )


# --- the systems ----------------------------------------------------------------------------


def run_batchjob(model: Path, rows: list[Row], max_tokens: int, dtype: str, threads: int) -> Output:
    import batchjob

    t0 = time.perf_counter()
    res = batchjob.generate(
        prompts_table(rows, max_tokens).drop_columns(["max_tokens"]),
        model={"path": str(model), "dtype": dtype, "device": "cpu"},
        sampling={"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "logprobs": 0},
        engine={"threads": threads},
    )
    secs = time.perf_counter() - t0
    ids, lps = {}, {}
    for r in res.select(["row_id", "output_token_ids", "output_logprobs"]).to_pylist():
        ids[r["row_id"]] = r["output_token_ids"]
        lps[r["row_id"]] = [x["logprob"] for x in r["output_logprobs"]]
    return Output(ids, lps, secs)


def run_hf(model: Path, rows: list[Row], max_tokens: int, threads: int) -> Output:
    """HF bf16, a prompt at a time: prompt in one forward, then a token a step (KV cache)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    t0 = time.perf_counter()
    ids, lps = {}, {}
    with torch.inference_mode():
        for r in rows:
            out = m(input_ids=torch.tensor([r.prompt]), use_cache=True, logits_to_keep=1)
            toks, lp = [], []
            for step in range(max_tokens):
                logits = out.logits[0, -1].float()  # as generate(): bf16 logits widened
                tok = int(logits.argmax())
                toks.append(tok)
                lp.append(float(logits[tok] - torch.logsumexp(logits, -1)))
                if step + 1 < max_tokens:
                    out = m(
                        input_ids=torch.tensor([[tok]]),
                        past_key_values=out.past_key_values,
                        use_cache=True,
                    )
            ids[r.row_id], lps[r.row_id] = toks, lp
    secs = time.perf_counter() - t0
    del m
    gc.collect()
    return Output(ids, lps, secs)


def run_vllm(model: Path, rows: list[Row], max_tokens: int, work: Path, eager: bool) -> Output:
    """vLLM bf16 in a child process (this script, --vllm-child); ``eager``: enforce_eager
    (no torch.compile)."""
    work.mkdir(parents=True, exist_ok=True)
    tag = "vllm-eager" if eager else "vllm"
    data, result = work / "prompts.parquet", work / f"{tag}.json"
    pq.write_table(prompts_table(rows, max_tokens), data)
    spec = {"model": str(model), "input": str(data), "output": str(result), "eager": eager}
    (work / f"{tag}_spec.json").write_text(json.dumps(spec))
    result.unlink(missing_ok=True)
    run_child([PY, __file__, "--vllm-child", str(work / f"{tag}_spec.json")], work / f"{tag}.log")
    j = json.loads(result.read_text())
    ids = {int(k): v for k, v in j["ids"].items()}
    lps = {int(k): v for k, v in j["logprobs"].items()}
    return Output(ids, lps, j["generate_s"])


def run_vllm_child(spec_path: str) -> None:
    """The child: vLLM's offline LLM on the prompts, bf16, greedy, EOS ignored, log-probs of
    the sampled tokens; engine set up as benchmarks/peers/vllm_peer.py does on this CPU."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    t = pq.read_table(spec["input"])
    prompts = [list(map(int, p)) for p in t["prompt"].to_pylist()]
    row_ids = t["row_id"].to_pylist()
    max_tokens = int(t["max_tokens"][0].as_py())
    llm = LLM(
        model=spec["model"],
        dtype="bfloat16",
        block_size=32,
        enable_prefix_caching=True,
        skip_tokenizer_init=True,
        seed=0,
        enforce_eager=bool(spec.get("eager", False)),
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, detokenize=False
    )
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    secs = time.perf_counter() - t0
    ids, lps = {}, {}
    for rid, o in zip(row_ids, outs, strict=True):
        c = o.outputs[0]
        ids[rid] = list(c.token_ids)
        per_token: Any = c.logprobs  # one {token id: Logprob} per generated token (logprobs=0)
        lps[rid] = [float(d[tok].logprob) for tok, d in zip(c.token_ids, per_token, strict=True)]
    Path(spec["output"]).write_text(json.dumps({"ids": ids, "logprobs": lps, "generate_s": secs}))
    llm.llm_engine.engine_core.shutdown()


# --- the float32 reference --------------------------------------------------------------------


def score_fp32(
    model: Path, rows: list[Row], outputs: dict[str, Output], max_tokens: int, threads: int
) -> tuple[dict[str, Scored], dict[int, list[int]], dict[int, np.ndarray]]:
    """Every system's sequences teacher-forced through HF float32 (a document's KV cache once,
    then each row's question, then all systems' continuations of the row in one batch); the
    float32 greedy output per row; float32's top-two gap along it."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    names = list(outputs)
    scored = {n: Scored() for n in names}
    greedy: dict[int, list[int]] = {}
    greedy_gap: dict[int, np.ndarray] = {}

    def top2(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[..., V] -> (argmax, log-softmax, gap between the best two)."""
        lp = torch.log_softmax(logits.double(), -1)
        best = lp.topk(2, -1)
        return best.indices[..., 0], lp, best.values[..., 0] - best.values[..., 1]

    with torch.inference_mode():
        doc_cache: tuple[int, Any] | None = None
        for r in rows:
            if doc_cache is None or doc_cache[0] != r.doc:
                out = m(input_ids=torch.tensor([r.doc_ids]), use_cache=True, logits_to_keep=1)
                doc_cache = (r.doc, out.past_key_values)
            cache = copy.deepcopy(doc_cache[1])
            out = m(
                input_ids=torch.tensor([r.question_ids]),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            first = out.logits[0, -1]  # predicts generated token 0
            prompt_cache = out.past_key_values
            seqs = torch.tensor([outputs[n].ids[r.row_id] for n in names])  # [S, T]
            batch_cache = copy.deepcopy(prompt_cache)
            batch_cache.batch_repeat_interleave(len(names))
            rest = m(input_ids=seqs[:, :-1], past_key_values=batch_cache, use_cache=True).logits
            logits = torch.cat([first.expand(len(names), 1, -1), rest], dim=1)  # [S, T, V]
            amax, lp, gap = top2(logits)
            chosen = lp.gather(-1, seqs[..., None])[..., 0]
            best = lp.gather(-1, amax[..., None])[..., 0]
            accepted = []
            for i, n in enumerate(names):
                eq = (amax[i] == seqs[i]).numpy()
                s = scored[n]
                s.argmax_eq[r.row_id] = eq
                s.regret[r.row_id] = (best[i] - chosen[i]).numpy()
                s.fp32_logprob[r.row_id] = chosen[i].numpy()
                s.fp32_gap[r.row_id] = gap[i].numpy()
                accepted.append(int(eq.argmin()) if not eq.all() else max_tokens)
            # float32 greedy: the longest verified prefix, then the argmax there, then steps
            i = int(np.argmax(accepted))
            k = accepted[i]
            g = seqs[i, :k].tolist()
            gaps = gap[i, :k].tolist()
            if k < max_tokens:
                g.append(int(amax[i, k]))
                gaps.append(float(gap[i, k]))
                cache = copy.deepcopy(prompt_cache)
                step_in = torch.tensor([g])
                while len(g) < max_tokens:
                    out = m(input_ids=step_in, past_key_values=cache, use_cache=True)
                    a, _, gp = top2(out.logits[0, -1])
                    g.append(int(a))
                    gaps.append(float(gp))
                    cache, step_in = out.past_key_values, torch.tensor([[int(a)]])
            greedy[r.row_id] = g
            greedy_gap[r.row_id] = np.asarray(gaps)
    del m
    gc.collect()
    return scored, greedy, greedy_gap


# --- the report -------------------------------------------------------------------------------


def first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def summarize(
    outputs: dict[str, Output], scored: dict[str, Scored], greedy: dict[int, list[int]]
) -> dict[str, dict[str, float]]:
    res = {}
    for n, o in outputs.items():
        s = scored[n]
        rids = sorted(o.ids)
        eq = np.concatenate([s.argmax_eq[r] for r in rids])
        reg = np.concatenate([s.regret[r] for r in rids])
        err = np.abs(
            np.concatenate([np.asarray(o.logprobs[r], float) - s.fp32_logprob[r] for r in rids])
        )
        # where the rows that differ from float32 greedy first differ
        diffs = [first_diff(o.ids[r], greedy[r]) for r in rids if o.ids[r] != greedy[r]]
        res[n] = {
            "rows_eq_fp32": float(np.mean([o.ids[r] == greedy[r] for r in rids])),
            "tokens_eq_fp32_argmax": float(eq.mean()),
            "first_diff_mean": float(np.mean(diffs)) if diffs else float("nan"),
            "regret_mean": float(reg.mean()),
            "regret_p99": float(np.percentile(reg, 99)),
            "regret_max": float(reg.max()),
            "logprob_err_mean": float(np.nanmean(err)),
            "logprob_err_p99": float(np.nanpercentile(err, 99)),
            "seconds": o.seconds,
        }
    return res


def report(
    shape: str,
    outputs: dict[str, Output],
    summary: dict[str, dict[str, float]],
    greedy: dict[int, list[int]],
    greedy_gap: dict[int, np.ndarray],
    setting: str,
) -> str:
    lines = [
        f"## {shape}: {setting}",
        "",
        "| system | rows = fp32 | tokens = fp32 argmax | first diff | regret mean "
        "| regret p99 | regret max | \\|logprob err\\| mean | \\|logprob err\\| p99 | run s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, s in summary.items():
        fd = "-" if np.isnan(s["first_diff_mean"]) else f"{s['first_diff_mean']:.1f}"
        lines.append(
            f"| {n} | {s['rows_eq_fp32']:.1%} | {s['tokens_eq_fp32_argmax']:.1%} | {fd} "
            f"| {s['regret_mean']:.4f} | {s['regret_p99']:.4f} | {s['regret_max']:.4f} "
            f"| {s['logprob_err_mean']:.4f} | {s['logprob_err_p99']:.4f} | {s['seconds']:.0f} |"
        )
    names = [*outputs, REF]
    ids = {n: o.ids for n, o in outputs.items()} | {REF: greedy}
    lines += ["", "| rows equal | " + " | ".join(names) + " |", "|---" + "|---:" * len(names) + "|"]
    for a in names:
        cells = [
            f"{np.mean([ids[a][r] == ids[b][r] for r in greedy]):.0%}" if a != b else "-"
            for b in names
        ]
        lines.append(f"| {a} | " + " | ".join(cells) + " |")
    gaps = np.concatenate(list(greedy_gap.values()))
    lines += [
        "",
        f"float32 gap between its best two tokens on the fp32 greedy path: median "
        f"{np.median(gaps):.4f} nats; < 0.01: {np.mean(gaps < 0.01):.1%}, < 0.03: "
        f"{np.mean(gaps < 0.03):.1%}, < 0.1: {np.mean(gaps < 0.1):.1%}",
        "",
    ]
    return "\n".join(lines)


def output_key(model: Path, rows: list[Row], max_tokens: int, system: str) -> str:
    """What a system's saved outputs were made from (--reuse takes them back on a match)."""
    text = json.dumps([str(model), system, max_tokens, [r.prompt for r in rows]])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@click.command()
@click.option("--model-shapes", default="smollm2-135m,qwen2.5-0.5b", show_default=True)
@click.option("--systems", default=",".join(SYSTEMS), show_default=True)
@click.option("--docs", default=4, show_default=True)
@click.option("--questions", default=6, show_default=True, help="Rows per document.")
@click.option("--prefix-len", default=400, show_default=True, help="Document tokens (+-10%).")
@click.option("--question-len", default=20, show_default=True, help="Question tokens (+-25%).")
@click.option("--max-tokens", default=24, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--reuse", is_flag=True, help="Reuse a system's saved outputs (same prompts).")
@click.option(
    "--out", type=click.Path(path_type=Path), default=ROOT / "out" / "bench_bf16_fidelity"
)
@click.option("--vllm-child", hidden=True, default=None)
def main(
    model_shapes, systems, docs, questions, prefix_len, question_len, max_tokens, seed,
    threads, reuse, out, vllm_child: str | None,
) -> None:  # fmt: skip
    if vllm_child is not None:
        run_vllm_child(vllm_child)
        return
    out = out.resolve()
    systems = [s for s in systems.split(",") if s]
    unknown = set(systems) - {*SYSTEMS, *MORE_SYSTEMS}
    if unknown:
        known = ", ".join((*SYSTEMS, *MORE_SYSTEMS))
        raise click.BadParameter(f"unknown {sorted(unknown)}; systems: {known}")
    setting = (
        f"{docs} docs of ~{prefix_len} tokens x {questions} questions of ~{question_len} "
        f"tokens, {max_tokens} tokens greedy, EOS ignored"
    )
    print(f"# bf16 fidelity; {cpu_summary()}; threads {threads}", flush=True)
    all_rows, all_summary = [], {}
    for shape in model_shapes.split(","):
        model = make_shaped_model(ROOT / "models" / shape, shape)
        vocab = SHAPES[shape].vocab
        rows = make_rows(vocab, docs, questions, prefix_len, question_len, seed)
        work = out / shape
        work.mkdir(parents=True, exist_ok=True)
        outputs: dict[str, Output] = {}
        for name in systems:
            saved = work / f"{name}.json"
            key = output_key(model, rows, max_tokens, name)
            if reuse and saved.exists() and json.loads(saved.read_text())["key"] == key:
                j = json.loads(saved.read_text())
                o = Output(
                    {int(k): v for k, v in j["ids"].items()},
                    {int(k): v for k, v in j["logprobs"].items()},
                    j["seconds"],
                )
                print(f"  {shape} {name}: reused {saved}", flush=True)
            else:
                if name.startswith("batchjob-"):
                    dtype = "bfloat16" if name.endswith("bf16") else "float32"
                    o = run_batchjob(model, rows, max_tokens, dtype, threads)
                elif name == "hf-bf16":
                    o = run_hf(model, rows, max_tokens, threads)
                else:
                    o = run_vllm(model, rows, max_tokens, work, eager=name.endswith("-eager"))
                saved.write_text(
                    json.dumps(
                        {"key": key, "ids": o.ids, "logprobs": o.logprobs, "seconds": o.seconds}
                    )
                )
                print(f"  {shape} {name}: {o.seconds:.0f} s", flush=True)
            bad = [r.row_id for r in rows if len(o.ids[r.row_id]) != max_tokens]
            if bad:
                raise RuntimeError(f"{name}: rows {bad[:5]} did not generate {max_tokens} tokens")
            outputs[name] = o
        t0 = time.perf_counter()
        scored, greedy, greedy_gap = score_fp32(model, rows, outputs, max_tokens, threads)
        print(f"  {shape} float32 scoring: {time.perf_counter() - t0:.0f} s", flush=True)
        summary = summarize(outputs, scored, greedy)
        print(report(shape, outputs, summary, greedy, greedy_gap, setting), flush=True)
        all_summary[shape] = summary
        for r in rows:
            for n, o in outputs.items():
                s = scored[n]
                all_rows.append(
                    {
                        "shape": shape,
                        "system": n,
                        "row_id": r.row_id,
                        "doc": r.doc,
                        "question": r.question,
                        "prompt_tokens": len(r.prompt),
                        "output_ids": o.ids[r.row_id],
                        "equals_fp32_greedy": o.ids[r.row_id] == greedy[r.row_id],
                        "first_diff": first_diff(o.ids[r.row_id], greedy[r.row_id]),
                        "fp32_argmax_eq": s.argmax_eq[r.row_id].tolist(),
                        "regret": s.regret[r.row_id].tolist(),
                        "logprob": [float(x) for x in o.logprobs[r.row_id]],
                        "fp32_logprob": s.fp32_logprob[r.row_id].tolist(),
                        "fp32_gap": s.fp32_gap[r.row_id].tolist(),
                    }
                )
            all_rows.append(
                {
                    "shape": shape,
                    "system": REF,
                    "row_id": r.row_id,
                    "doc": r.doc,
                    "question": r.question,
                    "prompt_tokens": len(r.prompt),
                    "output_ids": greedy[r.row_id],
                    "equals_fp32_greedy": True,
                    "first_diff": max_tokens,
                    "fp32_gap": greedy_gap[r.row_id].tolist(),
                }
            )
    pq.write_table(pa.Table.from_pylist(all_rows), out / "rows.parquet")
    (out / "summary.json").write_text(
        json.dumps({"cpu": cpu_summary(), "setting": setting, "shapes": all_summary}, indent=1)
    )
    print(f"per-row data: {out / 'rows.parquet'}, {out / 'summary.json'}")


# vLLM's engine process re-imports this module (spawn): the run stays behind the guard
if __name__ == "__main__":
    main()
