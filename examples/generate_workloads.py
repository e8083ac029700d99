"""Write the paper's synthetic workloads as Parquet.

    python examples/generate_workloads.py case1 --out data/case1.parquet --scale 0.1 --len-scale 0.1
    python examples/generate_workloads.py micro-2000-200-s16 --out data/micro/ --num-files 4
    python examples/generate_workloads.py --list

See batchjob/testing/workloads.py for what each workload contains.
"""

from __future__ import annotations

from pathlib import Path

import click
import numpy as np

from batchjob.storage.atomic import write_parquet_atomic
from batchjob.testing.workloads import DEFAULT_VOCAB_LO, WORKLOADS, make_workload


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("name", required=False)
@click.option("--out", "out", type=click.Path(path_type=Path), help="A .parquet file or a dir.")
@click.option("--scale", default=1.0, show_default=True, help="Multiplies the request count.")
@click.option("--len-scale", default=1.0, show_default=True, help="Multiplies token lengths.")
@click.option("--seed", default=0, show_default=True)
@click.option("--form", type=click.Choice(["ids", "text"]), default="ids", show_default=True)
@click.option("--vocab-size", default=32000, show_default=True, help="ids form: ids < this.")
@click.option("--vocab-lo", default=DEFAULT_VOCAB_LO, show_default=True, help="ids >= this.")
@click.option("--max-tokens", type=int, default=None, help="Constant max_tokens per row.")
@click.option("--num-files", default=1, show_default=True, help="Split rows over N files.")
@click.option("--list", "list_", is_flag=True, help="List the workload names and exit.")
def main(
    name: str | None,
    out: Path | None,
    scale: float,
    len_scale: float,
    seed: int,
    form: str,
    vocab_size: int,
    vocab_lo: int,
    max_tokens: int | None,
    num_files: int,
    list_: bool,
) -> None:
    """Generate workload NAME (see --list) into --out."""
    if list_:
        click.echo("\n".join(WORKLOADS))
        return
    if name is None or out is None:
        raise click.UsageError("NAME and --out are required (or --list)")
    try:
        table = make_workload(
            name,
            scale,
            len_scale,
            seed,
            form,
            vocab_size,
            vocab_lo=vocab_lo,
            max_tokens=max_tokens,
        )
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    if num_files <= 1 and out.suffix == ".parquet":
        write_parquet_atomic(table, out)
        paths = [out]
    else:  # a directory of part files, in row order
        bounds = np.linspace(0, table.num_rows, max(1, num_files) + 1).astype(int)
        paths = [out / f"part-{i:05d}.parquet" for i in range(len(bounds) - 1)]
        for p, a, b in zip(paths, bounds[:-1], bounds[1:], strict=True):
            write_parquet_atomic(table.slice(a, b - a), p)
    lengths = table["prompt"].combine_chunks()
    n_tok = (
        int(np.diff(lengths.offsets.to_numpy()).sum())
        if form == "ids"
        else sum(len(s.split()) for s in lengths.to_pylist())
    )
    click.echo(
        f"{name}: {table.num_rows} rows, {n_tok} prompt {'tokens' if form == 'ids' else 'words'}"
        f" -> {', '.join(map(str, paths[:3]))}{' ...' if len(paths) > 3 else ''}"
    )


if __name__ == "__main__":
    main()
