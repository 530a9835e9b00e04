"""Issue 23, finding 4: on a CUDA device without ATS (it maps registered host memory in its own
page tables: PCIe H100/H200/B200) host rows are read in address order and scattered back; with
ATS, on HIP, or where the runtime does not say, in hash order. No GPU here: the decision is
proven against a stand-in runtime, the sorted path on the CPU host store, bit for bit."""

from __future__ import annotations

import pytest
import torch

from engram_sglang.core.ops import gpu_runtime
from engram_sglang.core.rowformat import bf16_bits
from engram_sglang.core.stores import hostmem
from tests.core.test_hostmem_register import PAGE, FakeRuntime
from tests.core.test_stores import CFG, open_placement, random_ids, reference, table_dir  # noqa: F401


@pytest.mark.parametrize("vendor, reported, want", [
    ("cuda", 0, True),  # PCIe Hopper/Blackwell: the GPU's own page tables
    ("cuda", 1, False),  # ATS (NVLink-C2C): the host's page tables serve the reads
    ("cuda", None, False),  # an older runtime that does not know the attribute: not assumed
    ("hip", 0, False),  # never asked on HIP
])
def test_address_order_only_where_the_device_reports_its_own_page_tables(vendor, reported, want):
    rt = FakeRuntime(vendor)
    rt.attrs["pageable_memory_access_uses_host_page_tables"] = reported if vendor == "cuda" else None
    access = gpu_runtime.host_access(rt, 3)
    assert access.address_ordered is want
    asked = [c for c in rt.of("attribute") if c[1] == "pageable_memory_access_uses_host_page_tables"]
    assert [c[2] for c in asked] == [3]  # asked of the store's device
    reg = hostmem.register_with_gpu(10 * PAGE, 264 * 100, device=3, runtime=rt, portable=False)
    assert reg.address_ordered is want
    # The CUDA attribute's enum value (cudaDevAttrPageableMemoryAccessUsesHostPageTables).
    assert gpu_runtime.ATTRIBUTES["pageable_memory_access_uses_host_page_tables"] == {"cuda": 100, "hip": None}


@pytest.mark.parametrize("shape", [(1,), (256, 6), (3, 5, 7)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shared", [False, True])
def test_sorted_reads_return_the_rows_in_the_ids_order_bit_for_bit(table_dir, tmp_path, shape, dtype, shared):  # noqa: F811
    root, tables = table_dir
    layer = CFG.layer_ids[-1]
    store = open_placement(root, "host", {"shared": shared}, tmp_path)[layer]
    try:
        gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
        ids = random_ids(gen, store.rows, shape, dtype)
        plain = store.gather(ids)
        store.sorted_reads = True  # what a registration on a device without ATS sets
        got = store.gather(ids)
        into = torch.full((*shape, 256), float("nan"), dtype=torch.bfloat16)
        assert store.gather(ids, out=into) is into
        want = reference(tables[layer], ids)
        for rows in (got, into):
            assert torch.equal(bf16_bits(rows), bf16_bits(want))
        assert torch.equal(bf16_bits(plain), bf16_bits(want))
        assert store.stats()["reads_in_address_order"] is True
    finally:
        store.close()


def test_sorted_reads_read_no_row_for_padding_ids(table_dir, tmp_path):  # noqa: F811
    """-1 (a CUDA-graph padding token's id) sorts first and still reads +0."""
    root, tables = table_dir
    layer = CFG.layer_ids[0]
    store = open_placement(root, "host", {}, tmp_path)[layer]
    try:
        store.sorted_reads = True
        ids = torch.tensor([5, -1, store.rows - 1, -1, 0, 5])
        got = store.gather(ids)
        assert not bf16_bits(got[[1, 3]]).any()
        live = ids[ids >= 0]
        assert torch.equal(bf16_bits(got[ids >= 0]), bf16_bits(reference(tables[layer], live)))
    finally:
        store.close()
