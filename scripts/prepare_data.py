"""Tokenize a text corpus into a weft token store, ahead of training.

    python scripts/prepare_data.py --source 'corpus/**/*.jsonl' --out /fast/tokens/web \
        [--tokenizer_path original/tokenizer.model] [--num_proc 64]

then train with `--training.dataset_path /fast/tokens/web`. The store is the same as the
one a training run builds under `<dump_folder>/.cache/data` (flat part files + sidecars,
docs/data.md), but placed where you choose, built with every core of the machine, and
shared by any number of runs. An interrupted build continues where it stopped when run
again with the same arguments; a second concurrent invocation waits for the first.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer.config import ConfigError  # noqa: E402
from trainer.data.documents import STDLIB, is_pretokenized, resolve_files  # noqa: E402
from trainer.data.ingest import default_num_proc, write_store  # noqa: E402
from trainer.data.lock import build_once  # noqa: E402
from trainer.tokenizer import build_tokenizer  # noqa: E402


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", required=True, help="file, folder or glob of .txt/.jsonl/.json/.parquet, or 'stdlib'")
    parser.add_argument("--out", required=True, help="folder to create for the token store")
    parser.add_argument("--tokenizer_path", default="", help="tiktoken BPE file; empty = bundled cl100k_base")
    parser.add_argument("--num_proc", type=int, default=default_num_proc(), help="tokenizing processes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        tokenizer = build_tokenizer(args.tokenizer_path)
        files = resolve_files(args.source, "--source")
        if is_pretokenized(files):
            raise ConfigError(f"--source '{args.source}' already holds token files; train on it directly.")
        out = os.path.abspath(args.out)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        if os.path.exists(out):
            raise ConfigError(f"--out '{out}' exists; pick a new folder (a finished store is never rewritten).")
        build_once(out, lambda: write_store(out, files, tokenizer, lenient=args.source == STDLIB,
                                            num_proc=args.num_proc, name=args.source),
                   what=f"tokenizing {args.source}")
    except ConfigError as e:
        print(f"prepare_data: {e}", file=sys.stderr)
        return 2
    print(f"token store ready: {out} (train with --training.dataset_path {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
