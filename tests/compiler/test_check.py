"""Checker: one test per class of error, each asserting where it points and the hint."""
from __future__ import annotations

import pytest

from zdsl.check.checker import check_text

from zdsl.check.checker import load_schedule
from zdsl.lang.errors import UsageError
from zdsl.lang.errors import ZsError
from zdsl.schedule import ModelSpec
from zdsl.model.units import UnitSpec

HEADER = "model gpt(layers=2, width=64, heads=4, vocab=256, context=32)\n"


def diags(text: str, **kw):
    with pytest.raises(ZsError) as exc:
        check_text(text, "t.zs", **kw)
    return exc.value.diagnostics


def first(text: str, **kw):
    d = [x for x in diags(text, **kw) if x.is_error][0]
    return d, (d.span.line, d.span.column) if d.span else None


def test_misspelt_statement_keyword():
    d, at = first(HEADER + "prefech 2\n")
    assert at == (2, 1) and "prefetch" in d.hint and "prefech" in d.message


def test_duplicate_statement_points_at_both():
    ds = diags(HEADER + "prefetch 1\nranks 2\nprefetch 2\n")
    err, note = ds[0], ds[1]
    assert err.is_error and (err.span.line, err.span.column) == (4, 1) and "twice" in err.message
    assert "t.zs:2:1" in err.hint
    assert note.severity == "note" and note.span.line == 2


def test_zero_and_shard_together_is_a_duplicate():
    d, at = first(HEADER + "zero 2\nshard optimizer\n")
    assert at == (3, 1) and "sharding" in d.message


def test_shard_must_be_a_prefix_in_zero_order():
    d, at = first(HEADER + "shard gradients\n")
    assert at == (2, 7) and d.hint.startswith("shard optimizer, gradients")
    d, _ = first(HEADER + "shard optimizer, parameters\n")
    assert "shard optimizer, gradients, parameters" in d.hint


def test_unknown_state_gets_nearest():
    d, at = first(HEADER + "zero 2\noffload gradient -> cpu\n")
    assert at == (3, 9) and "gradients" in d.hint


def test_offload_parameters_requires_zero_3():
    d, at = first(HEADER + "zero 2\noffload parameters -> cpu\n")
    assert at == (3, 9) and "zero 3" in d.message and "zero 3" in d.hint


def test_offload_gradients_requires_zero_2():
    d, at = first(HEADER + "zero 1\noffload gradients -> cpu\n")
    assert at == (3, 9) and "zero 2" in d.message
    check_text(HEADER + "zero 2\noffload gradients -> cpu\n")


def test_offload_optimizer_requires_sharding():
    d, at = first(HEADER + "offload optimizer -> cpu\n")
    assert at == (2, 9) and "zero 1" in d.hint


def test_nvme_needs_a_path():
    d, at = first(HEADER + "zero 3\noffload parameters -> nvme\n")
    assert at == (3, 23) and "nvme(" in d.hint


def test_nvme_block_is_4k_aligned():
    d, at = first(HEADER + 'zero 3\noffload parameters -> nvme("/tmp/x", block=5000)\n')
    assert at == (3, 44) and "4KiB" in d.message


@pytest.mark.parametrize("line, col, words", [
    ("ranks 0", 7, "at least 1"),
    ("train steps=0", 13, "at least 1"),
    ("train batch=2.5", 13, "whole number"),
    ("train accumulate=0", 18, "at least 1"),
    ("prefetch -1", 10, "at least 0"),
    ("zero 4", 6, "between 0 and 3"),
    ("optimizer adamw(lr=0)", 20, "greater than 0"),
    ("optimizer adamw(betas=(0.9, 1.5))", 29, "[0, 1)"),
    ("zero 2\noffload optimizer -> cpu(ratio=0)", 32, "(0, 1]"),
    ("zero 2\noffload optimizer -> cpu(ratio=1.5)", 32, "(0, 1]"),
    ("train steps=99999999999999999999999999", 13, "too large"),
    ("optimizer adamw(lr=1e999)", 20, "out of range"),
    ("checkpoint every 0 steps -> \"c\"", 18, "at least 1"),
])
def test_ranges(line, col, words):
    d, at = first(HEADER + line + "\n")
    assert at[1] == col and words in d.message, d.message


