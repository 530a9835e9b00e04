"""The capacity arithmetic by concern: `data` (GPU SKUs, model facts, input bounds), `model` (what
fits where), `disk` (the disk tier's hit rates and reads), `whole_rows` (whole rows vs a shard).
Start-up uses it (serving/whole_rows_auto.py); the planner's command line and its text report
are tools (engram_sglang/tools/planner.py, tools/planner_report.py)."""
