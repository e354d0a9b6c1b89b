"""Arithmetic every package but kv_cache shares (kv_cache, which imports no other
package of the project, keeps its own `cdiv`)."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of `b` hold `a`."""
    return -(-a // b)