def test_heads_must_divide_width():
    d, at = first("model gpt(width=64, heads=5)\n")
    assert at == (1, 27) and "divide" in d.message


def test_unknown_option_gets_nearest():
    d, at = first(HEADER + "train stpes=3\n")
    assert at == (2, 7) and "steps" in d.hint
    d, at = first(HEADER + "optimizer adamw(lr=1e-3, weight_decy=0.1)\n")
    assert at == (2, 26) and "weight_decay" in d.hint
    d, _ = first(HEADER + "optimizer sgd(betas=(0.9, 0.9))\n")
    assert "no setting 'betas'" in d.message


def test_unknown_names_get_nearest():
    assert "fp32" in first(HEADER + "train precision=fp23\n")[0].hint
    assert "adamw" in first(HEADER + "optimizer adanw(lr=1)\n")[0].hint
    assert "cuda" in first(HEADER + "ranks 2 on cdua\n")[0].hint
    assert "blocks" in first(HEADER + "recompute blokcs\n")[0].hint
    assert "gpt" in first("model gtp(layers=2)\n")[0].hint
    assert "corpus" in first(HEADER + 'data corpsu("stdlib")\n')[0].hint


def test_bad_byte_unit():
    d, at = first(HEADER + "bucket 64Mib\n")
    assert at == (2, 8) and "MiB" in d.hint


def test_memory_tier_names():
    d, at = first(HEADER + "memory cpu 16GiB\n")
    assert at == (2, 8) and "host" in d.hint
    d, at = first(HEADER + "memory device 1GiB, device 2GiB\n")
    assert at == (2, 21) and "twice" in d.message


def test_overlap_names():
    d, at = first(HEADER + "overlap gahter/forward\n")
    assert at == (2, 9) and "gather" in d.hint
    d, at = first(HEADER + "overlap gather/froward\n")
    assert at == (2, 16) and "forward" in d.hint
    d, _ = first(HEADER + "overlap none, gather\n")
    assert "alone" in d.message


def test_recompute_range_beyond_model():
    d, at = first(HEADER + "recompute units 2..9\n")
    assert at == (2, 17) and "beyond" in d.message
    d, _ = first(HEADER + "recompute units 3..1\n")
    assert "empty" in d.message


def test_prefetch_deeper_than_model_is_a_warning():
    s, warnings = check_text(HEADER + "zero 3\nprefetch 9\n", "t.zs")
    assert s.prefetch == 9
    assert [(w.severity, w.span.line, w.span.column) for w in warnings] == [("warning", 3, 10)]
    assert "deeper than the model (4 units)" in warnings[0].message


def test_missing_model_and_data_are_the_loops():
    s, _ = check_text("schedule s\n")
    assert s.model.kind == "loop" and s.data.kind == "fed"      # zdsl.initialize gives both


def test_data_must_fit_the_model():
    d, _ = first(HEADER + 'data corpus("stdlib", context=64)\n')
    assert "longer than the model's context" in d.message
    d, _ = first("model gpt(vocab=100)\ndata corpus(\"stdlib\")\n")
    assert "byte-level" in d.message
    d, at = first(HEADER + 'data corpus("no/such/file.txt")\n')
    assert at == (2, 13) and "not found" in d.message


def test_all_errors_are_reported_at_once():
    ds = diags(HEADER + "train steps=0, batch=0\nranks 0\n")
    assert [(d.span.line, d.span.column) for d in ds] == [(2, 13), (2, 22), (3, 7)]


# -- pipelines ------------------------------------------------------------------

PIPE = HEADER + "zero 3\nforward unit u {\n%s\n}\nbackward unit u { compute u }\nstep unit u { step u }\n"


