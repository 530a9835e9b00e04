"""The capacity planner by concern: `data` (GPU SKUs, model facts, input bounds), `model` (the
capacity arithmetic), `report` (the text tables). `engram_sglang.tools.planner` is its command line."""
