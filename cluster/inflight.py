"""In-flight transfers on the head: which nodes wait on which op, and when every host has acked.

The head numbers plans (``seq``) and ops (``op_id``), sends each plan to every host worker of the
replica, and applies an op's state change only when all hosts acked it (DESIGN.md §1); one failed host
fails the op for everyone. A ``PendingTransfer`` is that record for one op; the controller and the
storage tier make them and apply them, on the head's one thread.
"""

from __future__ import annotations

from hicache.cluster.tree import TreeNode
from hicache.workers.plan import OpKind, TransferAck, TransferOp

# A transfer's ack record before it is sent (``PendingTransfer.sent`` gives it a real one): shared immutable
# placeholders, so queuing a transfer allocates no set or list.
NOT_SENT: frozenset[int] = frozenset()  # no host acks a transfer that was not sent
NO_ERRORS: tuple[str, ...] = ()


class PendingTransfer:
    """One op in flight and the nodes whose state waits on it (in root-to-leaf order).

    ``op`` is the op as sent; ``sent`` gives it its ack record (``acked_hosts``, ``errors``), shared by
    every transfer the op carries (the controller's copy batches carry many: ``num_transfers``). A plain
    slotted class: the head makes one per L3 op and per batch of L1<->L2 copies."""

    __slots__ = ("op", "kind", "seq", "nodes", "num_hosts", "acked_hosts", "errors")
    num_transfers = 1  # transfers this op carries (the requests' view: a copy batch counts its copies)

    def __init__(self, op: TransferOp | None, seq: int, nodes: list[TreeNode], num_hosts: int,
                 kind: OpKind | None = None) -> None:
        """``op``: the op, or None until it is built (then ``kind`` says what it will be)."""
        if op is not None:
            kind = op.kind
        if kind is None:
            raise ValueError("a pending transfer needs its op or its kind")
        self.op = op
        self.kind: OpKind = kind
        self.seq = seq
        self.nodes = nodes
        self.num_hosts = num_hosts
        self.acked_hosts: set[int] | frozenset[int] = NOT_SENT  # replaced by ``sent``
        self.errors: list[str] = NO_ERRORS  # type: ignore[assignment]  # a shared placeholder until ``sent``

    def sent(self, seq: int) -> None:
        """The op left in plan ``seq``: from now on hosts ack it."""
        self.seq, self.acked_hosts, self.errors = seq, set(), []

    def fail(self, reason: str) -> None:
        """Gives up on the transfer (sent or not): it completes as failed on every host."""
        self.errors = [*self.errors, reason]  # a new list: an unsent op holds the shared placeholder
        self.acked_hosts = set(range(self.num_hosts))

    @property
    def done(self) -> bool:
        return len(self.acked_hosts) == self.num_hosts

    @property
    def ok(self) -> bool:
        return self.done and not self.errors

    def on_split(self, prefix: TreeNode, suffix: TreeNode) -> None:
        """The tree split ``suffix``; ``prefix`` now carries the first part of the same transfer."""
        self.nodes.insert(self.nodes.index(suffix), prefix)

    def record(self, ack: TransferAck) -> None:
        """Records one host's ack (once per host; for every transfer sharing this record)."""
        acked = self.acked_hosts
        if ack.host in acked:
            return  # a duplicate ack changes nothing
        if isinstance(acked, frozenset):
            raise RuntimeError(f"an ack for op {ack.op_id}, which was not sent")
        acked.add(ack.host)
        if not ack.ok:
            self.errors.append(f"host {ack.host}: {ack.error}")
