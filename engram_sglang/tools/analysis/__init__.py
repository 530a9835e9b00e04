"""Engram ablation and analysis tools: `engram-sglang ablate` (likelihood with Engram on, off
and in a position window, through a real server's input logprobs) and `engram-sglang scan`
(gate scores and row reads per n-gram, from the reference forward). docs/operations.md,
"Ablation and scans", says how to read their output."""