@pytest.mark.parametrize("line, col, message, hint", [
    ("    gahter parameters[u+1]", 5, "unknown verb", "gather"),
    ("    gather paramters[u+1]", 12, "unknown state", "parameters"),
    ("    gather gradients[u]", 12, "acts on parameters", "gather parameters"),
    ("    gather parameters[v+1]", 23, "unknown unit variable", "'u'"),
    ("    read parameters[u] to nvme", 24, "takes 'from'", "from nvme"),
    ("    read parameters[u]", 10, "needs 'from nvme'", "from nvme"),
    ("    copy parameters[u] to gpu", 27, "expected host or device", None),
    ("    compute parameters[u]", 13, "takes a unit", "compute u"),
    ("    free u", 10, "needs a state", "free parameters"),
    ("    recompute u", 5, "does not belong in the forward", "backward"),
    ("    gather parameters[9]", 23, "beyond the model", None),
    ("    free parameters[u] on cpu", 24, "takes no 'on'", None),
])
def test_pipeline_errors(line, col, message, hint):
    d, at = first(PIPE % ("    compute u\n" + line))
    assert at == (5, col) and message in d.message, (at, d.message)
    if hint:
        assert hint in d.hint


def test_pipelines_must_be_complete():
    d, _ = first(HEADER + "forward unit u { compute u }\nstep unit u { step u }\n")
    assert "no backward pipeline" in d.message
    d, _ = first(HEADER + "forward unit u { compute u }\nbackward unit u { compute u }\n")
    assert "steps the optimizer" in d.message
    d, at = first(PIPE % "    compute u\n" + "forward unit u { compute u }\n")
    assert at == (9, 1) and "twice" in d.message


# -- include --------------------------------------------------------------------

def test_include_is_relative_to_the_including_file(tmp_path):
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "machine.zs").write_text("machine cpu(flops=1e9)\nmemory host 1GiB\n")
    (tmp_path / "main.zs").write_text(HEADER + 'include "profiles/machine.zs"\n')
    s, _ = load_schedule(str(tmp_path / "main.zs"))
    assert s.machine.compute.flops == 1e9 and s.memory == {"host": 1 << 30}
    assert s.spans["machine"].file.endswith("machine.zs")


def test_error_inside_an_included_file_points_into_it(tmp_path):
    (tmp_path / "m.zs").write_text("# profile\nmachine cpu(flosp=1e9)\n")
    (tmp_path / "main.zs").write_text(HEADER + 'include "m.zs"\n')
    with pytest.raises(ZsError) as exc:
        load_schedule(str(tmp_path / "main.zs"))
    d = exc.value.diagnostics[0]
    assert d.span.file.endswith("m.zs") and (d.span.line, d.span.column) == (2, 13)
    assert d.source_line == "machine cpu(flosp=1e9)" and "flops" in d.hint


def test_include_cycle_and_missing_file(tmp_path):
    (tmp_path / "a.zs").write_text('include "b.zs"\n')
    (tmp_path / "b.zs").write_text('include "a.zs"\n')
    (tmp_path / "main.zs").write_text(HEADER + 'include "a.zs"\ninclude "nope.zs"\n')
    with pytest.raises(ZsError) as exc:
        load_schedule(str(tmp_path / "main.zs"))
    assert "cycle" in exc.value.diagnostics[0].message
    (tmp_path / "main.zs").write_text(HEADER + 'include "nope.zs"\n')
    with pytest.raises(ZsError) as exc:
        load_schedule(str(tmp_path / "main.zs"))
    d = exc.value.diagnostics[0]
    assert "not found" in d.message and (d.span.line, d.span.column) == (2, 9)


# -- overrides ------------------------------------------------------------------

def test_overrides_set_train_and_policy_values():
    text = HEADER + "train steps=3, batch=2\nranks 2 on cpu\nzero 1\noptimizer adamw(lr=1e-3)\n"
    s, _ = check_text(text, "t.zs", overrides={
        "steps": "50", "train.batch": "8", "zero": "2", "lr": "0.5", "ranks": "4",
        "offload.optimizer": "cpu", "memory.host": "16GiB", "prefetch": "2", "bucket": "1MiB",
        "precision": "bf16", "model.layers": "6", "offload.optimizer.ratio": "0.5"})
    assert (s.train.steps, s.train.batch, s.train.precision) == (50, 8, "bf16")
    assert (s.stage, s.ranks, s.device, s.optimizer.lr) == (2, 4, "cpu", 0.5)
    assert s.placement["optimizer"].tier == "cpu" and s.placement["optimizer"].ratio == 0.5
    assert s.memory == {"host": 16 << 30} and s.prefetch == 2 and s.bucket_bytes == 1 << 20
    assert s.model.args["layers"] == 6


