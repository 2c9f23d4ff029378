"""The expert-parallel axis: the all-to-alls of a mixture of experts, through the
policy's ``ep`` rules (:class:`EPExchange`)."""

from commpress.ep.exchange import EPExchange

__all__ = ["EPExchange"]
