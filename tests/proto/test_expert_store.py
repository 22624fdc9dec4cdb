"""ExpertStore: byte layout contract, zero-copy attach, ownership, stale reclaim, clear errors."""
from __future__ import annotations

import ctypes
import json
import logging
import os
import struct
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

from ftexpert.proto.expert_store import DATA_ALIGN_BYTES, STORE_MAGIC, STORE_VERSION, ExpertStore
from ftexpert.proto.shm_layout import ChannelLayout, create_channel
from ftexpert.proto.shm_segment import SHM_DIR, ShmError

REPO = Path(__file__).parents[2]
L, E, H, I = 2, 3, 64, 48          # layers, experts, hidden, intermediate (small: CI)


@pytest.fixture
def shm_name():
    name = f"ft-test-store-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def make_store(name: str, **overrides) -> ExpertStore:
    kwargs = dict(num_layers=L, num_experts=E, hidden=H, intermediate=I, dtype=torch.bfloat16, config_hash="cfg-1")
    kwargs.update(overrides)
    return ExpertStore.create(name, **kwargs)


def hf_expert(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(I, H, generator=g).to(torch.bfloat16)   # [I, H]
    up = torch.randn(I, H, generator=g).to(torch.bfloat16)     # [I, H]
    down = torch.randn(H, I, generator=g).to(torch.bfloat16)   # [H, I]
    return gate, up, down


def test_bytes_on_disk_follow_the_documented_layout(shm_name):
    store = make_store(shm_name)
    gate, up, down = hf_expert(7)
    store.write_expert(1, 2, gate=gate, up=up, down=down)
    meta = store.meta()
    assert meta["data_offset"] == DATA_ALIGN_BYTES and meta["data_offset"] % (2 << 20) == 0
    assert meta["expert_bytes"] == (2 * I * H + H * I) * 2
    assert meta["expert_stride"] % 4096 == 0 and meta["expert_stride"] >= meta["expert_bytes"]
    with open(os.path.join(SHM_DIR, shm_name), "rb") as f:
        raw = f.read()
    magic, version = struct.unpack_from("<8sI", raw, 0)
    assert (magic, version) == (STORE_MAGIC, STORE_VERSION)
    start = meta["data_offset"] + (1 * E + 2) * meta["expert_stride"]
    expected = torch.cat([gate.flatten(), up.flatten(), down.flatten()]).view(torch.int16).numpy().tobytes()
    assert raw[start:start + meta["expert_bytes"]] == expected
    store.close()
    store.unlink()


def test_attach_sees_the_same_bytes_without_copying(shm_name):
    store = make_store(shm_name)
    packed = torch.randn(E, store.shape.expert_numel).to(torch.bfloat16)   # [E, 2IH + HI]
    store.write_layer(0, packed)
    store.mark_ready()
    other = ExpertStore.attach(shm_name)
    assert other.readonly and not other.is_owner and other.is_ready
    assert torch.equal(other.layer_view(0), packed)
    w13, w2 = other.expert_views(0, 1)
    assert w13.shape == (2 * I, H) and w2.shape == (H, I) and w13.dtype == torch.bfloat16
    assert torch.equal(w13, packed[1, :2 * I * H].view(2 * I, H))
    assert torch.equal(w2, packed[1, 2 * I * H:].view(H, I))
    # Views alias the mapping: the creator's later write shows through, addresses match the offsets.
    assert w13.data_ptr() == other.data_ptr + other.expert_offset(0, 1)
    assert other.expert_offset(1, 0) == E * other.expert_stride
    store.expert_views(0, 1)[1].fill_(3.0)
    assert bool((w2 == 3.0).all())
    assert other.pin_for_cuda() is torch.cuda.is_available()
    other.close()
    store.close()
    store.unlink()


def test_readonly_attach_refuses_writes_and_non_owner_cannot_unlink(shm_name):
    store = make_store(shm_name)
    ro = ExpertStore.attach(shm_name)
    with pytest.raises(ShmError, match="readonly=False"):
        ro.write_layer(0, torch.zeros(E, ro.shape.expert_numel))
    with pytest.raises(ShmError, match="only by its creator"):
        ro.unlink()
    rw = ExpertStore.attach(shm_name, readonly=False)
    gate, up, down = hf_expert(1)
    rw.write_expert(0, 0, gate=gate, up=up, down=down)
    assert torch.equal(ro.expert_views(0, 0)[0][:I], gate)
    for s in (ro, rw, store):
        s.close()
    store.unlink()
    assert not os.path.exists(os.path.join(SHM_DIR, shm_name))


def test_read_only_attach_can_be_remapped_writable_in_place(shm_name):
    """What pin_for_cuda does before cudaHostRegister: same addresses, views stay valid, now writable."""
    store = make_store(shm_name)
    ro = ExpertStore.attach(shm_name)
    w13, _ = ro.expert_views(1, 1)
    address = ro.data_ptr
    ro._seg.remap_writable()
    assert not ro._seg.readonly and ro.data_ptr == address
    ctypes.memset(w13.data_ptr(), 0x3F, 2)                       # would SIGSEGV on the read-only mapping
    assert int(store.expert_views(1, 1)[0].view(torch.int16)[0, 0]) == 0x3F3F
    assert int(w13.view(torch.int16)[0, 0]) == 0x3F3F            # the old view sees the same page
    ro.close()
    store.close()
    store.unlink()


def test_shape_and_index_errors_name_the_expected_values(shm_name):
    store = make_store(shm_name)
    gate, up, down = hf_expert(2)
    with pytest.raises(ValueError, match=r"expected \(48, 64\)"):
        store.write_expert(0, 0, gate=gate.t(), up=up, down=down)
    with pytest.raises(ValueError, match="expected"):
        store.write_layer(0, torch.zeros(E, 5))
    with pytest.raises(IndexError, match="2 layers x 3 experts"):
        store.expert_views(2, 0)
    with pytest.raises(IndexError):
        store.expert_offset(0, 3)
    with pytest.raises(ValueError, match="not supported"):
        make_store(shm_name + "-x", dtype=torch.int8)
    store.close()
    store.unlink()


def test_live_creator_is_an_error_naming_it(shm_name):
    store = make_store(shm_name)
    with pytest.raises(ShmError, match=f"process {os.getpid()}.*is alive"):
        make_store(shm_name)
    store.close()
    store.unlink()


def test_stale_segment_of_a_dead_creator_is_reclaimed(shm_name, caplog):
    code = textwrap.dedent(f"""
        import os, torch
        from ftexpert.proto.expert_store import ExpertStore
        s = ExpertStore.create({shm_name!r}, num_layers=1, num_experts=1, hidden=8, intermediate=8,
                               dtype=torch.bfloat16, config_hash="old")
        os._exit(0)          # dies without unlinking
    """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)
    assert os.path.exists(os.path.join(SHM_DIR, shm_name))
    with caplog.at_level(logging.WARNING):
        store = make_store(shm_name)
    assert "reclaiming stale" in caplog.text
    assert store.meta()["config_hash"] == "cfg-1" and store.meta()["creator_pid"] == os.getpid()
    store.close()
    store.unlink()


def test_reused_pid_counts_as_dead(shm_name):
    # A header naming this very pid but another start time: the pid was reused, the creator is gone.
    with open(os.path.join(SHM_DIR, shm_name), "wb") as f:
        f.write(struct.pack("<8sIIqqq", STORE_MAGIC, STORE_VERSION, 0, os.getpid(), 1, 0).ljust(4096, b"\0"))
    store = make_store(shm_name)
    assert store.is_owner
    store.close()
    store.unlink()


def test_foreign_file_and_wrong_version_and_missing_name(shm_name):
    path = os.path.join(SHM_DIR, shm_name)
    with open(path, "wb") as f:
        f.write(b"hello" * 1000)
    with pytest.raises(ShmError, match=f"rm {path}"):
        make_store(shm_name)
    with pytest.raises(ShmError, match="is not a expert store"):
        ExpertStore.attach(shm_name)
    os.unlink(path)
    with open(path, "wb") as f:
        f.write(struct.pack("<8sIIqqq", STORE_MAGIC, 99, 0, 1, 1, 0).ljust(4096, b"\0"))
    with pytest.raises(ShmError, match="layout version 99"):
        ExpertStore.attach(shm_name)
    os.unlink(path)
    with pytest.raises(ShmError, match="start the coordinator"):
        ExpertStore.attach(shm_name)
    chan = create_channel(shm_name, ChannelLayout(4, 8, 8, "bfloat16"))
    with pytest.raises(ShmError, match="not a expert store"):
        ExpertStore.attach(shm_name)
    chan.close()
    chan.unlink()


def test_too_big_for_dev_shm_is_a_clear_error(shm_name):
    st = os.statvfs(SHM_DIR)
    free_bytes = st.f_bavail * st.f_frsize
    layers = free_bytes // (3 * 1024 ** 3) + 2          # 3 GiB experts (bf16): more than is free
    with pytest.raises(ShmError, match="shm-size"):
        make_store(shm_name, num_layers=layers, num_experts=1, hidden=32768, intermediate=16384)
    assert not os.path.exists(os.path.join(SHM_DIR, shm_name))


def test_attached_processes_share_pages_instead_of_copying(shm_name):
    """N attached readers add RSS (shared pages) but almost no private memory (USS) for the weights."""
    layers, experts, hidden, inter = 4, 8, 512, 1024                # 4 x 8 x 3 MiB = 96 MiB
    store = make_store(shm_name, num_layers=layers, num_experts=experts, hidden=hidden, intermediate=inter)
    for layer in range(layers):
        store.layer_view(layer).fill_(1.0)                             # creator touches every page
    store.mark_ready()
    reader = textwrap.dedent(f"""
        import json, psutil, torch
        from ftexpert.proto.expert_store import ExpertStore
        me = psutil.Process()
        before = me.memory_full_info()
        s = ExpertStore.attach({shm_name!r})
        total = 0.0
        for layer in range(s.num_layers):
            total += float(s.layer_view(layer).amax(dim=1).float().sum())   # reads every byte in place
        after = me.memory_full_info()
        print(json.dumps({{"rss": after.rss - before.rss, "uss": after.uss - before.uss, "total": total}}))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", reader], cwd=REPO, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    reports = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    for report in reports:
        assert report["total"] == layers * experts
        assert report["rss"] >= 0.9 * store.nbytes, report            # it did map and read the pages
        assert report["uss"] < 0.1 * store.nbytes, report             # but holds no private copy
    store.close()
    store.unlink()


@pytest.mark.parametrize("fmt", ["fp8", "int4-g32", "mxfp4", "nvfp4"])
def test_a_quantized_store_holds_one_expert_as_its_format_bytes(shm_name, fmt):
    from ftexpert.proto.expert_format import ExpertFormat, FormatError, QuantLayout
    from ftexpert.kernels.expert_reference import dequantize_expert, quantize_expert
    f = ExpertFormat.parse(fmt)
    h, i = 64, 96                                   # divisible by every group size
    store = make_store(shm_name, hidden=h, intermediate=i, fmt=fmt)
    layout = QuantLayout(h, i, f)
    assert store.expert_bytes == layout.expert_nbytes and store.layer_view(0).dtype == torch.uint8
    g = torch.Generator().manual_seed(3)
    mats = [torch.randn(i, h, generator=g), torch.randn(i, h, generator=g), torch.randn(h, i, generator=g)]
    row = quantize_expert(*mats, f)
    store.expert_bytes_view(1, 2).copy_(row)
    store.mark_ready()
    other = ExpertStore.attach(shm_name)
    assert other.expert_format == f and other.meta()["format"] == f.label
    assert torch.equal(other.layer_view(1)[2, :layout.expert_nbytes], row)
    for got, want in zip(dequantize_expert(other.expert_bytes_view(1, 2), layout), dequantize_expert(row, layout)):
        assert torch.equal(got, want)
    with pytest.raises(FormatError, match="expert_bytes_view"):
        other.expert_views(0, 0)
    other.close()
    store.close()


def test_a_format_that_cannot_hold_the_shape_is_refused(shm_name):
    from ftexpert.proto.expert_format import FormatError
    with pytest.raises(FormatError, match="does not divide the intermediate size 48"):
        make_store(shm_name, hidden=128, fmt="int4")
