"""Serving the Engram model family with real SGLang: settings, history, runtime, launcher."""
