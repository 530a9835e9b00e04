"""Coverage-guided fuzzing of the parsers of files a user hands us (`make fuzz`; atheris).
Run from the repository root: `python -m fuzz.runner`, `python -m fuzz.fuzz_TARGET FILE`."""
