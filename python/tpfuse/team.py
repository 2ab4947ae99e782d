"""Teams: the ranks that reduce together and their symmetric workspace."""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

_DEFAULT_PACKET_BYTES = 16 << 20
# A CPU team over processes keeps every rank's workspace in shared memory: 3 * world_size *
# packet_bytes per rank (96 MiB a rank at world size 8).
_CPU_PACKET_BYTES = 4 << 20


# Setup exchanges over the group use tensor collectives: torch's object collectives
# (broadcast_object_list, all_gather_object) need numpy, which tpfuse does not.
def _group_device(group) -> torch.device:
    """Where the group's collectives take tensors: the CPU on a group with gloo, else this
    process's CUDA device."""
    import torch.distributed as dist

    if "gloo" in str(dist.get_backend(group)).lower() or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _broadcast_bytes(made: Optional[torch.Tensor], group) -> torch.Tensor:
    """Rank 0's uint8 tensor ``made`` (None on the other ranks) on every rank, on the CPU."""
    import torch.distributed as dist

    device = _group_device(group)
    length = torch.tensor([made.numel() if made is not None else 0], device=device)
    dist.broadcast(length, group=group, group_src=0)
    if made is not None:
        data = made.to(device)
    else:
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, group=group, group_src=0)
    return data.cpu()


def _all_gather(values: torch.Tensor, group) -> List[torch.Tensor]:
    """Every rank's ``values`` (the same shape and dtype on every rank), in rank order, on the
    CPU."""
    import torch.distributed as dist

    mine = values.to(_group_device(group))
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return [t.cpu() for t in gathered]


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
            name = bytearray(socket.gethostname().encode()[:255].ljust(256, b"\0"))
            hosts = _all_gather(torch.frombuffer(name, dtype=torch.uint8), group)
            hosts = [bytes(host.tolist()).rstrip(b"\0").decode(errors="replace") for host in hosts]
            elsewhere = [r for r, host in enumerate(hosts) if host != hosts[0]]
            if elsewhere:
                raise ValueError(
                    f"tpfuse.Team.from_group: a CPU team's ranks must share a host; rank 0 is on "
                    f"{hosts[0]!r}, rank(s) {', '.join(map(str, elsewhere))} elsewhere"
                )
            made = torch.ops.tpfuse.create_cpu_team_id() if rank == 0 else None
            handle = torch.ops.tpfuse.create_cpu_process_team(
                _broadcast_bytes(made, group),
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
        devices = [int(d) for d in _all_gather(torch.tensor([device]), group)]
        for other, other_device in enumerate(devices):
            if other != rank and other_device == device:
                raise ValueError(
                    f"tpfuse.Team.from_group: ranks {min(rank, other)} and {max(rank, other)} "
                    f"both use cuda:{device}; call torch.cuda.set_device(<this rank's GPU>) first"
                )
        made = torch.ops.tpfuse.create_unique_id() if rank == 0 else None
        handle = torch.ops.tpfuse.create_nccl_team(
            _broadcast_bytes(made, group),
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
