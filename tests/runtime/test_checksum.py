"""The one checksum: CRC-32C by the standard's check value, continued across pieces."""
import pytest

from zdsl.runtime.io import checksum


def test_crc32c_is_the_standard_crc32c():
    pytest.importorskip("crc32c")
    assert checksum.DEFAULT is checksum.CRC32C
    assert checksum.CRC32C(b"123456789") == 0xE3069283      # the CRC-32C (Castagnoli) check value
    assert checksum.CRC32(b"123456789") == 0xCBF43926       # zlib's CRC-32, for files written with it


@pytest.mark.parametrize("algo", ["crc32", "crc32c"])
def test_a_checksum_continues_across_pieces(algo):
    fn = checksum.by_name(algo)
    if fn is None:
        pytest.skip(f"{algo} not computable here")
    data = bytes(range(256)) * 100
    assert fn(data[5000:], fn(data[:5000])) == fn(data)
    assert checksum.by_name("sha1") is None
