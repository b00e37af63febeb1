"""Train the byte-level BPE tokenizer programs/pretrain.zs and programs/finetune.zs use.

    python programs/make_tokenizer.py                  # writes programs/tokenizer.json
    python programs/make_tokenizer.py --vocab 8192 -o my_tokenizer.json

It learns from the same text the recipes train on: the Python standard
library's sources (zdsl's ``text("stdlib")``), plus the fine-tuning set so
its words are in the vocabulary. GPT-2's scheme: bytes first (any text
encodes, nothing is unknown), merges learned on top, ``<|endoftext|>``
between documents. A few seconds; deterministic for the same inputs.
Needs ``tokenizers`` (``pip install 'zdsl[hf]'``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
END_OF_TEXT = "<|endoftext|>"


def documents():
    from zdsl.sources.text import STDLIB
    from zdsl.sources.text import text_files
    for path in text_files(STDLIB):
        yield path.read_text(encoding="utf-8", errors="replace")
    sft = HERE / "data" / "sft.jsonl"
    if sft.exists():
        for line in sft.read_text(encoding="utf-8").splitlines():
            if line.strip():
                yield " ".join(str(v) for v in json.loads(line).values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=4096, help="ids in the vocabulary (default 4096)")
    ap.add_argument("-o", "--output", default=str(HERE / "tokenizer.json"))
    args = ap.parse_args(argv)
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        print("make_tokenizer: needs tokenizers: pip install 'zdsl[hf]'", file=sys.stderr)
        return 2
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=[END_OF_TEXT], show_progress=True,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents(), trainer=trainer)
    tok.save(args.output)
    print(f"make_tokenizer: {tok.get_vocab_size()} ids -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
