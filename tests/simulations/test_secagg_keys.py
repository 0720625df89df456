"""SecAgg+ identity keys: what ``fedring certs`` writes, the node-config loader, the PKI of a
simulated run on both engines, and the node config ``fedring deploy up`` gives."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.config import parse_config_args

from client.protocol.keys import NodeConfigKey
from client.secagg_identity import secagg_identity
from privacy.secagg.identity import Identity, TrustedKeys
from simulations.certs import TRUSTED_KEYS_FILE, write_all
from simulations.cli import main
from simulations.deploy.commands import Options, node_config, supernode_command
from simulations.inprocess import InProcessGrid
from simulations.secagg_pki import make_pki, with_pki

IDENTITY, TRUSTED = NodeConfigKey.SECAGG_IDENTITY_KEY, NodeConfigKey.SECAGG_TRUSTED_KEYS


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    write_all(out, nodes=3)
    return out


def _files(certs: Path, i: int) -> dict[str, str]:
    return {IDENTITY: str(certs / f"node-{i}.secagg"), TRUSTED: str(certs / TRUSTED_KEYS_FILE)}


# fedring certs ------------------------------------------------------------------------

def test_certs_write_an_identity_per_node_and_one_trusted_keys_file(certs: Path) -> None:
    m = write_all(certs / "again", nodes=3)
    assert [p.name for p in m.secagg_keys] == ["node-0.secagg", "node-1.secagg",
                                               "node-2.secagg"]
    identities = [Identity.from_pem(p.read_bytes()) for p in m.secagg_keys]
    assert len({i.public for i in identities}) == 3
    assert m.secagg_trusted is not None and m.secagg_trusted.name == TRUSTED_KEYS_FILE
    trusted = TrustedKeys.read(m.secagg_trusted)
    assert trusted.keys == {i.public for i in identities}
    assert m.secagg_trusted.read_text() == trusted.to_text()
    for path in m.secagg_keys:
        assert path.stat().st_mode & 0o077 == 0  # private, like the other keys


def test_certs_without_nodes_write_no_trusted_keys(tmp_path: Path) -> None:
    m = write_all(tmp_path, nodes=0)
    assert m.secagg_keys == [] and m.secagg_trusted is None
    assert not (tmp_path / TRUSTED_KEYS_FILE).exists()


def test_the_certs_command_names_the_new_files(tmp_path: Path, capsys) -> None:
    assert main(["certs", "--out", str(tmp_path), "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert f"SecAgg+ identity {tmp_path / 'node-1.secagg'}" in out
    assert f"SecAgg+ trusted keys {tmp_path / TRUSTED_KEYS_FILE}" in out


# the loader ---------------------------------------------------------------------------

def test_a_node_config_without_the_keys_has_no_identity() -> None:
    assert secagg_identity({"partition-id": 0, "num-partitions": 3}) is None


def test_the_files_of_fedring_certs_load(certs: Path) -> None:
    loaded = [secagg_identity(_files(certs, i)) for i in range(3)]
    publics = {identity.public for identity, _ in loaded}
    assert len(publics) == 3
    assert all(trusted.keys == publics for _, trusted in loaded)


@pytest.mark.parametrize("given", [IDENTITY, TRUSTED])
def test_one_key_alone_names_the_other(certs: Path, given: str) -> None:
    missing = TRUSTED if given == IDENTITY else IDENTITY
    with pytest.raises(ValueError, match=f"sets '{given}' but not '{missing}'"):
        secagg_identity({given: _files(certs, 0)[given]})


@pytest.mark.parametrize("key", [IDENTITY, TRUSTED])
def test_a_missing_file_names_the_key_and_the_path(tmp_path: Path, certs: Path, key: str):
    config = {**_files(certs, 0), key: str(tmp_path / "nowhere")}
    with pytest.raises(ValueError, match=re.escape(f"node config '{key}': cannot read "
                                                   f"{tmp_path / 'nowhere'}: No such file")):
        secagg_identity(config)


def test_a_malformed_identity_file_names_the_key_and_the_path(tmp_path: Path, certs: Path):
    bad = tmp_path / "node.secagg"
    bad.write_bytes((certs / "node-0.pem").read_bytes())  # a certificate, not a key
    with pytest.raises(ValueError, match=re.escape(f"node config '{IDENTITY}' ({bad}): not an "
                                                   "unencrypted PEM private key")):
        secagg_identity({**_files(certs, 0), IDENTITY: str(bad)})
    bad.write_bytes((certs / "node-0.key").read_bytes())  # the node's TLS key: ECDSA
    with pytest.raises(ValueError, match="an Ed25519 key is needed"):
        secagg_identity({**_files(certs, 0), IDENTITY: str(bad)})


def test_a_malformed_trusted_keys_file_names_the_key_path_and_line(tmp_path: Path,
                                                                   certs: Path) -> None:
    bad = tmp_path / "trusted.txt"
    bad.write_text((certs / TRUSTED_KEYS_FILE).read_text() + "not hex\n")
    with pytest.raises(ValueError, match=re.escape(f"node config '{TRUSTED}' ({bad}), line 4")):
        secagg_identity({**_files(certs, 0), TRUSTED: str(bad)})


def test_a_path_that_is_not_a_string_is_refused(certs: Path) -> None:
    with pytest.raises(ValueError, match=f"node config '{IDENTITY}' must be a file path"):
        secagg_identity({**_files(certs, 0), IDENTITY: 3})


def test_a_node_outside_its_own_trusted_set_is_refused(tmp_path: Path, certs: Path) -> None:
    other = write_all(tmp_path, nodes=1)  # another federation's trusted keys
    assert other.secagg_trusted is not None
    with pytest.raises(ValueError, match=r"is not in .*so no peer would accept it"):
        secagg_identity({**_files(certs, 0), TRUSTED: str(other.secagg_trusted)})


def test_a_file_and_its_in_memory_twin_are_not_both_given(certs: Path) -> None:
    config = {**_files(certs, 0), **make_pki(1).node_config(0)}
    with pytest.raises(ValueError, match=f"sets both '{IDENTITY}' and"):
        secagg_identity(config)


# the PKI of a simulated run -----------------------------------------------------------

def test_the_pki_gives_each_partition_its_own_trusted_identity() -> None:
    pki = make_pki(3)
    loaded = [secagg_identity(pki.node_config(i)) for i in range(3)]
    publics = [identity.public for identity, _ in loaded]
    assert len(set(publics)) == 3
    assert all(trusted.keys == set(publics) for _, trusted in loaded)
    assert make_pki(3).identity_pems != pki.identity_pems  # fresh keys for each run
    with pytest.raises(ValueError, match=r"partitions 0\.\.2, not 3"):
        pki.node_config(3)
    with pytest.raises(ValueError, match="at least one node"):
        make_pki(0)


def _public_key_app() -> ClientApp:
    """A ClientApp that answers a query with the public key of its node's identity."""
    app = ClientApp()

    @app.query()
    def query(message: Message, context: Context) -> Message:
        loaded = secagg_identity(context.node_config)
        public = "" if loaded is None else loaded[0].public.hex()
        return Message(RecordDict({"id": ConfigRecord({"public": public})}), reply_to=message)

    return app


