"""Infrastructure written once: timing and op counting, devices, verified atomic checkpoints.
The ground floor beside ``heads``: it imports nothing else of ``circuits_llm``."""
