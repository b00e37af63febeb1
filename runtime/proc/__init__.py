"""A rank's process: its guard (signals, its launcher gone, a stop taken inside trio), its progress
board (what the launcher reads to name a stuck rank) and fault injection for the tests that prove
no rank hangs. Below every other package of the runtime: all of them run inside a rank."""
