"""human_bytes: the one approximate byte formatter every table and message uses."""
from zdsl.lang.sizes import human_bytes


def test_below_one_kib_is_whole_bytes():
    assert human_bytes(0) == "0 B"
    assert human_bytes(1) == "1 B"
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(1023.9) == "1023 B"      # a fraction of a byte is dropped, never rounded up to 1024 B


def test_each_unit_starts_at_its_power_of_1024():
    assert human_bytes(1024) == "1.00 KiB"
    assert human_bytes(1536) == "1.50 KiB"
    assert human_bytes(1 << 20) == "1.00 MiB"
    assert human_bytes(3 * (1 << 29)) == "1.50 GiB"
    assert human_bytes(24 << 30) == "24.00 GiB"
    assert human_bytes(1 << 40) == "1.00 TiB"
    assert human_bytes(2048 << 40) == "2048.00 TiB"   # TiB is the largest unit


def test_negative_keeps_its_sign_and_unit():
    assert human_bytes(-1) == "-1 B"
    assert human_bytes(-(2 << 20)) == "-2.00 MiB"
    assert human_bytes(-1024) == "-1.00 KiB"


def test_float_input():
    assert human_bytes(1.5 * (1 << 30)) == "1.50 GiB"
    assert human_bytes(65536.0) == "64.00 KiB"
