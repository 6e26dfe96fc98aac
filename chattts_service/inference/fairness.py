"""Who gets the next row of the batch, and whose row a waiting segment may take.

The scheduler's policy, kept apart from its thread so it reads (and is tested) as rules:

1. **Classes.** A segment is ``interactive`` (someone is waiting for its sound: every segment
   of a stream, every segment of a short whole answer) or ``bulk`` (every segment of a long
   whole answer, whose sound nobody hears before its last segment ends, or of a request
   marked ``bulk``). Interactive goes first.
2. **Shares.** Within a class, the next row goes to the API key (where keys are configured)
   holding the fewest rows, then to the request holding the fewest, then to its earliest
   segment, then to the earliest arrival: requests take rows in turn, so one request's
   segments never take them all while another's wait.
3. **Taking a row back.** A waiting segment that outranks a running one takes its row at once
   rather than waiting for a segment to end: interactive over bulk, or, within a class, a key
   or request holding none over one holding two or more more than it. The segment that gives
   its row up keeps its place (its KV cache and random generator): it is paused, not redone,
   and resumes with the same samples when it gets a row again.
4. **The bulk floor.** Bulk keeps at least ``bulk_min_rows`` rows whenever it has work, so a
   steady stream of interactive requests slows a long job but never stops it. (While a stream
   waits for its first audio, the scheduler caps bulk at ``bulk_rows_while_starting`` rows.)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from chattts_service.domain.speech import BULK, INTERACTIVE

_RANK = {INTERACTIVE: 0, BULK: 1}
# A whole answer of at most this many segments (a sentence or two) is interactive; a longer one
# is bulk: its first segment going first gets nobody sound sooner, and took the rows of streams
# starting beside it.
SHORT_WHOLE_SEGMENTS = 2
# the policy in the words /admin/config shows
ORDER = (
    f"interactive (streams; whole answers of up to {SHORT_WHOLE_SEGMENTS} segments) before bulk "
    "(longer whole answers; requests marked bulk)",
    "within a class: the API key, then the request, holding the fewest rows; then the "
    "earliest segment, then the earliest arrival",
    "a waiting segment takes the row of one it outranks (interactive over bulk; a key or "
    "request holding none over one holding two or more); the other is paused, not redone",
    "bulk keeps bulk_min_rows rows whenever it has work; while a stream waits for its first "
    "audio, bulk holds at most bulk_rows_while_starting rows",
    "a bulk segment's audio is decoded when the streams hold enough audio to ride the round "
    "out, within 2 s anyway",
)


@dataclass(frozen=True)
class Share:
    """What the policy knows of a segment: its class, its API key (None: keys are off), its
    request, its place in that request, and when it arrived (a counter)."""

    priority: str
    tenant: str | None
    request: int
    index: int
    arrival: int


def segment_priority(asked: str | None, stream: bool, segments: int) -> str:
    """The class of a request's segments: as the request asked, else interactive for a
    stream's and for a whole answer of up to ``SHORT_WHOLE_SEGMENTS`` ``segments``, bulk for
    a longer whole answer's."""
    if asked is not None:
        return asked
    return INTERACTIVE if stream or segments <= SHORT_WHOLE_SEGMENTS else BULK


class Holdings:
    """Rows held (running or being prefilled) per class, key and request."""

    def __init__(self, running: list[Share]):
        self.by_priority = Counter(share.priority for share in running)
        self.by_tenant = Counter((share.priority, share.tenant) for share in running)
        self.by_request = Counter(share.request for share in running)

    def order(self, share: Share) -> tuple:
        """The sort key of a waiting segment: lower goes first."""
        return (
            _RANK[share.priority],
            self.by_tenant[(share.priority, share.tenant)],
            self.by_request[share.request],
            share.index,
            share.arrival,
        )


def next_share(
    waiting: list[Share], running: list[Share], bulk_min_rows: int, free_rows: int
) -> int | None:
    """The index in ``waiting`` of the segment that gets the next of ``free_rows`` rows (None:
    nothing waits): interactive first, then the fewest rows held; but the rows bulk is short
    of its floor are kept for bulk work that waits."""
    if not waiting:
        return None
    held = Holdings(running)
    candidates = list(range(len(waiting)))
    if free_rows <= bulk_min_rows - held.by_priority[BULK]:
        bulk = [i for i in candidates if waiting[i].priority == BULK]
        if bulk:
            candidates = bulk
    return min(candidates, key=lambda i: held.order(waiting[i]))


def outranks(waiter: Share, holder: Share, held: Holdings, bulk_min_rows: int) -> bool:
    """Whether ``waiter`` may take ``holder``'s row now."""
    if _RANK[waiter.priority] < _RANK[holder.priority]:
        return holder.priority != BULK or held.by_priority[BULK] > bulk_min_rows
    if waiter.priority != holder.priority:
        return False
    mine = held.by_tenant[(waiter.priority, waiter.tenant)]
    theirs = held.by_tenant[(holder.priority, holder.tenant)]
    if waiter.tenant != holder.tenant:
        return theirs >= mine + 2
    return held.by_request[holder.request] >= held.by_request[waiter.request] + 2


def victim(waiter: Share, running: list[Share], bulk_min_rows: int) -> int | None:
    """The index in ``running`` of the segment whose row ``waiter`` takes (None: none it
    outranks): the lowest class, then the key and request holding the most rows, then that
    request's latest segment."""
    held = Holdings(running)
    eligible = [
        i for i, share in enumerate(running) if outranks(waiter, share, held, bulk_min_rows)
    ]
    if not eligible:
        return None

    # the one that would go last were it waiting
    return max(eligible, key=lambda i: held.order(running[i]))
