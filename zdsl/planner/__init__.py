"""The planner: what a compiled schedule costs and whether it fits, as ``zdsl plan`` says it.

On the cost model (``zdsl/sim/``): bound (the working peak over every order), comm (volume per
collective), traffic (bytes per tier path against ZeRO-Infinity's minimum), freeze_plan and
eval_plan (what freezing and evaluation cost), machine_fit (whether the ranks fit this machine),
profile_cache and this_machine (which machine profile plans, calibrated once and cached),
calibration_fit (the simulator inverted for ``zdsl calibrate``), and report (what ``zdsl plan``
prints).
"""
