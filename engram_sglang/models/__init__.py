"""Model classes of the Qwen3 + Engram family: the SGLang class and the PyTorch reference."""
