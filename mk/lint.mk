# `make lint`: ruff on the Python (pyflakes + import order, pyproject.toml's [tool.ruff]),
# hadolint on docker/Dockerfile.*, actionlint on .github/workflows/ (with shellcheck on their run: blocks), shellcheck on .ci/run, scripts/*.sh and docker/*.sh, plus
# the deployment files' consistency checks. `make test` runs the same file, tests/test_lint.py;
# this target runs only it, and fails (rather than skips) when a linter is missing.
.PHONY: lint
lint: setup
	ENGRAM_LINT_REQUIRED=1 $(PY) -m pytest -q tests/test_lint.py $(PYTEST_ARGS)
