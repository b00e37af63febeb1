"""The planner: what a task graph costs before it runs, on a machine profile.

graph_index (each op's predecessors, one topological order) and lanes (how a lane runs its
ops) are the model the others share; memory (bytes per tier over time), bound (the working
peak over every order), comm (volume per collective) and simulate (the step's timeline) price
the graph; report renders ``zdsl plan``; machine_fit says whether the ranks fit this machine;
calibration_fit inverts the simulator for ``zdsl calibrate``.
"""
