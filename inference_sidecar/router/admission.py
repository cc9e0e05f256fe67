"""Admission: how many completion requests the router serves at once, and how many bytes
of request bodies it holds, being read or being served.

A request takes a slot only once its body has arrived: a client that uploads slowly
(or never finishes) holds no slot, so it cannot keep other clients out; its body read has
a deadline instead (``RouterConfig.body_timeout_s``). What it does hold, the bytes it has
sent, counts against ``body_budget``, which bounds the memory of bodies however many
clients upload at once. Pure bookkeeping: the HTTP layer (``app``) asks and gives back.
"""

from __future__ import annotations


class Admission:
    """Slots for requests being served and a budget of body bytes held."""

    def __init__(self, slots: int, body_budget: int) -> None:
        if slots < 1 or body_budget < 1:
            raise ValueError("slots and body_budget must be >= 1")
        self.slots = slots
        self.body_budget = body_budget
        self.serving = 0
        """Requests holding a slot."""
        self.body_bytes = 0
        """Bytes of request bodies held: being read, or of requests being served."""

    @property
    def full(self) -> bool:
        return self.serving >= self.slots

    def take_slot(self) -> bool:
        """A slot for a request whose body has arrived; False when all are taken."""
        if self.full:
            return False
        self.serving += 1
        return True

    def release_slot(self) -> None:
        self.serving = max(0, self.serving - 1)

    def hold(self, n: int) -> bool:
        """Count ``n`` more body bytes; False (nothing counted) past the budget."""
        if self.body_bytes + n > self.body_budget:
            return False
        self.body_bytes += n
        return True

    def release(self, n: int) -> None:
        self.body_bytes = max(0, self.body_bytes - n)
