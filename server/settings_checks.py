"""Cross-section settings checks of a scenario: combinations that cannot run fail at start.

Each section's own keys are checked by its typed dataclass (``server.config``,
``server.driver_config``, ``server.secagg_config``, ...); what depends on several
sections lives here and reads the typed scenario (``server.scenario.ServerScenario``), in
the order :func:`check_settings` applies it, so that the first message names the key to
change. A driver's and a combine's own rules are declared with their registry entries
(``server.drivers``, ``aggregation.registry``); the built-in drivers' rules are here.
``simulations.config`` applies them when it resolves a scenario (after
:func:`resolve_secure_qsgd`), and the ServerApp again at start, for a configuration made by
hand.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aggregation.registry import combine_spec
from privacy.dp.distributed import MAX_BITS as DISTRIBUTED_MAX_BITS
from privacy.secagg import max_scale
from privacy.secagg.quantize import max_level
from server.cohort import evaluation_cohort_size
from server.compression import SECURE_MIN_BITS, compression_config
from server.config import CLIENT_SIDE_COMBINE, LINEAR_COMBINES, AuditConfig
from server.cross_silo_config import GOSSIP
from server.dp import dp_controller
from server.driver_config import FEDASYNC_SECAGG, DriverConfig
from server.drivers import DriverSpec, driver
from server.scenario import ServerScenario
from server.secagg_config import MIN_LEVEL_BITS, SecAggScenarioConfig, max_round_size


def check_settings(scenario: ServerScenario) -> None:
    """Every cross-section rule of a resolved scenario, in order (ValueError naming the
    key): the built-in ones, the driver's and the robust combine's."""
    spec = driver(scenario.driver.kind)
    check_compression(scenario, spec)
    for rule in spec.early_rules:  # before [dp]: the driver's own message says why
        rule(scenario)
    check_dp(scenario)
    check_driver(scenario, spec)  # cross_silo's before [secagg]: the ring's own message
    check_secagg(scenario, spec)
    check_audit(scenario)
    check_dp_sgd(scenario)
    check_evaluation(scenario, spec)
    if scenario.aggregation.combine not in LINEAR_COMBINES:
        for rule in combine_spec(scenario.aggregation.combine).rules:
            rule(scenario)


def resolve_secure_qsgd(config: dict[str, Any], raw_secagg: Mapping[str, Any]) -> None:
    """With secagg and QSGD, resolve ``[secagg]``'s ``bits`` and ``rounding`` in a resolved
    ``config`` (``raw_secagg``: the ``[secagg]`` keys the user wrote): stochastic rounding
    and the smallest modulus for ``compression.bits`` levels; ValueError for what cannot
    be resolved. Applied before the typed scenario is built and checked."""
    cfg = compression_config(config)
    secure = SecAggScenarioConfig.from_dict(config.get("secagg")).enabled
    kind = DriverConfig(**dict(config.get("driver") or {})).kind
    if not (cfg.enabled and secure and cfg.kind != "topk") or driver(kind).silos:
        return  # the silo drivers refuse compression with their own messages
    if dict(config.get("dp") or {}).get("mode") == "distributed":
        raise ValueError("compression.kind = 'qsgd' with dp.mode = 'distributed': distributed "
                         "DP picks its own integer encoding; set compression.kind = 'none'")
    if cfg.bits < SECURE_MIN_BITS:
        raise ValueError(f"compression.bits = {cfg.bits} with secagg: the secure sum keeps at "
                         f"least {SECURE_MIN_BITS} bits per coordinate; set compression.bits "
                         f">= {SECURE_MIN_BITS}, or turn secagg off")
    for key in ("bits", "scale"):
        if key in raw_secagg:
            raise ValueError(f"compression.kind = 'qsgd' with secagg sets secagg.{key} from "
                             f"compression.bits: drop secagg.{key}")
    if raw_secagg.get("rounding", "stochastic") != "stochastic":
        raise ValueError("compression.kind = 'qsgd' rounds stochastically (unbiased): drop "
                         "secagg.rounding = 'nearest'")
    secagg = config["secagg"]
    settings = SecAggScenarioConfig.from_dict(secagg)
    n = max(2, max_round_size(config))
    cap = settings.weight_cap(config["aggregation"]["weight_by"])
    c = settings.start_range
    need = next((b for b in range(SECURE_MIN_BITS, 65)
                 if max_level(c, max_scale(n, b, c, cap), cap) >= 1 << cfg.bits), None)
    if need is None:
        raise ValueError(f"compression.bits = {cfg.bits}: no secagg modulus up to 2^64 gives "
                         f"{n} clients that many levels; lower compression.bits")
    secagg.update(bits=need, rounding="stochastic")


def check_compression(scenario: ServerScenario, spec: DriverSpec) -> None:
    """Refuse compression settings that cannot work (secure QSGD's modulus is resolved
    before, by :func:`resolve_secure_qsgd`)."""
    cfg = scenario.compression
    if not cfg.enabled or spec.silos:
        return  # the silo drivers refuse it with their own messages
    if cfg.shared_pattern and scenario.driver.late_policy == "carry":
        raise ValueError("compression.shared_pattern ties the coordinates to one round, so a "
                         "late update carried into the next round would not line up: set "
                         "driver.late_policy = 'drop'")
    if not scenario.secagg.enabled or cfg.kind != "topk":
        return
    if not cfg.shared_pattern:
        raise ValueError("compression.kind = 'topk' with secagg: each client keeps other "
                         "coordinates, so the masked sum cannot line up; set "
                         "compression.shared_pattern = true (every client sends the same "
                         "coordinates) or use compression.kind = 'qsgd'")
    if scenario.dp.mode == "distributed":
        raise ValueError("compression.shared_pattern with dp.mode = 'distributed': "
                         "distributed DP encodes the whole vector; set compression.kind = "
                         "'none' or dp.mode = 'central'")


def check_dp(scenario: ServerScenario) -> None:
    """Combinations that would break the privacy analysis fail at start."""
    dp, agg = scenario.dp, scenario.aggregation
    if not dp.enabled:
        return
    secure = scenario.secagg.enabled
    if dp.mode == "distributed":
        if not secure:
            raise ValueError("dp.mode='distributed' adds integer noise under secure "
                             "aggregation: set secagg.enabled = true (or use dp.mode='central')")
        if dp.adaptive:
            raise ValueError("dp.clip='adaptive' needs a noised count of clipped clients, "
                             "which distributed DP does not compute: set a numeric dp.clip")
        bits = scenario.secagg.bits
        if bits > DISTRIBUTED_MAX_BITS:
            raise ValueError(f"secagg.bits = {bits}: distributed DP decodes integer sums "
                             f"exactly only up to {DISTRIBUTED_MAX_BITS} bits; set secagg.bits "
                             f"<= {DISTRIBUTED_MAX_BITS}")
    if dp.mode == "central" and dp.adaptive and secure:
        raise ValueError("dp.clip='adaptive' needs the server to count the clipped updates, "
                         "which it cannot see under secure aggregation: set a numeric dp.clip "
                         "or turn secagg off")
    if dp.mode == "local" and agg.weight_by != "uniform" and not secure:  # else refused
        raise ValueError("local DP protects each client's noised update, but weighting by "
                         "example count would build the model from counts the clients send "
                         "in the clear, unprotected: set aggregation.weight_by = 'uniform'")
    if dp.mode in ("central", "distributed"):
        if agg.weight_by != "uniform":
            raise ValueError(f"{dp.mode} DP bounds each client's effect on the sum by the clip "
                             "norm, which weighting by example count breaks: set "
                             "aggregation.weight_by = 'uniform'")
        client_side = secure and agg.combine == CLIENT_SIDE_COMBINE  # a mean on the server
        if agg.combine not in ("mean", "sum") and not client_side:
            raise ValueError(f"{dp.mode} DP noises a sum of clipped updates; "
                             f"aggregation.combine='{agg.combine}' is not a sum: use 'mean'"
                             f" (or, with secagg on, '{CLIENT_SIDE_COMBINE}': the clients "
                             "clip around the previous aggregate before the DP clip)")
    check_dp_sampling(scenario)
    dp_controller(dp, scenario.federation)  # the accountant refuses unsupported pairs


def check_dp_sampling(scenario: ServerScenario) -> None:
    """Features under which the cohorts are not the uniform draw the accountant charges
    (who can be sampled would depend on earlier secret cohorts, or a Poisson cohort would
    be cut to a size) fail at start; see ``server.dp``."""
    driver_, fed = scenario.driver, scenario.federation
    if driver_.late_policy == "carry":
        raise ValueError("driver.late_policy = 'carry' with [dp]: a carried update enters a "
                         "later round's sum and its client is left out of the cohorts "
                         "meanwhile, which the privacy accountant does not model; set "
                         "driver.late_policy = 'drop'")
    if scenario.clients.offline_fraction > 0:
        raise ValueError("clients.offline_fraction > 0 with [dp]: cohorts would be drawn from "
                         "the clients online at a time that depends on earlier cohorts, "
                         "which the privacy accountant does not model; set "
                         "clients.offline_fraction = 0")
    cap = driver_.concurrency
    if fed.sampling == "poisson" and 0 < cap < fed.clients:
        raise ValueError(f"driver.concurrency = {cap} with [dp] and federation.sampling = "
                         "'poisson': cutting a Poisson cohort to a cap is no longer Poisson "
                         "sampling, which the accountant charges; set driver.concurrency = 0 "
                         "or federation.sampling = 'fixed'")


def check_driver(scenario: ServerScenario, spec: DriverSpec) -> None:
    """``[driver]``'s cross-section checks: the concurrency, then the driver's own rules."""
    driver_, fed = scenario.driver, scenario.federation
    if driver_.concurrency > fed.clients:
        raise ValueError(f"driver.concurrency ({driver_.concurrency}) exceeds federation.clients "
                         f"({fed.clients})")
    for rule in spec.rules:
        rule(scenario)


# -- the built-in drivers' rules (registered by server.builtin_drivers) --------------------
def check_fedbuff(scenario: ServerScenario) -> None:
    """A buffer fills with one update per client at most, and the combine must take it."""
    buffer_size, fed = scenario.driver.buffer_size, scenario.federation
    if buffer_size > fed.clients:
        raise ValueError(f"driver.buffer_size ({buffer_size}) exceeds "
                         f"federation.clients ({fed.clients}): a client adds at most one "
                         "update to a buffer")
    scenario.aggregation.check_clients(buffer_size)


def check_fedasync(scenario: ServerScenario) -> None:
    """FedAsync mixes one update at a time into the model: a mean of one."""
    combine = scenario.aggregation.combine
    if combine != "mean":
        raise ValueError(f"driver.kind 'fedasync' mixes in one update at a time and needs "
                         f"aggregation.combine 'mean', got '{combine}'")


def check_async_without_dp(scenario: ServerScenario) -> None:
    if scenario.dp.mode != "off":
        raise ValueError(f"driver.kind '{scenario.driver.kind}' cannot run with [dp]: the "
                         "privacy accountant assumes synchronous rounds")


def check_fedasync_without_secagg(scenario: ServerScenario) -> None:
    if scenario.secagg.enabled:
        raise ValueError(FEDASYNC_SECAGG)


def check_async_late_policy(scenario: ServerScenario) -> None:
    if scenario.driver.late_policy == "carry":
        raise ValueError("driver.late_policy 'carry' is for the sync driver; the async "
                         "drivers take every update that arrives")


def check_cross_silo(scenario: ServerScenario) -> None:
    """A clear error for a combination the ring cannot run."""
    agg = scenario.aggregation
    if agg.combine not in ("mean", "sum"):
        raise ValueError(f"driver.kind 'cross_silo' sums the silos' updates over a ring, so "
                         f"the server never sees one; aggregation.combine "
                         f"'{agg.combine}' needs them all: use 'mean' or 'sum'")
    if agg.client_momentum:
        raise ValueError("driver.kind 'cross_silo' runs the silo client, which keeps no "
                         "worker momentum: set aggregation.client_momentum = 0")
    if scenario.dp.mode == "central" and not scenario.secagg.enabled:
        raise ValueError("dp.mode 'central' clips individual updates on the server, which "
                         "never sees them with driver.kind 'cross_silo': set secagg.enabled "
                         "= true (each silo clips its own update under the masks, the server "
                         "noises the sum), or use dp.mode = 'local' or 'distributed' (with "
                         "secagg)")
    if scenario.compression.kind != "none":
        raise ValueError("driver.kind 'cross_silo' sums dense deltas over the ring; upload "
                         "compression does not apply: set compression.kind = 'none'")
    if scenario.driver.late_policy != "drop":
        raise ValueError("driver.late_policy 'carry' has no meaning for cross-silo rounds: a "
                         "ring waits for every silo or fails; set it to 'drop'")
    check_silo_deadline(scenario)


def check_silo_deadline(scenario: ServerScenario) -> None:
    """The server must wait longer for a silo round than a silo waits for its peers."""
    driver_, silo = scenario.driver, scenario.silo
    deadline = driver_.deadline(scenario.federation.round_timeout_s)
    if deadline <= silo.join_timeout_s + silo.ring_timeout_s:
        raise ValueError(f"the server waits {deadline:g} s for a {driver_.kind} round "
                         f"(driver.deadline_s, else federation.round_timeout_s), not more than "
                         f"silo.join_timeout_s + silo.ring_timeout_s = "
                         f"{silo.join_timeout_s + silo.ring_timeout_s:g} s: raise it or lower "
                         "those")


# (key, the value gossip needs, why) for settings that act on a global model or an update
# the server sees: gossip has neither.
_GOSSIP_NEEDS = (
    ("aggregation.combine", "mean", "robust combines need every update on the server"),
    ("aggregation.server_opt", "fedavg", "a server optimizer steps a global model"),
    ("aggregation.server_lr", 1.0, "a server learning rate scales a global step"),
    ("aggregation.max_norm", 0.0, "the server checks no update"),
    ("aggregation.bucketing", 0, "bucketing averages updates on the server"),
    ("aggregation.clip_radius", 0.0, "centered clipping acts on updates on the server"),
    ("aggregation.client_momentum", 0.0, "the silo client keeps no worker momentum"),
    ("aggregation.local_buffers", False, "gossip mixes the whole model vector"),
    ("dp.mode", "off", "the privacy accountant charges a released global model"),
    ("secagg.enabled", False, "there is no sum for the server to unmask"),
    ("compression.kind", "none", "silos exchange dense models"),
    ("attack.fraction", 0.0, "simulated attackers forge updates sent to the server"),
    ("audit.canaries", 0, "canaries are inserted into a global model's updates"),
    ("driver.staleness", "constant", "staleness weights updates against a model version"),
    ("driver.max_staleness", -1, "staleness bounds updates against a model version"),
    ("driver.late_policy", "drop", "a gossip round waits for every silo or fails"),
)


def check_gossip_settings(scenario: ServerScenario) -> None:
    """Settings that need a global model or a server that sees updates fail, each with why
    gossip has neither (checked before the ``[dp]`` rules)."""
    for key, needed, why in _GOSSIP_NEEDS:
        value = setting(scenario, key, needed)
        if value != needed:
            raise ValueError(f"driver.kind 'gossip' has no global model and the server sees "
                             f"no update ({why}): set {key} = {needed!r}, got {value!r}")


def setting(scenario: ServerScenario, key: str, default: Any = None) -> Any:
    """The value of ``section.key``: from the typed section where the scenario has one,
    else as written in the resolved scenario (``default`` when absent)."""
    section, name = key.split(".")
    typed = getattr(scenario, section, None)
    if typed is not None and not isinstance(typed, Mapping) and hasattr(typed, name):
        return getattr(typed, name)
    return dict(scenario.raw.get(section) or {}).get(name, default)


def check_gossip(scenario: ServerScenario) -> None:
    """A gossip round needs two silos at least, and time for their exchanges."""
    fed = scenario.federation
    if fed.clients < 2 or fed.max_per_round() < 2:
        raise ValueError(f"driver.kind 'gossip' needs at least 2 silos per round, the "
                         f"federation has {fed.clients} client(s) and samples "
                         f"{fed.max_per_round()}: raise federation.clients or "
                         "federation.sample_fraction")
    if fed.min_clients < 2:
        raise ValueError(f"driver.kind 'gossip' needs two silos to average: set "
                         f"federation.min_clients >= 2, got {fed.min_clients}")
    check_silo_deadline(scenario)


def check_secagg(scenario: ServerScenario, spec: DriverSpec) -> SecAggScenarioConfig | None:
    """The ``[secagg]`` settings if enabled (else None); ValueError for what cannot run."""
    cfg, agg = scenario.secagg, scenario.aggregation
    if not cfg.enabled:
        return None
    if agg.combine == CLIENT_SIDE_COMBINE:
        check_client_side_clip(scenario)
    elif agg.combine not in ("mean", "sum"):
        raise ValueError(f"secagg is on, so the server only ever sees the weighted sum of the "
                         f"updates, never one update: aggregation.combine = "
                         f"'{agg.combine}' needs each update and cannot run on a sum; use "
                         f"'mean' or 'sum', or '{CLIENT_SIDE_COMBINE}' (each client clips its "
                         "update around the previous aggregate, the server sums), or turn "
                         "secagg off")
    if agg.max_norm:
        raise ValueError("secagg is on, so the server cannot see an update to check its norm: "
                         "set aggregation.max_norm = 0 (secagg.clip_range bounds each "
                         "coordinate instead)")
    mode = scenario.dp.mode
    if mode == "local":
        raise ValueError("dp.mode = 'local' together with secagg is not supported: use "
                         "dp.mode = 'distributed' (each client adds integer noise under the "
                         "masks) or 'central' (clients clip, the server noises the sum)")
    driver_ = scenario.driver
    if not spec.secure or driver_.late_policy != "drop":
        raise ValueError(f"secagg runs in synchronous rounds that drop late clients or in "
                         f"FedBuff's buffers; driver.kind = '{driver_.kind}' with "
                         f"driver.late_policy = '{driver_.late_policy}' is not supported "
                         "with it")
    if scenario.clients.offline_fraction:
        raise ValueError("secagg does not simulate clients going offline through "
                         "clients.offline_fraction; set it to 0 and use secagg.dropout")
    n, least = max_round_size(scenario.raw), cfg.min_survivors
    if driver_.kind == "fedbuff" and n < least:  # one secure sum per buffer of buffer_size
        raise ValueError(f"secure FedBuff sums each buffer under secagg, which needs at "
                         f"least secagg.min_survivors = {least} updates: raise "
                         f"driver.buffer_size (got {n}) to >= {least}")
    if n < least:
        raise ValueError(f"secagg needs at least secagg.min_survivors = {least} clients per "
                         f"round, the federation samples {n}: raise federation.clients or "
                         "federation.sample_fraction")
    cfg.graph(n)  # e.g. a threshold count above k
    if mode == "distributed":  # no fixed-point encoding: the DP plan checks the headroom
        return cfg
    check_secagg_levels(cfg, n, agg.weight_by)
    return cfg


def check_secagg_levels(cfg: SecAggScenarioConfig, n: int, weight_by: str) -> None:
    """The masked sum of ``n`` clients must not wrap and must keep each coordinate enough
    quantization levels."""
    cap = cfg.weight_cap(weight_by)
    try:
        scale = cfg.scale_for(n, weight_by)
    except ValueError as exc:
        raise ValueError(f"secagg: the masked sum could wrap around 2^{cfg.bits}: {exc}") \
            from None
    level = max_level(cfg.start_range, scale, cap)
    if level < 1 << MIN_LEVEL_BITS:
        need = next((b for b in range(cfg.bits + 1, 65) if max_level(
            cfg.start_range, max_scale(n, b, cfg.start_range, cap), cap) >= 1 << MIN_LEVEL_BITS),
            64)
        raise ValueError(f"secagg.bits = {cfg.bits} leaves {level} quantization levels per "
                         f"coordinate for {n} clients (fewer than 2^{MIN_LEVEL_BITS}): raise "
                         f"secagg.bits to >= {need}")


def check_client_side_clip(scenario: ServerScenario) -> None:
    """Centered clipping under secagg runs on the clients, one step each (a second would
    need the other clients' updates, so ``clip_iterations`` does not apply): what it
    needs fails at start."""
    agg = scenario.aggregation
    if not agg.clip_radius > 0:
        raise ValueError(f"aggregation.combine = '{CLIENT_SIDE_COMBINE}' with secagg: each "
                         "client clips its update around the previous aggregate with a radius "
                         "the server fixes, because it cannot see the updates' distances "
                         "the automatic radius is the median of: set aggregation.clip_radius "
                         "> 0 (e.g. the median distance of the updates to the previous "
                         "aggregate in a run without secagg)")
    if agg.bucketing not in (0, 1):
        raise ValueError("aggregation.bucketing averages individual updates, which the server "
                         "never sees under secagg: set aggregation.bucketing = 0")
    if agg.nnm:
        raise ValueError("aggregation.nnm mixes each update with its nearest ones, by "
                         "distances between individual updates, which the server never sees "
                         "under secagg (it learns only the sum): set aggregation.nnm = false")
    if agg.clip_iterations_late:
        raise ValueError("aggregation.clip_iterations_late: under secagg each client clips "
                         "once around the previous aggregate, a second iteration would need "
                         "the other clients' updates: remove aggregation.clip_iterations_late "
                         "and aggregation.clip_late_after")
    kind = scenario.driver.kind
    if kind != "sync":
        raise ValueError(f"client-side centered clipping (aggregation.combine = "
                         f"'{CLIENT_SIDE_COMBINE}' with secagg) runs in sync rounds, each "
                         f"centred on the last aggregate; driver.kind = '{kind}': set it to "
                         "'sync'")


def check_audit(scenario: ServerScenario) -> AuditConfig | None:
    """The run's audit settings, or None when off; combinations the canaries cannot take
    part in fail with a message naming the key to change."""
    audit = scenario.audit
    if not audit.enabled:
        return None
    kind = scenario.driver.kind
    if kind != "sync":
        raise ValueError(f"[audit] canaries take part in sync rounds only; driver.kind is "
                         f"'{kind}': set driver.kind = 'sync' or audit.canaries = 0")
    combine = scenario.aggregation.combine
    if combine not in LINEAR_COMBINES:
        raise ValueError(f"[audit] adds canaries to a linear aggregate; aggregation.combine "
                         f"'{combine}' is not one: use 'mean' or 'sum', or audit.canaries = 0")
    mode = scenario.dp.mode
    if mode == "local":
        raise ValueError("[audit] does not support dp.mode = 'local' (each canary would "
                         "need its own local noise): use central or distributed DP, or "
                         "audit.canaries = 0")
    if mode != "off" and audit.canary_norm > 0:
        raise ValueError("audit.canary_norm is for runs without DP; with DP each canary "
                         "has the clip norm dp.clip: remove audit.canary_norm")
    if mode == "off" and scenario.secagg.enabled and audit.canary_norm == 0:
        raise ValueError("[audit] without DP under secure aggregation needs audit.canary_norm "
                         "> 0: the server sees no single update's norm to size canaries by")
    return audit


def check_dp_sgd(scenario: ServerScenario) -> None:
    """``train.dp_sgd_epsilon_budget`` needs each client's DP-SGD figure at the server,
    which a secure sum does not carry: the run could not stop at the budget."""
    train = dict(scenario.raw.get("train") or {})  # a section of the clients' task
    if train.get("dp_sgd_epsilon_budget") is None:
        return
    if scenario.secagg.enabled:
        raise ValueError("train.dp_sgd_epsilon_budget: under secure aggregation the server "
                         "sees no client's DP-SGD epsilon, so it cannot stop the run at the "
                         "budget; remove train.dp_sgd_epsilon_budget or set secagg.enabled = "
                         "false")


def check_evaluation(scenario: ServerScenario, spec: DriverSpec) -> None:
    """Federated evaluation needs a held-out split on the clients, a figure for the target
    to be compared with and, made secure, secure aggregation."""
    fed, driver_ = scenario.federation, scenario.driver
    task = dict(scenario.raw.get("task") or {})  # the clients' sections
    data = dict(scenario.raw.get("data") or {})
    if fed.evaluate_fraction > 0 and not task.get("module") \
            and not data.get("client_test_fraction", 0):
        raise ValueError("federation.evaluate_fraction > 0 asks clients to evaluate on their "
                         "held-out split, but data.client_test_fraction = 0 holds none out: "
                         "set data.client_test_fraction (e.g. 0.2) or "
                         "federation.evaluate_fraction = 0")
    gossip = driver_.kind == GOSSIP  # every silo evaluates its own model every round
    if gossip and driver_.target_accuracy and driver_.target_on != "federated":
        raise ValueError(f"driver.kind 'gossip' has no global model: driver.target_accuracy "
                         f"can only be compared with the silos' own models' accuracy on "
                         f"their held-out splits: set driver.target_on = 'federated', got "
                         f"'{driver_.target_on}'")
    if driver_.target_on != "central" and fed.evaluate_fraction == 0 and not gossip:
        raise ValueError(f"driver.target_on = '{driver_.target_on}' compares the target with "
                         "the clients' federated evaluation, which federation.evaluate_fraction "
                         "= 0 turns off: set federation.evaluate_fraction > 0 or "
                         "driver.target_on = 'central'")
    if driver_.target_on == "personal" and not scenario.aggregation.local_buffers:
        raise ValueError("driver.target_on = 'personal' means each client's own model, but "
                         "without aggregation.local_buffers = true the clients use the global "
                         "model: set aggregation.local_buffers = true or driver.target_on = "
                         "'federated'")
    check_secure_evaluation(scenario, spec)


def check_secure_evaluation(scenario: ServerScenario, spec: DriverSpec) -> None:
    """A secure federated evaluation needs secure aggregation, an evaluation, a driver
    whose clients answer it and enough clients asked."""
    fed = scenario.federation
    if not fed.secure_evaluation:
        return
    if not scenario.secagg.enabled:
        raise ValueError("federation.secure_evaluation = true sends the evaluation totals "
                         "through the secure sum, which needs secure aggregation: set "
                         "secagg.enabled = true or federation.secure_evaluation = false")
    if fed.evaluate_fraction == 0:
        raise ValueError("federation.secure_evaluation = true needs a federated evaluation: "
                         "set federation.evaluate_fraction > 0 or "
                         "federation.secure_evaluation = false")
    if not spec.secure_evaluation:
        raise ValueError(f"federation.secure_evaluation = true runs a SecAgg+ session among "
                         f"the clients, which driver.kind = '{spec.name}' silos do not "
                         "answer: set federation.secure_evaluation = false")
    asked = evaluation_cohort_size(fed.clients, fed.evaluate_fraction)
    survivors = scenario.secagg.min_survivors
    if asked < survivors:
        raise ValueError(f"federation.secure_evaluation = true: federation.evaluate_fraction"
                         f" = {fed.evaluate_fraction:g} asks {asked} of {fed.clients} "
                         f"clients, fewer than secagg.min_survivors = {survivors}, so "
                         "every secure evaluation would abort: raise "
                         "federation.evaluate_fraction")
