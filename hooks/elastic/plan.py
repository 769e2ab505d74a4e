"""Who goes where when the job's hosts change: the pure arithmetic of a re-form.

A group's members are its ranks' hosts, rank order (`P` processes per host, so host `i` holds
ranks `i*P .. i*P+P-1`). A change names the target hosts, in the order that becomes rank order.
`ReformPlan.make(old_hosts, target_hosts, procs_per_host)` says, identically on every rank:
- which old ranks leave (their host is not in the target) and which stay;
- the new rank of every staying old rank, and the ranks joiners will take;
- the old rank of the new group's leader (new rank 0) when it is already a member, else None
  (the leader is a joiner; its address is then the membership's `store`).
Raises `ValueError` for an empty target, a duplicate host or a bad process count.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReformPlan:
    old_hosts: tuple[str, ...]
    target_hosts: tuple[str, ...]
    procs_per_host: int

    @classmethod
    def make(cls, old_hosts: tuple[str, ...] | list[str], target_hosts: tuple[str, ...] | list[str],
             procs_per_host: int = 1) -> ReformPlan:
        if procs_per_host < 1:
            raise ValueError(f"procs_per_host must be >= 1, got {procs_per_host}")
        if not target_hosts:
            raise ValueError("a re-form needs at least one target host")
        for name, hosts in (("old", old_hosts), ("target", target_hosts)):
            if len(set(hosts)) != len(hosts):
                raise ValueError(f"{name} hosts list a host twice: {list(hosts)}")
        return cls(tuple(old_hosts), tuple(target_hosts), procs_per_host)

    @property
    def old_world_size(self) -> int:
        return len(self.old_hosts) * self.procs_per_host

    @property
    def new_world_size(self) -> int:
        return len(self.target_hosts) * self.procs_per_host

    @property
    def leaving_hosts(self) -> tuple[str, ...]:
        return tuple(h for h in self.old_hosts if h not in self.target_hosts)

    @property
    def joining_hosts(self) -> tuple[str, ...]:
        return tuple(h for h in self.target_hosts if h not in self.old_hosts)

    @property
    def changes(self) -> bool:
        """Whether the group's host set changes at all (an equal set in another order does not)."""
        return set(self.old_hosts) != set(self.target_hosts)

    def host_of(self, old_rank: int) -> str:
        return self.old_hosts[old_rank // self.procs_per_host]

    def leaves(self, old_rank: int) -> bool:
        return self.host_of(old_rank) not in self.target_hosts

    def new_rank(self, old_rank: int) -> int | None:
        """The rank `old_rank` takes in the new group; None when it leaves."""
        host = self.host_of(old_rank)
        if host not in self.target_hosts:
            return None
        return self.target_hosts.index(host) * self.procs_per_host + old_rank % self.procs_per_host

    def joiner_rank(self, host: str, local_rank: int) -> int:
        """The rank a joiner on `host` takes (ValueError when the target does not list it)."""
        return self.target_hosts.index(host) * self.procs_per_host + local_rank

    @property
    def leader_old_rank(self) -> int | None:
        """The old rank of the new group's rank 0, or None when rank 0 is a joiner."""
        host = self.target_hosts[0]
        if host not in self.old_hosts:
            return None
        return self.old_hosts.index(host) * self.procs_per_host

    @property
    def survivors(self) -> tuple[int, ...]:
        """Old ranks that stay, by old rank."""
        return tuple(r for r in range(self.old_world_size) if not self.leaves(r))

    @property
    def first_survivor_old_rank(self) -> int:
        """The old rank of the first staying host's first process (target order)."""
        host = next(h for h in self.target_hosts if h in self.old_hosts)
        return self.old_hosts.index(host) * self.procs_per_host

    def survivor_rank(self, old_rank: int) -> int:
        """`old_rank`'s rank in a group of the survivors alone (target order): the fallback's."""
        staying = [h for h in self.target_hosts if h in self.old_hosts]
        return staying.index(self.host_of(old_rank)) * self.procs_per_host + old_rank % self.procs_per_host
