"""The built-in drivers, registered in ``server.drivers`` when this module is imported.

- ``sync``: synchronous rounds, plain replies or a SecAgg+ sum (``server.sync_rounds``);
- ``fedbuff`` and ``fedasync``: asynchronous buffers of K updates, or one update mixed in
  at a time (``server.fedbuff``);
- ``cross_silo``: the silos sum their updates over a ring (``server.cross_silo``);
- ``gossip``: each silo averages its model with its neighbours' (``server.gossip``).

Their rules are in ``server.settings_checks``; ``Secure``: the run's secure aggregation.
"""

from __future__ import annotations

from server import settings_checks as rules
from server.compression import ReplyCompression
from server.cross_silo_config import GossipConfig, SiloConfig
from server.drivers import Builder, DriverSpec, register_driver
from server.fedbuff import FedBuffRounds
from server.rounds import RoundSource, RunContext
from server.secure_aggregation import SecureAggregation as Secure
from server.secure_sync import SecureSum
from server.sync_rounds import PlainReplies, SyncRounds


def _compression(ctx: RunContext, secure: Secure | None) -> ReplyCompression:
    return ReplyCompression.of(ctx.scenario.compression, secure=secure is not None)


def build_sync(ctx: RunContext, secure: Secure | None) -> RoundSource:
    """Synchronous rounds: a SecAgg+ sum when ``secure`` is given, else plain replies."""
    collector = (SecureSum(ctx, secure) if secure is not None
                 else PlainReplies(ctx, _compression(ctx, secure)))
    return SyncRounds(ctx, collector)


def _buffered(mixing: bool) -> Builder:
    """FedBuff's buffers, or FedAsync's mixing of one update at a time."""
    def build(ctx: RunContext, secure: Secure | None) -> RoundSource:
        return FedBuffRounds(ctx, weight_by=ctx.scenario.aggregation.weight_by,
                             compression=_compression(ctx, secure), secure=secure,
                             mixing=mixing)

    return build


def build_cross_silo(ctx: RunContext, secure: Secure | None) -> RoundSource:
    """The silos aggregate among themselves over a ring (a secure one with ``secure``)."""
    from server.cross_silo import CrossSiloRounds
    from server.cross_silo_secure import SecureRing

    scenario = ctx.scenario
    return CrossSiloRounds(ctx, silo=scenario.silo, aggregation=scenario.aggregation,
                           ring=SecureRing(secure) if secure is not None else None)


def build_gossip(ctx: RunContext, secure: Secure | None) -> RoundSource:
    """Each silo averages its own model with its neighbours' (never secure: refused)."""
    from server.cross_silo import CrossSiloRounds
    from server.gossip import GossipCollector

    scenario = ctx.scenario
    return CrossSiloRounds(ctx, silo=scenario.silo, aggregation=scenario.aggregation,
                           ring=GossipCollector(scenario.gossip))


for _spec in (
    DriverSpec("sync", build_sync, secure=True, secure_evaluation=True),
    DriverSpec("fedasync", _buffered(mixing=True), asynchronous=True, secure_evaluation=True,
               rules=(rules.check_fedasync, rules.check_async_without_dp,
                      rules.check_fedasync_without_secagg, rules.check_async_late_policy)),
    DriverSpec("fedbuff", _buffered(mixing=False), asynchronous=True, secure=True,
               secure_evaluation=True, rules=(rules.check_fedbuff, rules.check_async_without_dp,
                                              rules.check_async_late_policy)),
    DriverSpec("cross_silo", build_cross_silo, section=SiloConfig, silos=True, secure=True,
               rules=(rules.check_cross_silo,)),
    DriverSpec("gossip", build_gossip, section=GossipConfig, silos=True,
               early_rules=(rules.check_gossip_settings,), rules=(rules.check_gossip,)),
):
    register_driver(_spec)