def test_override_unknown_key_is_a_usage_error_with_hint():
    with pytest.raises(UsageError) as exc:
        check_text(HEADER, "t.zs", overrides={"stpes": "3"})
    d = exc.value.diagnostics[0]
    assert d.span is None and "stpes" in d.message and "steps" in d.hint


def test_override_bad_value_points_at_the_override():
    ds = diags(HEADER, overrides={"precision": "fp32", "steps": "0"})
    d = ds[0]
    assert d.span.file == "--set" and d.span.line == 2 and d.source_line == "train steps=0"
    with pytest.raises(UsageError):
        check_text(HEADER, "t.zs", overrides={"zero": "("})


# -- the model's units ------------------------------------------------------------

def test_units_for_resolves_recompute_of_a_user_model(tmp_path):
    (tmp_path / "m.py").write_text("def build(**kw):\n    pass\n")
    text = 'model "m.py:build"(hidden=8)\nrecompute blocks\ndata synthetic(vocab=9, context=4)\n'
    (tmp_path / "s.zs").write_text(text)
    seen = []

    def units_for(spec: ModelSpec):
        seen.append(spec)
        return [UnitSpec(f"u{i}", [("w", (4,))]) for i in range(5)]

    s, _ = load_schedule(str(tmp_path / "s.zs"), units_for=units_for)
    assert s.recompute == {1, 2, 3}
    assert seen[0].kind == "user" and seen[0].args == {"hidden": 8}
    assert seen[0].factory == f"{(tmp_path / 'm.py').resolve()}:build"
    # without a callback the user model is not sized: a warning, not a guess
    s, warnings = load_schedule(str(tmp_path / "s.zs"))
    assert s.recompute == set() and "units" in warnings[0].message


def test_units_for_failure_is_an_error_at_the_model(tmp_path):
    def units_for(spec, data=None):
        raise RuntimeError("boom")
    d, at = first(HEADER, units_for=units_for)
    assert at == (1, 7) and "boom" in d.message


def test_model_factory_errors(tmp_path):
    d, at = first('model "nope.py:build"()\n')
    assert at == (1, 7) and "not found" in d.message
    d, _ = first('model "nocolon"()\n')
    assert "file.py:function" in d.message
    s, _ = check_text('model "mypkg.models:build"(x=1)\ndata corpus("stdlib", context=8)\n')
    assert s.model.factory == "mypkg.models:build"


def test_a_user_model_needs_the_data_shape():
    d, at = first('model "mypkg.models:build"()\ndata corpus("stdlib")\n')
    assert at == (2, 1) and "context" in d.message and "context=" in d.hint
    s, _ = check_text('model "mypkg.models:build"()\n')     # no data: the loop feeds the batches
    assert s.data.kind == "fed"


@pytest.mark.parametrize("key, field", [("comm_overhead", "comm_overhead"), ("scatter_overhead", "scatter_overhead"),
                                        ("scatter_link", "scatter_bandwidth"),
                                        ("reduce_latency", "reduce_latency"),
                                        ("host_memory_bw", "host_memory_bandwidth"),
                                        ("disk_read_latency", "disk_read_latency"),
                                        ("disk_write_latency", "disk_write_latency")])
def test_machine_derived_rates_and_collective_overhead_may_be_zero_not_negative(tmp_path, key, field):
    (tmp_path / "ok.zs").write_text(HEADER + f"machine cpu({key}=0.002)\n")
    assert load_schedule(str(tmp_path / "ok.zs"))[0].machine.value(field) == 0.002
    (tmp_path / "zero.zs").write_text(HEADER + f"machine cpu({key}=0)\n")
    # a fixed cost of 0 is 0; a rate of 0 is "not given", derived from the others
    derived = field in ("scatter_bandwidth", "reduce_latency", "host_memory_bandwidth")
    assert load_schedule(str(tmp_path / "zero.zs"))[0].machine.value(field) == (None if derived else 0.0)
    (tmp_path / "bad.zs").write_text(HEADER + f"machine cpu({key}=-1)\n")
    with pytest.raises(ZsError) as exc:
        load_schedule(str(tmp_path / "bad.zs"))
    d = exc.value.diagnostics[0]
    assert key in d.message and d.span.line == HEADER.count("\n") + 1 and d.span.column > len("machine cpu(")


