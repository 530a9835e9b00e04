"""The operators' tools: the `engram-sglang` command (tables, shm, plan, profile, ablate, scan,
demo) and what only they use. Tools may import every other room; nothing imports tools."""
