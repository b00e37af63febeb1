"""Op times are taken (CUDA: timing events) only on the steps whose times are read."""
from types import SimpleNamespace

from zdsl.runtime.run.train import timed_step


def options(metrics=None, trace=None, timeline=None, trace_steps=3):
    return SimpleNamespace(metrics=metrics, trace=trace, timeline=timeline, trace_steps=trace_steps)


def test_only_the_last_step_is_timed_without_metrics_or_trace():
    assert [timed_step(options(), s, 5) for s in range(5)] == [False, False, False, False, True]


def test_a_trace_times_the_steps_it_keeps_and_metrics_time_every_step():
    assert [timed_step(options(trace="t.json", trace_steps=2), s, 5) for s in range(5)] == \
        [False, False, False, True, True]
    assert [timed_step(options(timeline="t.svg", trace_steps=1), s, 3) for s in range(3)] == [False, False, True]
    assert all(timed_step(options(metrics="m.jsonl"), s, 5) for s in range(5))
