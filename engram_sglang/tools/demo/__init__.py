"""The built-in demo (`make demo`): the demo model's generator, its corpus and prompts, and
the run that serves it with real SGLang (run.py)."""