def test_comm_slots_is_a_whole_number_of_threads(tmp_path):
    (tmp_path / "ok.zs").write_text(HEADER + "machine cpu(comm_slots=4)\n")
    assert load_schedule(str(tmp_path / "ok.zs"))[0].machine.collectives.slots == 4
    (tmp_path / "default.zs").write_text(HEADER)
    assert load_schedule(str(tmp_path / "default.zs"))[0].machine.collectives.slots == 2     # gloo's two threads
    for bad in ("0", "1.5"):
        (tmp_path / "bad.zs").write_text(HEADER + f"machine cpu(comm_slots={bad})\n")
        with pytest.raises(ZsError) as exc:
            load_schedule(str(tmp_path / "bad.zs"))
        d = exc.value.diagnostics[0]
        assert "comm_slots" in d.message and d.span.line == HEADER.count("\n") + 1


def test_machine_comm_under_load_is_a_share_of_a_rate(tmp_path):
    (tmp_path / "ok.zs").write_text(HEADER + "machine cpu(comm_under_load=0.25)\n")
    assert load_schedule(str(tmp_path / "ok.zs"))[0].machine.collectives.under_load == 0.25
    (tmp_path / "bad.zs").write_text(HEADER + "machine cpu(cores=1, comm_under_load=1.5)\n")
    with pytest.raises(ZsError) as exc:
        load_schedule(str(tmp_path / "bad.zs"))
    d = exc.value.diagnostics[0]
    assert "comm_under_load" in d.message and "1.5" in d.message and d.span.column > 1


def test_machine_compute_excess_is_a_share_that_may_be_zero(tmp_path):
    for value in ("0", "0.15"):
        (tmp_path / "ok.zs").write_text(HEADER + f"machine cpu(compute_excess={value})\n")
        assert load_schedule(str(tmp_path / "ok.zs"))[0].machine.costs.compute_excess == float(value)
    (tmp_path / "bad.zs").write_text(HEADER + "machine cpu(compute_excess=-0.1)\n")
    with pytest.raises(ZsError) as exc:
        load_schedule(str(tmp_path / "bad.zs"))
    assert "compute_excess" in exc.value.diagnostics[0].message


def test_machine_overhead_is_a_time_that_may_be_zero(tmp_path):
    (tmp_path / "ok.zs").write_text(HEADER + "machine cpu(flops=1e9, overhead=0.0012)\n")
    assert load_schedule(str(tmp_path / "ok.zs"))[0].machine.costs.op == 0.0012
    (tmp_path / "zero.zs").write_text(HEADER + "machine cpu(overhead=0)\n")
    assert load_schedule(str(tmp_path / "zero.zs"))[0].machine.costs.op == 0.0
    (tmp_path / "bad.zs").write_text(HEADER + "machine cpu(overhead=-1e-3)\n")
    with pytest.raises(ZsError) as exc:
        load_schedule(str(tmp_path / "bad.zs"))
    assert "overhead" in exc.value.diagnostics[0].message


def test_a_statement_repeated_many_times_notes_its_first_place_once():
    ds = diags(HEADER + "prefetch 1\n" * 5)
    errors = [d for d in ds if d.is_error]
    notes = [d for d in ds if d.severity == "note"]
    assert [d.span.line for d in errors] == [3, 4, 5, 6] and all("twice" in d.message for d in errors)
    assert [(d.span.line, ds.index(d)) for d in notes] == [(2, 1)]     # right after the first repeat


def test_a_data_context_past_the_models_is_an_error_at_the_data_context():
    """A GPT's position table has `context` rows: a longer sequence cannot be indexed."""
    d, at = first(HEADER + 'data corpus("stdlib", context=64)\n')
    assert at == (2, 23) and d.message == "data context 64 is longer than the model's context 32"
    assert d.hint == "model gpt(context=64) or a shorter data context"
    d, at = first(HEADER + "data synthetic(context=16)\n", overrides={"data.context": "33"})
    assert d.span.file == "--set" and "data context 33 is longer" in d.message
