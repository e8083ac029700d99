"""Make a tiny random-weight Llama-family model folder (weights + tokenizer), offline.

python examples/make_tiny_model.py out/tiny-llama --family llama --layers 2 --hidden 64
"""

from __future__ import annotations

import click

from batchjob.testing.tiny_model import FAMILIES, make_tiny_model


@click.command()
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--family", type=click.Choice(FAMILIES), default="llama", show_default=True)
@click.option("--vocab-size", default=320, show_default=True, help="BPE vocabulary size.")
@click.option("--hidden", default=64, show_default=True)
@click.option("--layers", default=2, show_default=True)
@click.option("--heads", default=4, show_default=True)
@click.option("--kv-heads", default=2, show_default=True)
@click.option("--intermediate", type=int, default=None, help="MLP size (default 2*hidden).")
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--corpus",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Text file (one document per line) to train the tokenizer on.",
)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32")
@click.option("--tie-word-embeddings/--no-tie-word-embeddings", default=False)
@click.option("--max-shard-size", default=None, help='e.g. "50MB": write a sharded checkpoint.')
def main(out_dir, family, vocab_size, hidden, layers, heads, kv_heads, intermediate, seed, corpus,
         dtype, tie_word_embeddings, max_shard_size) -> None:  # fmt: skip
    lines = None
    if corpus:
        with open(corpus, encoding="utf-8") as f:
            lines = [line.strip() for line in f if line.strip()]
    path = make_tiny_model(
        out_dir,
        family=family,
        vocab_size=vocab_size,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        seed=seed,
        corpus=lines,
        dtype=dtype,
        tie_word_embeddings=tie_word_embeddings,
        max_shard_size=max_shard_size,
    )
    click.echo(f"wrote {family} model to {path}")


if __name__ == "__main__":
    main()
