"""Fuzzing: mutated versions of every program give a ZsError or a schedule, never a traceback.

Each strategy starts from a real program in programs/ and damages it the way
people and tools do: tokens deleted, inserted or swapped, random bytes,
truncation, huge numbers, invalid UTF-8. Whatever comes out must be a
schedule or a ZsError whose diagnostics render; an "internal error" (the
checker's last-resort net) counts as a failure too.
"""
from __future__ import annotations

import re
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zdsl.check.checker import check_text
from zdsl.lang.errors import ZsError
from zdsl.lang.errors import render
from zdsl.lang.parse import decode_source

PROGRAMS = sorted((Path(__file__).resolve().parents[2] / "programs").glob("*.zs"))
SOURCES = [(str(p), p.read_bytes()) for p in PROGRAMS]
TOKEN = re.compile(rb'"[^"\n]*"|[A-Za-z_][A-Za-z0-9_]*|[0-9][0-9_.eE+-]*[A-Za-z]*|->|\.\.|\s+|.',
                   re.S)
INSERTS = [b"zero", b"shard", b"offload", b"->", b"(", b")", b"[", b"]", b"{", b"}", b",", b"=",
           b"\n", b"u+1", b"parameters", b"nvme", b"cpu", b'"x"', b"..", b"-", b"#", b"\x00",
           b"unit", b"forward unit u {", b"99999999999999999999999999999999999", b"1e999",
           b"0", b"-1", b"64MiB", b"64Mib", b"\xff", b"\xc3", b"\t", b"\r", b"include",
           b'include "quickstart.zs"', b"step", b"compute u", b"none", b"true", b"((((((((("]
HUGE = [b"9" * 5000, b"1e99999", b"-" + b"9" * 30, b"1" * 30 + b"TiB", b"0.0000000001",
        b"1_000_000_000_000", b"4294967296", b"18446744073709551617", b"1e-999", b"00000"]

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def check_bytes(file: str, data: bytes) -> None:
    try:
        check_text(decode_source(data, file), file)
    except ZsError as exc:
        assert exc.diagnostics, "a ZsError must say why"
        for d in exc.diagnostics:
            assert not d.message.startswith("internal error"), d.message
            render(d)


def tokens(data: bytes) -> list[bytes]:
    return TOKEN.findall(data)


program = st.sampled_from(SOURCES)


@FUZZ
@given(program, st.data())
def test_token_deletions(src, data):
    file, raw = src
    toks = tokens(raw)
    for _ in range(data.draw(st.integers(1, 3))):
        if toks:
            del toks[data.draw(st.integers(0, len(toks) - 1))]
    check_bytes(file, b"".join(toks))


@FUZZ
@given(program, st.data())
def test_token_insertions(src, data):
    file, raw = src
    toks = tokens(raw)
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(toks)))
        toks.insert(at, data.draw(st.sampled_from(INSERTS)))
    check_bytes(file, b"".join(toks))


@FUZZ
@given(program, st.data())
def test_token_swaps(src, data):
    file, raw = src
    toks = tokens(raw)
    i = data.draw(st.integers(0, len(toks) - 1))
    j = data.draw(st.integers(0, len(toks) - 1))
    toks[i], toks[j] = toks[j], toks[i]
    check_bytes(file, b"".join(toks))


@FUZZ
@given(program, st.data())
def test_random_bytes(src, data):
    file, raw = src
    buf = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(buf)))
        chunk = data.draw(st.binary(min_size=1, max_size=6))
        if data.draw(st.booleans()):
            buf[at:at + len(chunk)] = chunk
        else:
            buf[at:at] = chunk
    check_bytes(file, bytes(buf))


@FUZZ
@given(program, st.data())
def test_truncation(src, data):
    file, raw = src
    check_bytes(file, raw[:data.draw(st.integers(0, len(raw)))])


@FUZZ
@given(program, st.data())
def test_huge_numbers(src, data):
    file, raw = src
    toks = tokens(raw)
    numbers = [i for i, t in enumerate(toks) if t[:1].isdigit()]
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.sampled_from(numbers))
        toks[i] = data.draw(st.sampled_from(HUGE))
    check_bytes(file, b"".join(toks))


@FUZZ
@given(program, st.data())
def test_non_utf8(src, data):
    file, raw = src
    at = data.draw(st.integers(0, len(raw)))
    bad = data.draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xe2\x82", b"\xed\xa0\x80", b"\x80",
                                     b"\xf8\x88\x80\x80\x80", b"\xc0\xaf"]))
    check_bytes(file, raw[:at] + bad + raw[at:])


def test_unmutated_programs_check():
    for file, raw in SOURCES:
        check_text(decode_source(raw, file), file)


@FUZZ
@given(st.data())
def test_overrides(data):
    from zdsl.lang.overrides import known_keys
    file, raw = SOURCES[0]
    key = data.draw(st.sampled_from(known_keys() + ["stpes", "offload.activations", "", "a.b.c"]))
    value = data.draw(st.one_of(st.sampled_from(["0", "-1", "2", "1e999", "cpu", 'nvme("/tmp/x")',
                                                 "64MiB", "(", "9" * 40, "fp16", "none"]),
                                st.text(max_size=12)))
    try:
        check_text(decode_source(raw, file), file, overrides={key: value})
    except ZsError as exc:
        for d in exc.diagnostics:
            assert not d.message.startswith("internal error"), d.message
            render(d)
