"""calibrate's disk test measures in interleaved rounds, so that outside load in one moment moves
one round's figures, not one size's or one direction's."""
import itertools

import pytest

from zdsl.runtime.calibrate import measure
from zdsl.runtime.calibrate.measure import DISK_ROUNDS
from zdsl.runtime.calibrate.measure import DISK_SIZES
from zdsl.runtime.calibrate.measure import Settings
from zdsl.runtime.calibrate.measure import measure_disk
from zdsl.runtime.offload.swap import Swapper


def test_the_disk_test_times_every_size_and_direction_in_each_round(tmp_path, monkeypatch):
    """After one warm-up transfer per size, the timed transfers cycle through the sizes, writing
    then reading each, once per round: each (direction, size) is a run of transfers ``rounds``
    times, where timing a size's transfers all at once made it one run each."""
    seen = []
    for method in ("write_sync", "read_sync"):
        def spy(self, name, tensor, *a, _real=getattr(Swapper, method), _way=method, **k):
            if name.startswith("transfer-"):
                seen.append((_way, tensor.numel()))
            return _real(self, name, tensor, *a, **k)
        monkeypatch.setattr(Swapper, method, spy)
    disk = measure_disk(str(tmp_path), Settings(quick=True), rank=0, beside=False)
    sizes = list(DISK_SIZES[:-1])
    rounds = DISK_ROUNDS[True]
    assert disk["rounds"] == rounds > 1
    warm_up = [(way, n) for n in sizes for way in ("write_sync", "read_sync")]
    assert seen[:len(warm_up)] == warm_up
    runs = [key for key, _ in itertools.groupby(seen[len(warm_up):])]
    assert runs == warm_up * rounds
    assert [n for n, _ in disk["points"]["read"]] == sizes == [n for n, _ in disk["points"]["write"]]


def slices(alone: float, read: float, write: float, burst: dict[int, float]):
    """A stand-in for measure._times: the n-th slice of the beside-compute test (alone, then
    rounds of reads, writes, alone) takes these seconds, or ``burst[n]`` where outside load hit it."""
    count = itertools.count()

    def times(fn, seconds, min_reps=1):
        n = next(count)
        kind = "alone" if n == 0 else ("read", "write", "alone")[(n - 1) % 3]
        return [burst.get(n, {"alone": alone, "read": read, "write": write}[kind])] * min_reps
    return times


@pytest.mark.parametrize("burst", [{}, {1: 5.0}, {0: 3.0}, {2: 0.5, 4: 9.0}])
def test_a_burst_of_outside_load_in_one_slice_leaves_the_cpu_shares(tmp_path, monkeypatch, burst):
    """Compute takes 1.25x its time alone beside reads (a share of 0.2) and 2x beside writes (0.5);
    a slice slowed or sped by outside load moves its round's ratio, not the median of the
    rounds' (the two alone figures either side of one reading and the beside one came from one
    moment each, so one bad slice once made both shares)."""
    monkeypatch.setattr(measure, "_times", slices(1.0, 1.25, 2.0, burst))
    with Swapper(str(tmp_path), 1 << 20, 8) as swapper:
        cpu = measure._disk_beside_compute(swapper, Settings(quick=True))
    assert cpu["read"] == pytest.approx(0.2) and cpu["write"] == pytest.approx(0.5)
    assert cpu["rounds"] == DISK_ROUNDS[True]
