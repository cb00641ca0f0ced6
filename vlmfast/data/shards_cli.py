"""`vlmfast shards ...`: write WebDataset tar shards from a folder of images + captions or a JSONL.

Usage::

    vlmfast shards write images/ shards/ --max-count 1000 --max-size 1G
    vlmfast shards write data.jsonl shards/ --skip-missing --verify

    add_shards_command(subparsers)      # how vlmfast.cli.main registers it
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

SIZE_UNITS = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}


def parse_size(text: str) -> float:
    """'1G', '500M', '2.5e8' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?)B?\s*", text.upper())
    try:
        if match is None:
            raise ValueError
        return float(match.group(1)) * SIZE_UNITS[match.group(2)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--max-size {text!r}: expected bytes like 1G, 500M or 2e8") from None


def add_shards_command(subparsers: Any) -> argparse.ArgumentParser:
    """Register `shards` (with its `write` sub-command) on the `vlmfast` sub-parsers."""
    shards = subparsers.add_parser("shards", help="WebDataset tar shards for fast streaming training data")
    actions = shards.add_subparsers(dest="shards_command", required=True)
    write = actions.add_parser("write", help="pack images + captions (folder or JSONL) into tar shards")
    write.add_argument("src", help="folder of images with same-name .txt captions, or a .jsonl of "
                       '{"image": path, "text": caption} lines (paths relative to the file)')
    write.add_argument("out", help="output folder for the shards (must hold no .tar files unless --overwrite)")
    write.add_argument("--max-count", type=int, default=1000, help="samples per shard (default 1000)")
    write.add_argument("--max-size", type=parse_size, default=1e9, help="bytes per shard, e.g. 500M (default 1G)")
    write.add_argument("--pattern", default="shard-%06d.tar", help="shard file name pattern (default shard-%%06d.tar)")
    write.add_argument("--skip-missing", action="store_true", help="leave out images without caption (and JSONL "
                       "lines whose image is missing) instead of stopping")
    write.add_argument("--verify", action="store_true", help="decode every image first; skip undecodable ones")
    write.add_argument("--overwrite", action="store_true", help="write into a folder that already holds .tar files")
    write.add_argument("--no-progress", action="store_true", help="no progress bar")
    write.set_defaults(run=_cmd_write)
    return shards


def _cmd_write(args: argparse.Namespace) -> int:
    from vlmfast.data.shards import write_shards

    if args.max_count < 1:
        raise ValueError(f"--max-count must be >= 1, got {args.max_count}")
    report = write_shards(args.src, args.out, max_count=args.max_count, max_size=args.max_size, pattern=args.pattern,
                          skip_missing=args.skip_missing, verify=args.verify, overwrite=args.overwrite,
                          progress=not args.no_progress and sys.stderr.isatty())
    print(f"{report.summary()} in {args.out}")
    return 0
