"""Cost model and simulator: memory per tier, communication, predicted step time."""
