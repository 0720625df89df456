"""A database URL the store cannot use fails with one line saying what to change."""

from __future__ import annotations

import socket

import pytest

from server.store import Store, StoreUnavailable


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("url, says", [
    ("postgres://u@localhost/db", "postgresql+psycopg://user:password@host:5432/dbname"),
    ("mysql://u@localhost/db", "module MySQLdb) is not installed; the store runs on SQLite "
                               "and PostgreSQL"),
    ("postgresql+psycopg2://u@localhost/db", "module psycopg2) is not installed"),
])
def test_unsupported_urls_name_the_accepted_forms(url, says):
    with pytest.raises(StoreUnavailable) as info:
        Store(url)
    assert says in str(info.value) and "\n" not in str(info.value)
    assert "sqlite:///PATH" in str(info.value)


def test_a_server_that_does_not_answer_is_not_reachable_at_host_port():
    port = _closed_port()
    with pytest.raises(StoreUnavailable, match=f"not reachable at 127.0.0.1:{port} ") as info:
        Store(f"postgresql+psycopg://u:secret@127.0.0.1:{port}/db")
    assert "\n" not in str(info.value) and "secret" not in str(info.value)


def test_reading_a_store_that_does_not_exist_does_not_create_it(tmp_path):
    path = tmp_path / "sub" / "none.db"
    with pytest.raises(StoreUnavailable, match=f"there is no run store at {path}"):
        Store(f"sqlite:///{path}", create=False)
    assert not path.exists() and not path.parent.exists()
    Store(f"sqlite:///{path}").close()  # creating one is the default
    with Store(f"sqlite:///{path}", create=False) as store:
        assert store.list_runs() == []


def test_a_sqlite_file_that_cannot_be_created(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(StoreUnavailable, match="cannot create the SQLite file"):
        Store(f"sqlite:///{tmp_path / 'file' / 'x.db'}")