def _publics(grid: InProcessGrid) -> dict[int, str]:
    nodes = list(grid.get_node_ids())
    replies = grid.send_and_receive([grid.create_message(RecordDict(), "query", n, "1")
                                     for n in nodes])
    return {r.metadata.src_node_id: str(r.content["id"]["public"]) for r in replies}


def test_the_inprocess_engine_gives_no_identity_by_default() -> None:
    grid = InProcessGrid(_public_key_app(), 3)
    assert set(_publics(grid).values()) == {""}
    assert {key for c in grid._contexts.values() for key in c.node_config} == {
        "partition-id", "num-partitions", "fedring.in-process", "mask-threads"}


def test_the_inprocess_engine_hands_each_node_its_identity() -> None:
    pki = make_pki(3)
    publics = _publics(InProcessGrid(_public_key_app(), 3, pki=pki))
    for node, public in publics.items():  # node i holds partition i - 1
        assert public == Identity.from_pem(pki.identity_pems[node - 1].encode()).public.hex()


def test_the_flower_engine_wrapper_survives_pickling_and_adds_the_identity() -> None:
    """Flower's engine ships the ClientApp to Ray workers and gives each node only its
    partition: the wrapped app picks the identity from that."""
    cloudpickle = pytest.importorskip("ray.cloudpickle")  # how Ray ships it
    pki = make_pki(2)
    app = cloudpickle.loads(cloudpickle.dumps(with_pki(_public_key_app(), pki)))
    grid = InProcessGrid(app, 1)  # for a message with Flower's task identity
    msg = grid.create_message(RecordDict(), "query", 1, "1")
    msg.metadata.__dict__["_message_id"] = "m1"
    context = Context(run_id=1, node_id=123456, node_config={"partition-id": 1,
                                                              "num-partitions": 2},
                      state=RecordDict(), run_config={})
    reply = app(msg, context)
    expected = Identity.from_pem(pki.identity_pems[1].encode()).public.hex()
    assert reply.content["id"]["public"] == expected
    with pytest.raises(ValueError, match="'partition-id' must be an integer"):
        app(msg, Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                         run_config={}))


# fedring deploy up --------------------------------------------------------------------

def test_deploy_passes_the_identity_files_in_the_node_config(certs: Path) -> None:
    command = supernode_command(2, "127.0.0.1:9", 10, Options(nodes=3, tls=True), certs)
    given = command[command.index("--node-config") + 1]
    parsed = parse_config_args([given])  # as flower-supernode reads it
    assert parsed == {"partition-id": 2, "num-partitions": 3, **_files(certs, 2)}
    identity, trusted = secagg_identity(parsed)
    assert identity.public == Identity.from_pem((certs / "node-2.secagg").read_bytes()).public
    assert len(trusted) == 3


def test_deploy_without_the_identity_files_keeps_the_node_config(tmp_path: Path) -> None:
    assert node_config(1, 3, None) == "partition-id=1 num-partitions=3"
    assert node_config(1, 3, tmp_path) == "partition-id=1 num-partitions=3"  # TLS only


@pytest.mark.slow
def test_flowers_engine_hands_each_node_its_identity() -> None:
    """On Ray, with a ServerApp asking every node for the public key of its identity."""
    from flwr.serverapp import Grid, ServerApp

    from simulations.engine_config import EngineConfig
    from simulations.flower_engine import run_on_ray

    pki, seen = make_pki(3), {}
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        while len(nodes := list(grid.get_node_ids())) < 3:
            time.sleep(0.1)
        replies = grid.send_and_receive([grid.create_message(RecordDict(), "query", n, "1")
                                         for n in nodes])
        seen.update({r.metadata.src_node_id: str(r.content["id"]["public"])
                     for r in replies if not r.has_error()})

    run_on_ray(server_app, _public_key_app(), num_supernodes=3,
               engine=EngineConfig(client_cpus=1), pki=pki)
    expected = {Identity.from_pem(pem.encode()).public.hex() for pem in pki.identity_pems}
    assert len(seen) == 3 and set(seen.values()) == expected
