"""`PoolDoorbells`: the `DeviceDoorbell`s of one hybrid backend, one per CPU pool member, as both hand-offs use them.

The device hand-off (device_path.py) rings and joins through them; the host hand-off (host_path.py) drives the same
channels from the host, which moves their sequence numbers, so it marks the doorbells whose channel took a
host-driven call (`note_host_call`) and re-syncs them once nothing of theirs is in flight (`resync`). Between
decode steps the backend arms and disarms their watchdog, resets a re-admitted member's doorbell, and keys its
CUDA graphs on `epoch` (a graph holds the doorbells' addresses: new doorbells, new graphs).
"""
from __future__ import annotations

import torch

from ftexpert.gpu_worker.backends.hybrid.cpu_pool import CpuPool, PoolMember
from ftexpert.gpu_worker.backends.hybrid.device_doorbell import DeviceDoorbell


class PoolDoorbells:
    """pool: the CPU pool whose members' channels they drive (its deadline_s is theirs); device: theirs."""

    def __init__(self, pool: CpuPool, device: torch.device):
        self.pool, self.device = pool, device
        self.by_member: dict[int, DeviceDoorbell] = {}    # member index -> its doorbell (opened on first use)
        self.stale: set[DeviceDoorbell] = set()           # doorbells whose channel took host-driven calls
        self.epoch = 0                                    # graph_key: graphs hold the doorbells' addresses
        self.fail = torch.zeros(1, dtype=torch.int32, device=device)    # one failure flag for all of them

    def for_member(self, m: PoolMember) -> DeviceDoorbell:
        """m's doorbell, opened on first use (a new epoch)."""
        db = self.by_member.get(m.index)
        if db is None:
            db = DeviceDoorbell(m.client, self.device, member=m.index, fail=self.fail,
                                deadline_s=self.pool.deadline_s)
            self.by_member[m.index] = db
            self.epoch += 1
        return db

    def note_host_call(self, index: int) -> None:
        """Member `index`'s channel took a host-driven call: its doorbell's sequence copy is now behind."""
        db = self.by_member.get(index)
        if db is not None:
            self.stale.add(db)

    def resync(self) -> None:
        """Re-sync the stale doorbells with their channels' sequence (nothing of theirs in flight)."""
        while self.stale:
            self.stale.pop().sync_sequence()

    def reset(self, index: int) -> None:
        """Member `index` was re-admitted (its client reconnected): clear its doorbell's abort word."""
        db = self.by_member.get(index)
        if db is not None:
            db.reset()

    def reset_all(self) -> None:
        for db in self.by_member.values():
            db.reset()

    def arm(self) -> None:
        """Before a decode step: the pool's deadline (operators and tests change it live), the watchdog woken."""
        for db in self.by_member.values():
            db.deadline_s = self.pool.deadline_s
            db.arm()

    def disarm(self) -> None:
        for db in self.by_member.values():
            db.disarm()

    def close(self) -> None:
        """Close every doorbell (a new epoch)."""
        for db in self.by_member.values():
            db.close()
        self.by_member.clear()
        self.epoch += 1
