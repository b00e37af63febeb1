"""What ``data text(...)`` costs: MB/s of text into its cached token file, against calling
``tokenizers``' ``encode_batch`` directly on the same documents.

    python benchmarks/tokenize_speed.py                    # 32 MiB of the stdlib's .py files, vocab 8192
    python benchmarks/tokenize_speed.py --size 128MiB --vocab 32000 --repeat 5

The text is the standard library's ``.py`` files as ``corpus("stdlib")`` finds them, copied one
file per document into a temp folder up to ``--size``. A byte-level BPE tokenizer (GPT-2's
pre-tokenizer, ``<|endoftext|>`` added) is trained by this script on the first 4 MiB. Then, best of
``--repeat``, the two interleaved:

- direct: ``Tokenizer.encode_batch`` on the documents already read into memory, all at once (its
  own thread pool over the cores), ids discarded: tokenisation alone;
- ours: :func:`zdsl.runtime.data.text.text_tokens` into an empty cache folder: listing and hashing
  the files, reading them, encoding in batches, writing the uint16 token file.

Also shown: the second call, which finds the cache. Target: ours >= 0.9x direct.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from zdsl.lang.sizes import parse_size
from zdsl.runtime.data.corpus import stdlib_files


def copy_stdlib(folder: Path, limit: int) -> tuple[list[Path], int]:
    """The stdlib's text .py files, one document each, until ``limit`` bytes."""
    copied, total = [], 0
    for i, path in enumerate(stdlib_files()):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if b"\0" in data[:8192]:
            continue
        out = folder / f"{i:06d}_{path.name}"
        out.write_bytes(data)
        copied.append(out)
        total += len(data)
        if total >= limit:
            break
    return copied, total


def train_tokenizer(files: list[Path], vocab: int, out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    sample, size = [], 0
    for path in files:
        sample.append(path.read_text(encoding="utf-8", errors="replace"))
        size += len(sample[-1])
        if size >= 4 << 20:
            break
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(sample, trainer)
    tok.save(str(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="32MiB", help="text to tokenise")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    from tokenizers import Tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        docs = tmp / "docs"
        docs.mkdir()
        files, total = copy_stdlib(docs, parse_size(args.size))
        tokenizer = train_tokenizer(files, args.vocab, tmp / "tokenizer.json")
        os.environ["ZDSL_CACHE"] = str(tmp / "cache")
        from zdsl.runtime.data.text import text_tokens

        encoder = Tokenizer.from_file(str(tokenizer))
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
        direct, ours, hit, made = [], [], [], None
        for _ in range(args.repeat):
            start = time.perf_counter()
            count = sum(len(e.ids) + 1 for e in encoder.encode_batch(texts, add_special_tokens=False))
            direct.append(time.perf_counter() - start)
            shutil.rmtree(tmp / "cache", ignore_errors=True)
            start = time.perf_counter()
            made = text_tokens(str(docs), str(tokenizer))
            ours.append(time.perf_counter() - start)
            start = time.perf_counter()
            text_tokens(str(docs), str(tokenizer))
            hit.append(time.perf_counter() - start)
            assert made.tokens == count, (made.tokens, count)
        mb = total / 1e6
        print(f"text: {len(files)} stdlib .py files, {mb:.1f} MB -> {made.tokens:,} tokens "
              f"({made.dtype}, vocab {made.vocab}), {os.cpu_count()} cores")
        print(f"direct encode_batch : {mb / min(direct):7.2f} MB/s  (best of {args.repeat}: {min(direct):.2f} s)")
        print(f"text() cache miss   : {mb / min(ours):7.2f} MB/s  (best of {args.repeat}: {min(ours):.2f} s)")
        print(f"ratio ours/direct   : {min(direct) / min(ours):7.2f}  (target >= 0.9)")
        print(f"text() cache hit    : {min(hit) * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
