"""A tiny supervised fine-tuning set and its tokenizer, made in the test (no network), and the
tokens a record should become, computed with ``tokenizers`` directly (the reference the data
path is held to)."""
from __future__ import annotations

import json
import random
from pathlib import Path

from zdsl.schedule import DataSpec

EOS = "<|endoftext|>"
WORDS = ["what", "is", "plus", "minus", "times", "reverse", "the", "word", "answer", ":", "?", "cat", "dog",
         "tac", "god", *map(str, range(100))]


def train_tokenizer(path: Path, eos: str | None = EOS) -> Path:
    """A WordLevel tokenizer over :data:`WORDS`, whitespace-split, with ``[UNK]`` and ``eos``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = ["[UNK]"] + ([eos] if eos else [])
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=special))
    tok.save(str(path))
    return path


def sft_records(count: int, seed: int = 0, long_every: int = 0) -> list[dict]:
    """Short question/answer records; every ``long_every``-th one has a long prompt."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        kind = i % 3
        if kind == 0:
            prompt, response = f"what is {a} plus {b} ?", f"answer : {a + b}"
        elif kind == 1:
            prompt, response = f"what is {max(a, b)} minus {min(a, b)} ?", f"{max(a, b) - min(a, b)}"
        else:
            word = rng.choice(["cat", "dog"])
            prompt, response = f"reverse the word {word} ?", {"cat": "tac", "dog": "god"}[word]
        if long_every and i % long_every == long_every - 1:
            prompt = " ".join([prompt] * 8)
        out.append({"prompt": prompt, "response": response, "id": i})
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def sft_spec(path: Path, tokenizer: Path, context: int, pack: bool, vocab: int = 256, prompt: str = "prompt",
             response: str = "response") -> DataSpec:
    return DataSpec("jsonl", str(path), {"prompt": prompt, "response": response, "pack": pack,
                                         "context": context, "vocab": vocab}, None, str(tokenizer))


def record_tokens(tokenizer: Path, record: dict) -> tuple[list[int], list[int]]:
    """``(prompt ids, response ids + end of text)`` by ``tokenizers`` itself."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer))
    encode = lambda text: tok.encode(text, add_special_tokens=False).ids     # noqa: E731
    return encode(record["prompt"]), encode(record["response"]) + [tok.token_to_id(EOS)]
