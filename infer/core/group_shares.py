"""The batch shared among groups: the n sequences of one API request enter it in waves.

An API request with n choices (or several prompts) becomes that many engine requests with one group_id.
Admitted as they come, 128 of them would take every seat of the batch, and every other client would
wait for the whole group. The seats are shared out max-min fairly among the unfinished requests
(running or waiting):

  - a request outside any group needs one seat and gets it;
  - the groups split what is left alike (`share` each), less one seat kept free for the next
    arrival: all groups together hold at most max_num_seqs - singles - 1 (`room`), and where the
    singles leave no room, one group runs one sequence at a time (so that groups too progress);
  - a group's sequence past its share waits, and requests behind it may pass; the group's running
    sequences run to their end, and then its next wave gets in. So every sequence completes.

A group alone thus runs in waves of max_num_seqs - 1; two groups and a stream beside them get
(max_num_seqs - 2) // 2 seats each, and the stream one. A group of one unfinished request (a client's
only request, where the server groups a client's requests) is a single.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from infer.core.request import Request


def crowded_groups(requests: Iterable[Request]) -> set[str]:
    """The groups of more than one of these requests: the others' requests count as singles."""
    counts = Counter(req.group_id for req in requests if req.group_id is not None)
    return {group for group, count in counts.items() if count > 1}


class GroupShares:
    """Computed once per schedule() from the running and waiting requests; `admitted` keeps it current
    as the step admits."""

    def __init__(self, max_num_seqs: int, running: list[Request], waiting: list[Request]) -> None:
        self.crowded = crowded_groups([*running, *waiting])
        self.running: dict[str, int] = {}  # group_id -> its running sequences
        num_single = 0
        for req in running:
            if req.group_id not in self.crowded:
                num_single += 1
            else:
                self.running[req.group_id] = self.running.get(req.group_id, 0) + 1
        groups = set(self.running)
        for req in waiting:
            if req.group_id not in self.crowded:
                num_single += 1
            else:
                groups.add(req.group_id)
        seats = max_num_seqs - num_single - 1  # for the groups, one kept free for the next arrival
        self.share = max(1, seats // len(groups)) if groups else max_num_seqs
        self.room = seats - sum(self.running.values())

    def may_admit(self, req: Request) -> bool:
        if req.group_id not in self.crowded:
            return True
        held = self.running.get(req.group_id, 0)
        # where the singles fill the batch, one group still runs a sequence at a time: groups progress
        return held < self.share and (self.room > 0 or not any(self.running.values()))

    def admitted(self, req: Request) -> None:
        if req.group_id in self.crowded:
            self.running[req.group_id] = self.running.get(req.group_id, 0) + 1
            self.room -= 1
