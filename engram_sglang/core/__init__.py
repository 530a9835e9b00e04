"""The core: what a tool, a benchmark or another serving engine can use without SGLang.

The Engram config, errors, hashing, the row format, table files, the gather op and its
backends, the stores (one module per placement, the caches, native row reads) and the
capacity arithmetic. It never imports sglang, nor another room of the package
(docs/architecture.md).
"""
