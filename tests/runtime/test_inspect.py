"""`zdsl inspect` says only what it checked: a shard with a flipped byte is not "complete"."""
from test_checkpoint import _flip_byte, model, save  # noqa: F401 - model is a fixture

from zdsl.runtime.checkpoint.inspect import main


def listing(argv, capsys) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def test_a_flipped_byte_in_a_shard_is_not_listed_as_complete(tmp_path, model, capsys):
    units, full = model
    save(tmp_path, 1, units, full, 2, threads=False)
    bad, _ = save(tmp_path, 2, units, full, 2, threads=False)
    shard = bad / "rank-00001-of-00002.safetensors"
    _flip_byte(shard, shard.stat().st_size // 2)           # inside a tensor: size and header intact
    table = listing([str(tmp_path)], capsys)
    assert "step-000002  unusable" in table and shard.name in table
    assert "step-000001  complete\n" in table + "\n"       # checked, so plainly complete
    assert f"checkpoint {tmp_path / 'step-000001'}\n" in table
    # --quick reads no tensor: it cannot tell, and says so
    quick = listing([str(tmp_path), "--quick"], capsys)
    assert "step-000002  complete (not verified)" in quick and "step-000001  complete (not verified)" in quick
    assert "unusable" not in quick and "(not verified: checksums not read)" in quick
    # one step folder: refused by default, described as unverified with --no-verify
    assert main([str(bad)]) == 1 and shard.name in capsys.readouterr().err
    assert "(not verified: checksums not read)" in listing([str(bad), "--no-verify"], capsys)
