"""Which embedding rows eviction removes. Combine with ``|``."""

from wuliang.ps_server.spec import Eviction


def TTL(*, steps: int = 0, seconds: int = 0) -> Eviction:
    """Rows not updated for more than `steps` steps or `seconds` seconds.

    Steps count back from the step an evict runs at. Seconds count back from
    the parameter server's clock, the time (unix seconds) it also stamps on
    every row it updates: the wall clock unless ``set_clock`` sets one. A
    trainer that follows time-partitioned data sets it to the time of the
    partition it trains, so that the TTL runs on the data's time: replaying
    a month of old partitions in an hour evicts nothing live, and a trainer
    that resumes after a week evicts nothing for the days it was down.
    """
    if not steps and not seconds:
        raise ValueError("TTL needs steps or seconds")
    return Eviction(ttl_steps=steps, ttl_seconds=seconds)


def MinCount(n: int) -> Eviction:
    """Rows seen fewer than n times and not updated since the previous evict."""
    return Eviction(min_count=n)


def MaxRows(n: int) -> Eviction:
    """At most n rows: the least frequently seen go first."""
    if n < 1:
        raise ValueError(f"MaxRows needs n >= 1, got {n!r}")
    return Eviction(max_rows=n)


__all__ = ["TTL", "Eviction", "MaxRows", "MinCount"]
