"""When a new key gets an embedding row."""

from wuliang.ps_server.spec import Admission


def MinCount(n: int, *, pending_capacity: int = 1 << 20) -> Admission:
    """Admit a key on its n-th training pull (see Admission)."""
    return Admission(min_count=n, pending_capacity=pending_capacity)


__all__ = ["Admission", "MinCount"]
