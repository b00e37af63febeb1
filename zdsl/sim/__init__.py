"""The cost model: what a task graph's step takes on a machine profile, before it runs.

graph_index (each op's predecessors, one topological order) and lanes (how a lane runs its ops)
are the model the others share; memory (bytes per tier over time) and simulate (the step's
timeline, lanes sharing cores and links) price the graph at rates (the profile's, by the
schedule's shape). It reads only the IR and the schedule: the compiler's verifier and host
budget simulate with it, and the planner (``zdsl/planner/``) reports on it.
"""
