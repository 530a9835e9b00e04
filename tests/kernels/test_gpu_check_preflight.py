"""bench/gpu_check_preflight.py's pure parts on made-up facts (what the lent machine may lack),
and the guard that keeps bench/gpu_check*.py off torch APIs newer than the lent machine's 2.11."""

from __future__ import annotations

from pathlib import Path

from bench import gpu_check_preflight as pf

ROOT = Path(__file__).resolve().parents[2]
ALL_MODULES = {name: True for name, _ in pf.MODULES}
CUDA13 = {"cudart": 13, "glibc": "2.14"}


def good(**over) -> pf.Facts:
    f = pf.Facts(gpu=True, modules=dict(ALL_MODULES), torch_cuda="13.0", libs={"libengram_cuda.so": CUDA13},
                 glibc="2.39", compiler="/usr/bin/gcc", python_h=True, gpus=2)
    for k, v in over.items():
        setattr(f, k, v)
    return f


def lines(f) -> list[str]:
    return [f"{level}: {line}" for level, line in pf.judge(f)]


def test_a_complete_machine_has_no_problem():
    assert lines(good()) == []
    assert lines(good(gpu=False, gpus=0, libs={"libengram_cpu.so": {"cudart": None, "glibc": "2.2.5"}})) == []


def test_each_missing_piece_is_one_line():
    assert lines(good(torch_cuda="12.8")) == [
        "warn: libengram_cuda.so needs libcudart.so.13 but torch is built for CUDA 12.8 (the native checks fail): "
        "rebuild with the CUDA 12 toolkit"]
    assert lines(good(glibc="2.31", libs={"libengram_cuda.so": {"cudart": 13, "glibc": "2.34"}})) == [
        "warn: libengram_cuda.so needs glibc 2.34 but this machine has 2.31 (it will not load): build it on a machine "
        "with glibc <= 2.31"]
    assert "no C compiler" in lines(good(compiler=None))[0]
    assert "no Python.h" in lines(good(python_h=False))[0]
    assert lines(good(gpus=1)) == ["warn: 1 GPU visible: the 2-GPU checks skip (needs 2 GPUs)"]
    assert "libengram_cuda.so is missing" in lines(good(libs={}))[0]
    # Without Triton, no launcher to build: one line for the module, none for the compiler.
    assert lines(good(modules={**ALL_MODULES, "triton": False}, compiler=None)) == [
        "warn: Python module triton is missing (the triton checks): pip install triton"]


def test_missing_torch_stops_the_run():
    assert lines(good(modules={**ALL_MODULES, "torch": False}))[0].startswith("fatal: Python module torch is missing")


def test_lib_facts_read_the_real_library():
    path = ROOT / "build" / "kernels" / "libengram_cpu.so"
    facts = pf.lib_facts(path.read_bytes())
    assert facts["cudart"] is None and pf._version(facts["glibc"]) >= (2, 2)
    assert pf.lib_facts(b"\0libcudart.so.13\0GLIBC_2.2.5\0GLIBC_2.34\0GLIBC_2.17\0") == {"cudart": 13, "glibc": "2.34"}


def test_the_checks_use_no_torch_api_newer_than_2_11():
    files = sorted((ROOT / "bench").glob("gpu_check*.py"))
    assert len(files) >= 4
    used = {f"{p.name}:{line}: {name}" for p in files for line, name in pf.newer_torch_uses(p.read_text())}
    assert used == set(), f"torch APIs the lent machine's torch 2.11 lacks: {sorted(used)}"


def test_the_guard_sees_newer_apis():  # negative control
    src = "import torch\ng = ctx.torch.cuda.graph_annotations()\nt.const_data_ptr()\ndist.set_timeout(5)\ntorch.cuda.synchronize()\n"
    assert pf.newer_torch_uses(src) == [(2, "torch.cuda.graph_annotations"), (3, "const_data_ptr"),
                                        (4, "torch.distributed.set_timeout")]


def test_huge_page_gap_is_a_skip_below_90_percent():
    from bench.gpu_checks import huge_pages_gap

    assert huge_pages_gap(4 << 20, int(0.95 * (4 << 20)), "/dev/shm/x") == ""
    why = huge_pages_gap(4 << 20, int(0.5 * (4 << 20)), "/dev/shm/x")
    assert why.startswith("huge pages unavailable here: 50% of /dev/shm/x's 4096.0 MiB")
    assert huge_pages_gap(0, 0, "/dev/shm/x").startswith("huge pages unavailable here: 0%")


def test_cuda_indices_follow_cuda_visible_devices():
    from bench.gpu_checks import _physical_indices

    assert _physical_indices({})[:2] == [0, 1]
    assert _physical_indices({"CUDA_VISIBLE_DEVICES": "3, 1"}) == [3, 1]
    assert _physical_indices({"CUDA_VISIBLE_DEVICES": "GPU-5c1e,GPU-9a2b"}) is None
