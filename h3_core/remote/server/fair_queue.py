"""The wait queue in front of the model thread: fair across clients, FIFO within one client.

One FIFO lets a client that sends 100 requests at once make everybody else wait for all of them. Here every client
(its key: the peer address, or the address a trusted proxy forwarded, see `service.client_key`) has its own FIFO, and
the next job comes from the client served *least recently*: clients take turns (round robin), and a client that
was idle, or is new, goes before the clients that were served since. "Least recently served" rather than a plain
rotation matters in two cases:

* a client that has just been served and sends its next request at once (a closed loop) goes to the back, so it
  cannot monopolise the model thread by always arriving at an empty queue;
* a client with one request arriving while another floods waits for the running job and its own, not for a turn
  of the flooder first.

Batches (`take_batch`, for text encodes that share one forward) take turns too. The batch formed in a client's
turn holds up to its *fair share* of that client's jobs, `max(1, max_batch // active)`, then the other clients'
next jobs in turn order (their next turns, taken early), at most as many of each as of the owner's: every client
in a batch gets the same quantum. `active` counts the clients with a job queued, or seen (a request arrived, was
taken or answered) in the last `share_window_s` seconds (0.25): a client that sends its next request when the
previous is answered is never queued at the moment the next batch is formed, yet it is about to be. So a client
alone on the server keeps full batches (throughput); 16 clients with a request each share batches of 8, one job
each; two flooding clients share batches of 4 + 4; a flood while a light client comes and goes takes batches of 4
in its turns and rides with one job in the light client's, so the light client's next request waits for a short
forward, not for a full batch of the flood's, and its own forward stays small.

A batch in client A's turn that took client B's next job early used B's turn: A is next in line (`expects_next`),
though a client that sends its next request only once answered is never queued at the instant its answer leaves.
So the model thread waits briefly for A's next request before starting B's turn (`wait_for_next`), at most
`anticipate_s` (10 ms), for a client whose last request came that soon after its answer or that has no record
yet; one that let such a wait run out is not waited for again until it comes back that quickly.

Every method runs on the event-loop thread. Sizes are bounded by the service's queue capacity. Time (the window,
think times, the wait) comes from the injected `clock.Clock`, the service's: tests drive it by hand.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import math
from typing import Any, Callable, Iterator

from .clock import SYSTEM_CLOCK, Clock

MAX_REMEMBERED = 4096  # idle clients whose last service time is kept (see `_forget_idle`)
SHARE_WINDOW_S = 0.25  # a client seen this recently still counts as sharing the server (see `fair_share`)


class FairQueue:
    """Jobs (anything with a `client` attribute) waiting for the model thread."""

    def __init__(self, share_window_s: float = SHARE_WINDOW_S, clock: Clock = SYSTEM_CLOCK):
        self._queues: dict[str, collections.deque] = {}
        self._last_served: dict[str, int] = {}  # client -> tick of its last job taken; absent: never (or long ago)
        self._first_seen: dict[str, int] = {}  # queued client -> arrival tick, orders never-served clients
        self._ticks = itertools.count(1)
        self._arrivals = itertools.count(1)
        self._size = 0
        self.share_window_s = float(share_window_s)
        self._clock = clock
        self._seen: dict[str, float] = {}  # client -> last time it pushed, was taken or was answered (recent only)
        self._answered: dict[str, float] = {}  # recent client -> when its last answer left, until it sends again
        self._think: dict[str, float] = {}  # recent client -> seconds from its last answer to its next request
        self._expected: tuple[str, asyncio.Event] | None = None  # the client `wait_for_next` waits for

    # --- size and order --------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def clients(self) -> dict[str, int]:
        """Queued jobs per client (clients with none are not listed)."""
        return {client: len(queue) for client, queue in self._queues.items()}

    def _rank(self, client: str) -> tuple[int, int]:
        return self._last_served.get(client, 0), self._first_seen[client]

    def __iter__(self) -> Iterator[Any]:
        """The queued jobs in the order they would be taken if nothing else arrived."""
        heap = [(self._rank(client), client) for client in self._queues]
        heapq.heapify(heap)
        cursors = {client: iter(queue) for client, queue in self._queues.items()}
        tick = 1 << 62  # later than any real tick: every client served in this simulation goes behind the rest
        while heap:
            _, client = heapq.heappop(heap)
            job = next(cursors[client], None)
            if job is None:
                continue
            yield job
            tick += 1
            heapq.heappush(heap, ((tick, 0), client))

    def position(self, job: Any) -> int | None:
        """Jobs taken before `job` if nothing else arrives; None when it is not queued."""
        queue = self._queues.get(job.client)
        if queue is None or job not in queue:
            return None
        for index, queued in enumerate(self):
            if queued is job:
                return index
        return None  # pragma: no cover - unreachable: a queued job is always in the order

    # --- changes ---------------------------------------------------------------------------------

    def push(self, job: Any) -> None:
        client = job.client
        queue = self._queues.get(client)
        if queue is None:
            queue = self._queues[client] = collections.deque()
            self._first_seen[client] = next(self._arrivals)
        queue.append(job)
        self._size += 1
        answered = self._answered.pop(client, None)
        if answered is not None:
            self._think[client] = self._clock.monotonic() - answered
        self.seen(client)
        if self._expected is not None and self._expected[0] == client:
            self._expected[1].set()

    def pop(self) -> Any:
        """The next job: the oldest of the least recently served client that has one. IndexError when empty."""
        if not self._queues:
            raise IndexError("pop from an empty FairQueue")
        client = min(self._queues, key=self._rank)
        job = self._take(client, 0)
        self._last_served[client] = next(self._ticks)
        self.seen(client)
        self._forget_idle()
        return job

    def remove(self, job: Any) -> bool:
        """Take `job` out (its waiters gave up); False when it was not queued."""
        queue = self._queues.get(job.client)
        if queue is None:
            return False
        try:
            index = queue.index(job)
        except ValueError:
            return False
        self._take(job.client, index)
        return True

    def take_matching(self, accept: Callable[[Any], bool], limit: int, owner: str | None = None,
                      own_limit: int | None = None, other_limit: int = 1) -> list[Any]:
        """Up to `limit` queued jobs that `accept`, in the order they would be taken, removed from the queue.

        For batching the turn of `owner`'s job: at most `own_limit` more of `owner`'s own jobs (no bound when None)
        and at most `other_limit` of each other client's (their next turn, taken early); `take_batch` sets both.
        So a client with one request does not wait for a full batch of a flooding client's jobs in its own turn,
        and 16 clients with a request each still share one forward. Their clients count as served.
        """
        chosen: list[Any] = []
        taken: collections.Counter[str] = collections.Counter()
        for job in self:
            if len(chosen) >= limit:
                break
            cap = own_limit if job.client == owner else other_limit
            if (cap is None or taken[job.client] < cap) and accept(job):
                chosen.append(job)
                taken[job.client] += 1
        for job in chosen:
            self.remove(job)
            self._last_served[job.client] = next(self._ticks)
            self.seen(job.client)
        return chosen

    def take_batch(self, accept: Callable[[Any], bool], max_batch: int, owner: str) -> list[Any]:
        """The rest of a batch whose first job, `owner`'s, was just popped (the rule: module docstring).

        Up to a fair share of `owner`'s jobs in all, then the other clients' next jobs in turn order, at most as many
        of each as of `owner`'s: every client in the batch gets the owner's quantum.
        """
        share = self.fair_share(owner, max_batch)
        own = self.take_matching(accept, share - 1, owner, own_limit=share - 1, other_limit=0)
        quantum = 1 + len(own)
        return own + self.take_matching(accept, max_batch - quantum, owner, own_limit=0, other_limit=quantum)

    # --- sharing -----------------------------------------------------------------------------------

    def seen(self, client: str) -> None:
        """`client` is using the server now (a request arrived or was taken)."""
        self._seen.pop(client, None)  # re-inserted last: the dict stays ordered oldest first
        self._seen[client] = self._clock.monotonic()
        self._forget_gone()

    def answered(self, client: str) -> None:
        """A job of `client` was answered now: it still shares the server, and its think time starts."""
        self.seen(client)
        self._answered[client] = self._seen[client]

    def active_clients(self) -> set[str]:
        """Clients with a job queued, or seen within the last `share_window_s` seconds."""
        self._forget_gone()
        return set(self._seen) | set(self._queues)

    def expects_next(self, client: str, window: float) -> bool:
        """True when `client` is next in line and quick: its last request came within `window` s of its previous
        answer, or it has no such record yet (a wait that missed records it as slow, see `wait_for_next`).

        Next in line: `client` has nothing queued, yet a job of it arriving now would be taken before any queued
        job. That happens after a batch in `client`'s turn took the other clients' next jobs early: their turns
        were had. The service then waits up to `window` for `client`'s next request (see the module docstring).
        """
        if self._think.get(client, 0.0) > window or client in self._queues or not self._queues:
            return False
        following = min(self._queues, key=self._rank)
        return self._last_served.get(client, 0) < self._last_served.get(following, 0)

    async def wait_for_next(self, client: str, window: float) -> bool | None:
        """Wait up to `window` s for `client`'s next job when `expects_next`: True if it came, False if not, None
        when not expected (no wait)."""
        if not self.expects_next(client, window):
            return None
        arrived = asyncio.Event()
        self._expected = (client, arrived)
        try:
            await self._clock.wait_for(arrived.wait(), window)
            return True
        except asyncio.TimeoutError:
            self._think[client] = math.inf  # not waited for again until it comes back quickly
            return False
        finally:
            self._expected = None

    def fair_share(self, client: str, max_batch: int) -> int:
        """The most jobs of one client a batch in `client`'s turn may hold: `max(1, max_batch // active clients)`.

        `client` counts as active. Alone (nobody else queued or seen within the window) it gets the full batch.
        """
        active = len(self.active_clients() | {client})
        return max_batch if active <= 1 else max(1, max_batch // active)

    def push_out_for(self, client: str) -> Any | None:
        """The job to refuse so that `client` gets a slot in a full queue, or None if `client` should wait.

        The newest job of the client with the most queued jobs, when that client holds at least two more than
        `client` does: a flood is trimmed from its tail, and a client that holds no more than its share keeps
        its place. The job is removed; the caller answers its waiters (429, retry later).
        """
        mine = len(self._queues.get(client, ()))
        heaviest = max(self._queues, key=lambda c: (len(self._queues[c]), self._first_seen[c]), default=None)
        if heaviest is None or heaviest == client or len(self._queues[heaviest]) < mine + 2:
            return None
        return self._take(heaviest, len(self._queues[heaviest]) - 1)

    def clear(self) -> list[Any]:
        jobs = [job for queue in self._queues.values() for job in queue]
        self._queues.clear()
        self._first_seen.clear()
        self._size = 0
        return jobs

    # --- internals -------------------------------------------------------------------------------

    def _forget_gone(self) -> None:
        """Drop the clients not seen within the window (oldest first): the sharing records stay small."""
        horizon = self._clock.monotonic() - self.share_window_s
        while self._seen:
            client, when = next(iter(self._seen.items()))
            if when >= horizon:
                break
            del self._seen[client]
            self._answered.pop(client, None)
            self._think.pop(client, None)

    def _take(self, client: str, index: int) -> Any:
        queue = self._queues[client]
        job = queue[index]
        del queue[index]
        self._size -= 1
        if not queue:
            del self._queues[client]
            del self._first_seen[client]
        return job

    def _forget_idle(self) -> None:
        """Drop the oldest service times of idle clients once too many are kept.

        Forgetting a client's time only matters against queued clients served *before* it, and a client is
        forgotten only once it is older than every queued client: it then ranks exactly as a new client would.
        """
        if len(self._last_served) <= MAX_REMEMBERED:
            return
        oldest_queued = min((self._last_served.get(c, 0) for c in self._queues), default=1 << 62)
        for client, tick in list(self._last_served.items()):
            if tick < oldest_queued and client not in self._queues:
                del self._last_served[client]
