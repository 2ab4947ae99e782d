"""Teams: the ranks that reduce together and their symmetric workspace."""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

_DEFAULT_PACKET_BYTES = 16 << 20
# A CPU team over processes keeps every rank's workspace in shared memory: 3 * world_size *
# packet_bytes per rank (96 MiB a rank at world size 8).
_CPU_PACKET_BYTES = 4 << 20


class Team:
    """One rank's handle on a team; ``handle`` is what the ops take."""

    def __init__(self, handle: int):
        self.handle = int(handle)
        rank, world_size, device, peer_memory, fallback_reason = torch.ops.tpfuse.team_info(
            self.handle
        )
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.peer_memory = peer_memory
        self.fallback_reason = fallback_reason
        # True for the ranks of an in-process CPU team: their calls block until every rank has
        # made its call, so each rank needs a thread of its own.
        self.blocking_ranks_in_process = False

    @classmethod
    def from_group(
        cls,
        group: Optional["torch.distributed.ProcessGroup"] = None,
        packet_bytes: Optional[int] = None,
        peer_timeout_seconds: float = 10.0,
        backend: Optional[str] = None,
    ) -> "Team":
        """This process's rank of a team over a torch process group (collective).

        ``backend`` "cuda" (the default on a group with NCCL): a team of this process's CUDA
        device; rank 0 makes an NCCL id and the group broadcasts it. "cpu" (the default on a
        gloo group): a CPU-backend team whose ranks are the group's processes, all on this host,
        over shared memory; rank 0 makes its id. ``packet_bytes`` defaults to 16 MiB on CUDA and
        4 MiB on the CPU. The team needs the group only while it is made, and lives until
        ``close()`` (or the process ends).
        """
        import socket

        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("tpfuse.Team.from_group: torch.distributed is not initialized")
        group = group if group is not None else dist.group.WORLD
        world_size = dist.get_world_size(group)
        if world_size > 16:
            raise ValueError(f"tpfuse.Team.from_group: world size {world_size} is over 16")
        group_backends = str(dist.get_backend(group)).lower()
        if backend is None:
            if "nccl" in group_backends:
                backend = "cuda"
            elif "gloo" in group_backends:
                backend = "cpu"
            else:
                raise ValueError(
                    f"tpfuse.Team.from_group: the group's backend is {group_backends!r}; pass "
                    "backend='cuda' or backend='cpu', or use an nccl or gloo group"
                )
        rank = dist.get_rank(group)
        if backend == "cpu":
            # Shared memory reaches the processes of one host only.
            hosts = [None] * world_size
            dist.all_gather_object(hosts, socket.gethostname(), group=group)
            elsewhere = [r for r, host in enumerate(hosts) if host != hosts[0]]
            if elsewhere:
                raise ValueError(
                    f"tpfuse.Team.from_group: a CPU team's ranks must share a host; rank 0 is on "
                    f"{hosts[0]!r}, rank(s) {', '.join(map(str, elsewhere))} elsewhere"
                )
            team_id = [torch.ops.tpfuse.create_cpu_team_id() if rank == 0 else None]
            dist.broadcast_object_list(team_id, group=group, group_src=0)
            handle = torch.ops.tpfuse.create_cpu_process_team(
                team_id[0],
                rank,
                world_size,
                _CPU_PACKET_BYTES if packet_bytes is None else packet_bytes,
                peer_timeout_seconds,
            )
            return cls(handle)
        if backend != "cuda":
            raise ValueError(
                f"tpfuse.Team.from_group: backend must be 'cuda' or 'cpu', got {backend!r}"
            )
        if world_size < 2:
            raise ValueError(
                f"tpfuse.Team.from_group: the group has {world_size} rank; a CUDA team over a "
                "group needs 2 or more (tpfuse.cuda_team([device]) makes a one-rank team)"
            )
        if not torch.cuda.is_available():
            raise RuntimeError(
                "tpfuse.Team.from_group: backend 'cuda' needs CUDA (a gloo group gives a CPU team)"
            )
        device = torch.cuda.current_device()
        bound = getattr(group, "bound_device_id", None)
        if bound is not None and bound.index is not None and bound.index != device:
            raise ValueError(
                f"tpfuse.Team.from_group: the current device is cuda:{device} but the group is "
                f"bound to cuda:{bound.index}; call torch.cuda.set_device({bound.index}) first"
            )
        # Every rank on its own GPU: two ranks on one device would fail inside NCCL.
        devices = [None] * world_size
        dist.all_gather_object(devices, device, group=group)
        for other, other_device in enumerate(devices):
            if other != rank and other_device == device:
                raise ValueError(
                    f"tpfuse.Team.from_group: ranks {min(rank, other)} and {max(rank, other)} "
                    f"both use cuda:{device}; call torch.cuda.set_device(<this rank's GPU>) first"
                )
        unique_id = [torch.ops.tpfuse.create_unique_id() if rank == 0 else None]
        dist.broadcast_object_list(unique_id, group=group, group_src=0)
        handle = torch.ops.tpfuse.create_nccl_team(
            unique_id[0],
            rank,
            world_size,
            device,
            _DEFAULT_PACKET_BYTES if packet_bytes is None else packet_bytes,
            peer_timeout_seconds,
        )
        return cls(handle)

    def choose(self, tokens: int, hidden: int, dtype: torch.dtype) -> str:
        """The algorithm an op of this shape runs with algorithm=0 (auto)."""
        return torch.ops.tpfuse.choose(self.handle, tokens, hidden, dtype)

    def close(self) -> None:
        """Releases this handle (a team's memory goes with its last handle)."""
        if self.handle:
            torch.ops.tpfuse.release_team(self.handle)
            self.handle = 0

    def __repr__(self) -> str:
        return (
            f"tpfuse.Team(rank={self.rank}, world_size={self.world_size}, device={self.device}, "
            f"peer_memory={self.peer_memory!r}, fallback_reason={self.fallback_reason!r})"
        )


def cpu_team(
    world_size: int,
    packet_bytes: int = _DEFAULT_PACKET_BYTES,
    peer_timeout_seconds: float = 10.0,
) -> List[Team]:
    """A CPU-backend team: one handle per rank; each rank's ops must run on its own thread."""
    team = [
        Team(h)
        for h in torch.ops.tpfuse.create_cpu_team(world_size, packet_bytes, peer_timeout_seconds)
    ]
    for rank in team:
        rank.blocking_ranks_in_process = world_size > 1
    return team


def cuda_team(
    devices: Sequence[int],
    packet_bytes: int = _DEFAULT_PACKET_BYTES,
    peer_timeout_seconds: float = 10.0,
) -> List[Team]:
    """A team of these CUDA devices driven by this one process."""
    return [
        Team(h)
        for h in torch.ops.tpfuse.create_cuda_team(
            list(devices), packet_bytes, peer_timeout_seconds
        )
    ]
