"""Keys, the [security] config, the role table, and a secured core in a thread (fast)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
from click.testing import CliRunner
from mnesite.cli.main import main
from mnesite.core.consensus import VoteRequest
from mnesite.core.consensus_wire import message_to_wire
from mnesite.core.node import CoreNode
from mnesite.rlog import messages
from mnesite.rlog.client import Client, Forbidden, MnesiteError, Unauthenticated, Unavailable
from mnesite.rlog.config import ConfigError, load_config, parse_config
from mnesite.rlog.errors import REFUSED_KEY
from mnesite.rlog.messages import Message, typed_body
from mnesite.rlog.roles import KIND_ROLES, RoleTable, sender_mismatch
from mnesite.rlog.security import (
    SecurityError,
    client_keys,
    configure_client,
    configure_server,
    generate_keys,
    load_authorized_keys,
    load_key,
)
from mnesite.rlog.types import TxKey

from tests.conftest import ServedCore, commit_table_t, free_port, wait_until, watch_body

pytestmark = pytest.mark.timeout(60)

PRINCIPALS = ("cluster", "core1", "core2", "replicant1", "ops", "app", "dashboard")
ROLES = {"core": ["core1", "core2"], "replicant": ["replicant1"], "admin": ["ops"], "writer": ["app"]}
ROLES_WITH_READER = {**ROLES, "reader": ["dashboard"]}


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    """keys/ (every pair), authorized/ (public keys of every principal but the cluster and a stranger)."""
    directory = tmp_path / "keys"
    for name in (*PRINCIPALS, "stranger"):
        generate_keys(name, str(directory))
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    for name in PRINCIPALS[1:]:
        shutil.copy(directory / f"{name}.key", authorized)
    return directory


def security_toml(keys: Path, roles: dict[str, list[str]]) -> str:
    lines = [
        "[security]",
        f'server_key = "{keys / "cluster.key_secret"}"',
        f'client_key = "{keys / "core1.key_secret"}"',
        f'authorized_keys = "{keys.parent / "authorized"}"',
        "[security.roles]",
    ]
    lines += [f"{role} = {json.dumps(names)}" for role, names in roles.items()]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- keys


def test_keys_generate_writes_a_public_key_and_a_private_secret_and_never_overwrites(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["keys", "generate", "app", "--dir", str(tmp_path / "k"), "--json"])
    assert result.exit_code == 0, result.output
    paths = json.loads(result.output)
    assert paths["public"].endswith("app.key") and paths["secret"].endswith("app.key_secret")
    assert stat.S_IMODE(os.stat(paths["secret"]).st_mode) == 0o600
    pair = load_key(paths["secret"], "key", secret=True)
    assert load_key(paths["public"], "key", secret=False).public == pair.public and pair.secret
    again = runner.invoke(main, ["keys", "generate", "app", "--dir", str(tmp_path / "k")])
    assert again.exit_code == 1 and "exists already" in again.output
    bad = runner.invoke(main, ["keys", "generate", "../x", "--dir", str(tmp_path / "k")])
    assert bad.exit_code == 1 and "NAME must be" in bad.output


@pytest.mark.parametrize("file_name", ["app.key", "app.key_secret"])
def test_keys_generate_never_writes_through_a_symbolic_link(tmp_path: Path, file_name: str) -> None:
    """A dangling link in the key directory (a shared or someone else's directory) did not count as an
    existing file: the secret key was written wherever the link pointed, in a file its owner can place."""
    directory = tmp_path / "k"
    directory.mkdir()
    target = tmp_path / "elsewhere" / "stolen"
    target.parent.mkdir()
    (directory / file_name).symlink_to(target)
    result = CliRunner().invoke(main, ["keys", "generate", "app", "--dir", str(directory)])
    assert result.exit_code == 1 and "exists already" in result.output, result.output
    assert not target.exists()
    assert sorted(os.listdir(directory)) == [file_name]


# ---------------------------------------------------------------- config


def test_a_node_off_loopback_refuses_to_start_without_security() -> None:
    for listen in ("tcp://*:7400", "tcp://0.0.0.0:7400", "tcp://10.1.2.3:7400"):
        with pytest.raises(ConfigError, match=r"not a loopback address.*\[security\]"):
            parse_config({"node": {"listen": listen}})
    assert parse_config({"node": {"listen": "tcp://127.0.0.1:7400"}}).security is None
    insecure = parse_config({"node": {"listen": "tcp://*:7400"}, "security": {"insecure": True}})
    assert insecure.security is not None and insecure.security.insecure and not insecure.secure


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"insecure": "yes"}, r"\[security\].insecure must be true or false"),
        ({"insecure": True, "roles": {"admin": ["ops"]}}, "cannot be combined"),
        ({"server_key": 5}, r"\[security\].server_key must be a path"),
        ({"server_key": "nope.key_secret"}, r"\[security\].server_key: .* does not exist"),
        ({"colour": 1}, r"unknown key \[security\].colour"),
        ({"roles": {"core": ["a"]}}, r"\[security\].server_key is required"),
    ],
)
def test_security_config_errors_name_the_key(section, message) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"security": section})


def test_roles_config_errors_name_the_role(keys: Path, tmp_path: Path) -> None:
    base = {"server_key": str(keys / "cluster.key_secret"), "client_key": str(keys / "core1.key_secret")}
    base["authorized_keys"] = str(tmp_path / "authorized")
    with pytest.raises(ConfigError, match=r"unknown role \[security.roles\].superuser"):
        parse_config({"security": {**base, "roles": {"superuser": ["x"]}}})
    with pytest.raises(ConfigError, match=r"\[security.roles\].writer must be a list"):
        parse_config({"security": {**base, "roles": {"writer": "app"}}})
    with pytest.raises(ConfigError, match=r"\[security.roles\].core must list every core .* missing core1"):
        parse_config({"security": {**base, "roles": {"writer": ["app"]}}})
    config = parse_config({"security": {**base, "roles": {"core": ["core1"], "writer": ["app"]}}})
    assert config.secure and config.security is not None and config.security.roles["writer"] == ("app",)


def _node_toml(tmp_path: Path, toml: str) -> Path:
    """``tmp_path/node.toml``, written: a [node] with its data_dir in ``tmp_path``, then ``toml``."""
    path = tmp_path / "node.toml"
    path.write_text(f'[node]\ndata_dir = "{tmp_path / "data"}"\n' + toml)
    return path


def test_a_node_refuses_to_start_with_another_principals_client_key(keys: Path, tmp_path: Path) -> None:
    toml = security_toml(keys, ROLES).replace("core1.key_secret", "core2.key_secret")
    path = _node_toml(tmp_path, toml)
    with pytest.raises(ConfigError, match=r"client_key is the key of 'core2' in authorized_keys, not of this node"):
        CoreNode(load_config(str(path)))


def test_a_secret_key_that_is_only_public_is_refused_when_the_node_starts(keys: Path, tmp_path: Path) -> None:
    toml = security_toml(keys, ROLES).replace("core1.key_secret", "core1.key")
    path = _node_toml(tmp_path, toml)
    with pytest.raises(ConfigError, match=r"\[security\].client_key: .* has no secret key"):
        CoreNode(load_config(str(path)))


def test_a_secret_key_readable_by_others_is_refused(keys: Path) -> None:
    secret = keys / "app.key_secret"
    secret.chmod(0o644)
    with pytest.raises(SecurityError, match="readable by other users; chmod 600"):
        load_key(str(secret), "key", secret=True)
    with pytest.raises(MnesiteError, match="chmod 600"):
        Client("tcp://127.0.0.1:1", key=secret, server_key=keys / "cluster.key")
    assert load_key(str(keys / "app.key"), "key", secret=False).public  # public keys may be world-readable


def test_a_secret_key_owned_by_another_user_is_refused(keys: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What ``keys generate`` writes passes; the same file seen by another user does not (ssh's rule).
    secret = keys / "app.key_secret"
    assert load_key(str(secret), "key", secret=True).secret
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(secret).st_uid + 1)
    with pytest.raises(SecurityError, match=r"is owned by uid \d+, not by this user .*chown"):
        load_key(str(secret), "key", secret=True)


# The cluster's public key is what a client pins (``Client(server_key=)``, ``--server-key``): whoever can
# write that file can make the client trust their own server. Refused like an authorized key file.


@pytest.mark.parametrize("mode", [0o664, 0o646], ids=oct)
def test_a_server_key_file_other_users_can_write_is_refused(keys: Path, mode: int) -> None:
    server_key = keys / "cluster.key"
    assert load_key(str(server_key), "server_key", secret=False).public  # 0644, as keys generate writes it
    server_key.chmod(mode)
    with pytest.raises(SecurityError, match=rf"server_key: {server_key} is writable by other users.*chmod go-w"):
        load_key(str(server_key), "server_key", secret=False)
    with pytest.raises(MnesiteError, match=rf"{server_key} is writable by other users.*chmod go-w {server_key}"):
        Client("tcp://127.0.0.1:1", key=keys / "app.key_secret", server_key=server_key)


def test_a_server_key_file_another_user_owns_is_refused_and_root_may_own_it(
    keys: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server_key = keys / "cluster.key"
    other_uid = os.stat(server_key).st_uid + 12345
    if os.geteuid() == 0:
        monkeypatch.setattr(os, "geteuid", lambda: other_uid)  # a client run by another user, key installed by root
        assert load_key(str(server_key), "server_key", secret=False).public
        monkeypatch.undo()
        os.chown(server_key, other_uid, -1)  # really another user's
    else:
        monkeypatch.setattr(os, "geteuid", lambda: other_uid)  # this process is now another user
    with pytest.raises(SecurityError, match=rf"server_key: {server_key} is owned by uid \d+, not by this user.*chown"):
        load_key(str(server_key), "server_key", secret=False)


def test_an_authorized_key_file_named_only_dot_key_is_refused(keys: Path) -> None:
    # ".key" would map its key to the principal "", the one ``principal_of`` gives a frame without one.
    authorized = keys.parent / "authorized"
    shutil.copy(keys / "stranger.key", authorized / ".key")
    with pytest.raises(SecurityError, match=r"authorized_keys: .*\.key names no principal; rename it NAME\.key"):
        load_authorized_keys(str(authorized))
    (authorized / ".key").unlink()
    assert "" not in load_authorized_keys(str(authorized)).values()


# An authorized_keys directory or key file another user can write lets that user add a principal:
# refused like ssh's StrictModes, at start and at a reload.


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o777], ids=oct)
def test_an_authorized_keys_directory_other_users_can_write_is_refused(keys: Path, mode: int) -> None:
    authorized = keys.parent / "authorized"
    authorized.chmod(mode)
    with pytest.raises(SecurityError, match=rf"authorized_keys: {authorized} is writable by other users.*chmod go-w"):
        load_authorized_keys(str(authorized))
    authorized.chmod(0o755)
    assert "app" in load_authorized_keys(str(authorized)).values()


@pytest.mark.parametrize("mode", [0o664, 0o646], ids=oct)
def test_an_authorized_key_file_other_users_can_write_is_refused(keys: Path, mode: int) -> None:
    key_file = keys.parent / "authorized" / "app.key"
    key_file.chmod(mode)
    with pytest.raises(SecurityError, match=rf"authorized_keys: {key_file} is writable by other users.*chmod go-w"):
        load_authorized_keys(str(key_file.parent))


@pytest.mark.parametrize("owned", ["directory", "key file"])
def test_an_authorized_keys_directory_or_key_file_another_user_owns_is_refused(
    keys: Path, owned: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    authorized = keys.parent / "authorized"
    path = authorized if owned == "directory" else authorized / "app.key"
    other_uid = os.stat(path).st_uid + 12345
    if os.geteuid() == 0:
        os.chown(path, other_uid, -1)  # really another user's
    else:
        monkeypatch.setattr(os, "geteuid", lambda: other_uid)  # this process is now another user
    with pytest.raises(SecurityError, match=rf"authorized_keys: {path} is owned by uid \d+, not by this user.*chown"):
        load_authorized_keys(str(authorized))


def test_an_authorized_keys_directory_root_owns_is_accepted_like_ssh(
    keys: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs files owned by root: run as root")
    monkeypatch.setattr(os, "geteuid", lambda: 12345)  # a node run by another user, keys installed by root
    assert "app" in load_authorized_keys(str(keys.parent / "authorized")).values()


# Whoever can write a directory above authorized_keys can rename authorized_keys away and put their
# own in its place: every directory up to / is checked too (ssh's StrictModes), except that a sticky
# one (/tmp) may be writable by all: there only an entry's owner, the directory's owner or root can
# rename or remove an entry, and the entry below it must itself be this user's or root's.


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o777], ids=oct)
def test_a_directory_above_authorized_keys_that_other_users_can_write_is_refused_unless_sticky(
    keys: Path, mode: int
) -> None:
    authorized, above = keys.parent / "authorized", keys.parent  # above: the test's private tmp_path
    above.chmod(mode)
    with pytest.raises(
        SecurityError,
        match=rf"authorized_keys: {above} is writable by other users, who could put another directory in place "
        rf"of {authorized}; chmod go-w {above}",
    ):
        load_authorized_keys(str(authorized))
    above.chmod(mode | stat.S_ISVTX)  # sticky, as /tmp is
    assert "app" in load_authorized_keys(str(authorized)).values()
    above.chmod(0o700)


@pytest.mark.parametrize("sticky", [False, True], ids=["plain", "sticky"])
def test_a_directory_above_authorized_keys_that_another_user_owns_is_refused(keys: Path, sticky: bool) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs a directory another user owns: run as root")
    authorized, above = keys.parent / "authorized", keys.parent
    above.chmod(0o1777 if sticky else 0o755)
    os.chown(above, os.stat(above).st_uid + 12345, -1)
    with pytest.raises(SecurityError, match=rf"authorized_keys: {above} is owned by uid \d+, not by this user.*chown"):
        load_authorized_keys(str(authorized))


def test_the_directories_above_authorized_keys_checked_are_those_of_the_directory_opened(
    keys: Path, tmp_path: Path
) -> None:
    """A symbolic link on the way is followed: the directories checked are the real ones above it."""
    authorized = keys.parent / "authorized"
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o777)
    outside.chmod(0o777)
    (outside / "link").symlink_to(authorized)
    assert "app" in load_authorized_keys(str(outside / "link")).values()  # outside/ holds only the link
    keys.parent.chmod(0o777)
    with pytest.raises(SecurityError, match=rf"authorized_keys: {keys.parent} is writable by other users"):
        load_authorized_keys(str(outside / "link"))
    keys.parent.chmod(0o700)


def test_what_keys_generate_writes_passes_as_authorized_keys_whatever_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0o002)  # a user-private-group umask: mkdir would make the directory group-writable
    try:
        generate_keys("app", str(tmp_path / "fresh"))
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(tmp_path / "fresh").st_mode) & 0o022 == 0
    assert load_authorized_keys(str(tmp_path / "fresh")) == {
        load_key(str(tmp_path / "fresh" / "app.key"), "key", secret=False).public: "app"
    }


def test_the_directories_keys_generate_makes_above_its_own_pass_whatever_the_umask(tmp_path: Path) -> None:
    # --dir ~/mnesite/keys with ~/mnesite missing: makedirs made mnesite 0775 under umask 002, and the
    # node then refused both the secret key and authorized_keys below it (a directory above is checked).
    tmp_path.chmod(0o755)
    previous = os.umask(0o002)
    try:
        generate_keys("app", str(tmp_path / "made" / "above" / "keys"))
    finally:
        os.umask(previous)
    for made in ("made", "made/above", "made/above/keys"):
        assert stat.S_IMODE(os.stat(tmp_path / made).st_mode) == 0o755, made
    assert "app" in load_authorized_keys(str(tmp_path / "made" / "above" / "keys")).values()
    load_key(str(tmp_path / "made" / "above" / "keys" / "app.key_secret"), "key", secret=True)


def test_a_node_refuses_to_start_with_an_authorized_keys_directory_others_can_write(keys: Path, tmp_path: Path) -> None:
    (keys.parent / "authorized").chmod(0o777)
    path = _node_toml(tmp_path, security_toml(keys, ROLES))
    with pytest.raises((ConfigError, SecurityError), match=r"is writable by other users.*chmod go-w"):
        CoreNode(load_config(str(path)))


def test_an_authorized_key_file_that_is_not_a_regular_file_is_refused_without_waiting(keys: Path) -> None:
    # Opening a FIFO for reading waits for a writer: the node would hang at start or at a reload.
    fifo = keys.parent / "authorized" / "evil.key"
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def load() -> None:
        try:
            load_authorized_keys(str(fifo.parent))
            outcome.append(None)
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(timeout=5)
    if thread.is_alive():
        with open(fifo, "wb"):  # let the stuck reader go
            pass
        thread.join(timeout=5)
        raise AssertionError("reading a FIFO in authorized_keys blocked")
    assert isinstance(outcome[0], SecurityError) and "is not a regular file" in str(outcome[0])


# The secret key's checks are of the file that was read: one descriptor, no symbolic link.


def test_a_secret_key_behind_a_symbolic_link_is_refused(keys: Path) -> None:
    link = keys / "link.key_secret"
    link.symlink_to(keys / "app.key_secret")
    with pytest.raises(SecurityError, match=rf"key: {link} is a symbolic link"):
        load_key(str(link), "key", secret=True)


def test_a_symbolic_link_in_authorized_keys_is_refused(keys: Path) -> None:
    # The link's target is outside the checked directory: whoever can repoint or rewrite it there
    # would add a principal.
    link = keys.parent / "authorized" / "stranger.key"
    link.symlink_to(keys / "stranger.key")
    with pytest.raises(SecurityError, match=rf"authorized_keys: {link} is a symbolic link"):
        load_authorized_keys(str(link.parent))


def test_a_public_key_behind_a_symbolic_link_is_refused(keys: Path) -> None:
    """Regression: a public key file (the cluster's key a client pins, ``--server-key``) was read through
    a symbolic link; the file it pointed to was checked, but not the link, so whoever could write the
    link's directory could repoint it at another file that passes (any key file this user owns, such
    as another cluster's). It is refused as a secret key and an ``authorized_keys`` file are."""
    link = keys / "link.key"
    link.symlink_to(keys / "app.key")
    with pytest.raises(SecurityError, match=rf"server_key: {link} is a symbolic link; give the key file itself"):
        load_key(str(link), "server_key", secret=False)
    with pytest.raises(SecurityError, match="is a symbolic link"):
        client_keys(keys / "app.key_secret", link)


def test_the_secret_key_checked_is_the_file_that_was_read(keys: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The path was looked up again after zmq had read it: a file swapped in between (a good one after
    the readable one was read) passed the checks for the key of the file that did not."""
    secret = keys / "app.key_secret"
    secret.chmod(0o644)  # the file that is read: other users can read it
    good = keys / "good.key_secret"
    shutil.copy(keys / "ops.key_secret", good)
    good.chmod(0o600)
    real_stat = os.stat

    def swap_then_stat(path, *args, **kwargs):
        if os.fspath(path) == str(secret) and good.exists():
            os.replace(good, secret)  # another process swaps the file at the path
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", swap_then_stat)
    with pytest.raises(SecurityError, match="readable by other users; chmod 600"):
        load_key(str(secret), "key", secret=True)


# The directory that holds a key file, and every directory above it, is checked as authorized_keys is:
# whoever can write it can rename another file over the key path between two runs (a pinned server
# key swapped for their own, a secret replaced). Like ssh, the directory that holds the key itself must
# not be writable by others even if it is sticky; a sticky directory is accepted only above it (/tmp,
# which holds every test's tmp_path).


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o777, 0o1777], ids=oct)
@pytest.mark.parametrize(
    ("file_name", "what", "secret"), [("app.key_secret", "key", True), ("cluster.key", "server_key", False)]
)
def test_a_key_file_in_a_directory_other_users_can_write_is_refused(
    keys: Path, mode: int, file_name: str, what: str, secret: bool
) -> None:
    key_file = keys / file_name
    assert load_key(str(key_file), what, secret=secret).public  # keys generate makes its directory 0755
    keys.chmod(mode)
    with pytest.raises(
        SecurityError,
        match=rf"{what}: {keys} is writable by other users, who could put another file in place of {key_file}; "
        rf"chmod go-w {keys}$",
    ):
        load_key(str(key_file), what, secret=secret)
    with pytest.raises(MnesiteError, match=rf"{keys} is writable by other users.*chmod go-w {keys}"):
        Client("tcp://127.0.0.1:1", key=keys / "app.key_secret", server_key=keys / "cluster.key")


@pytest.mark.parametrize("mode", [0o775, 0o777], ids=oct)
def test_a_directory_above_a_key_file_that_other_users_can_write_is_refused_unless_sticky(
    keys: Path, mode: int
) -> None:
    above = keys.parent  # the test's private tmp_path
    above.chmod(mode)
    with pytest.raises(
        SecurityError,
        match=rf"server_key: {above} is writable by other users, who could put another directory in place of "
        rf"{keys}; chmod go-w {above}$",
    ):
        load_key(str(keys / "cluster.key"), "server_key", secret=False)
    above.chmod(mode | stat.S_ISVTX)  # sticky, as /tmp is
    assert load_key(str(keys / "cluster.key"), "server_key", secret=False).public
    above.chmod(0o700)


def test_a_node_refuses_to_start_with_a_key_in_a_directory_others_can_write(keys: Path, tmp_path: Path) -> None:
    keys.chmod(0o777)
    path = _node_toml(tmp_path, security_toml(keys, ROLES))
    with pytest.raises(
        (ConfigError, SecurityError), match=rf"\[security\].server_key: {keys} is writable by other users.*chmod go-w"
    ):
        CoreNode(load_config(str(path)))


def test_the_directories_checked_above_a_key_file_are_those_of_the_directory_opened(keys: Path, tmp_path: Path) -> None:
    """A symbolic link among the key path's directories is followed, as ssh's realpath does: the
    directories checked are the real ones that hold the file read, not the ones the path names."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "link").symlink_to(keys)
    server_key = outside / "link" / "cluster.key"
    assert load_key(str(server_key), "server_key", secret=False).public
    keys.chmod(0o777)  # the real directory of the file, not named by the path given
    with pytest.raises(SecurityError, match=rf"server_key: {keys} is writable by other users.*chmod go-w {keys}$"):
        load_key(str(server_key), "server_key", secret=False)
    keys.chmod(0o755)


# [security] follow_key_links = true: a key path that is a symbolic link (a Kubernetes secret volume:
# NAME -> ..data/NAME, ..data -> ..TIMESTAMP/, all root's, in a sticky mount point) is followed, and
# every link, every directory holding one (sticky allowed: the link's owner is checked) and the
# directory holding the key file itself (not sticky) and those above are held to the usual rules.


def secret_volume(tmp_path: Path, keys: Path) -> Path:
    """A Kubernetes secret volume's layout: volume/NAME -> ..data/NAME, ..data -> ..TIMESTAMP."""
    volume = tmp_path / "volume"
    volume.mkdir()
    volume.chmod(0o1777)  # what the kubelet's tmpfs mount point is: drwxrwxrwt root root
    timestamped = volume / "..2026_12_02_10_00_00.123456789"
    timestamped.mkdir(mode=0o755)
    secrets = ("core1.key_secret", "cluster.key_secret", "ops.key_secret")  # a node's and a client's
    for name, mode in (*((secret, 0o400) for secret in secrets), ("cluster.key", 0o444)):
        shutil.copy(keys / name, timestamped / name)
        (timestamped / name).chmod(mode)
        (volume / name).symlink_to(Path("..data") / name)
    (volume / "..data").symlink_to(timestamped.name)
    return volume


def test_a_key_file_link_is_followed_only_when_the_config_says_so(keys: Path, tmp_path: Path) -> None:
    volume = secret_volume(tmp_path, keys)
    expected = load_key(str(keys / "core1.key_secret"), "key", secret=True)
    with pytest.raises(
        SecurityError, match=rf"key: {volume / 'core1.key_secret'} is a symbolic link.*follow_key_links"
    ):
        load_key(str(volume / "core1.key_secret"), "key", secret=True)
    assert load_key(str(volume / "core1.key_secret"), "key", secret=True, follow_links=True) == expected
    server = load_key(str(volume / "cluster.key"), "server_key", secret=False, follow_links=True)
    assert server.public == load_key(str(keys / "cluster.key"), "server_key", secret=False).public
    elsewhere = tmp_path / "elsewhere"  # a relative target through "..", and an absolute one
    elsewhere.mkdir(mode=0o755)
    (elsewhere / "relative.key_secret").symlink_to(Path("..") / "volume" / "core1.key_secret")
    (elsewhere / "absolute.key_secret").symlink_to(volume / "core1.key_secret")
    for name in ("relative.key_secret", "absolute.key_secret"):
        assert load_key(str(elsewhere / name), "key", secret=True, follow_links=True) == expected
    (volume / "..2026_12_02_10_00_00.123456789" / "core1.key_secret").chmod(0o440)  # the file itself: as strict
    with pytest.raises(
        SecurityError, match=r"key: .*/\.\.2026_12_02_10_00_00\.123456789/core1\.key_secret is readable"
    ):
        load_key(str(volume / "core1.key_secret"), "key", secret=True, follow_links=True)


def test_a_node_follows_key_file_links_with_follow_key_links(keys: Path, tmp_path: Path) -> None:
    from mnesite.rlog.security import NodeSecurity

    volume = secret_volume(tmp_path, keys)
    toml = security_toml(keys, ROLES).replace(str(keys / "core1.key_secret"), str(volume / "core1.key_secret"))
    toml = toml.replace(str(keys / "cluster.key_secret"), str(volume / "cluster.key_secret"))
    path = _node_toml(tmp_path, toml)
    assert load_config(str(path)).security.follow_key_links is False  # the default
    with pytest.raises(SecurityError, match=r"\[security\].server_key: .* is a symbolic link"):
        NodeSecurity(load_config(str(path)).security)
    path.write_text(path.read_text().replace("[security]\n", "[security]\nfollow_key_links = true\n"))
    security = NodeSecurity(load_config(str(path)).security)
    assert security.client == load_key(str(keys / "core1.key_secret"), "key", secret=True)
    with pytest.raises(ConfigError, match=r"\[security\].follow_key_links must be true or false"):
        parse_config({"security": {"follow_key_links": "yes"}})


@pytest.mark.parametrize(
    ("writable", "mode"),
    [("volume", 0o777), ("timestamped", 0o777), ("timestamped", 0o1777), ("above", 0o777)],
    ids=["volume-777", "timestamped-777", "timestamped-sticky", "above-777"],
)
def test_a_followed_key_link_with_a_directory_on_the_way_others_can_write_is_refused(
    keys: Path, tmp_path: Path, writable: str, mode: int
) -> None:
    """The directory holding a link may be sticky (the link's owner is checked; in a sticky directory
    no one else can rename it), the one holding the key file may not; any that others can write and
    that is not sticky is refused by name."""
    volume = secret_volume(tmp_path, keys)
    timestamped = volume / "..2026_12_02_10_00_00.123456789"
    directory = {"volume": volume, "timestamped": timestamped, "above": tmp_path}[writable]
    directory.chmod(mode)
    link = volume / "core1.key_secret"
    entry = link if writable == "volume" else timestamped / "core1.key_secret"
    power = f"another directory in place of {volume}" if writable == "above" else f"another file in place of {entry}"
    with pytest.raises(
        SecurityError,
        match=rf"key: {directory} is writable by other users, who could put {power}; chmod go-w {directory}$",
    ):
        load_key(str(link), "key", secret=True, follow_links=True)
    directory.chmod(0o700)


@pytest.mark.parametrize("owned", ["core1.key_secret", "..data"])
def test_a_followed_key_link_another_user_owns_is_refused(
    keys: Path, tmp_path: Path, owned: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every link on the way is checked, the ``..data`` link among the directories of the first one's
    target too: its owner could point it elsewhere."""
    if os.geteuid() != 0:
        pytest.skip("needs a symbolic link another user owns: run as root")
    volume = secret_volume(tmp_path, keys)
    os.lchown(volume / owned, 12345, -1)
    with pytest.raises(
        SecurityError,
        match=rf"key: {volume / owned} is a symbolic link owned by uid 12345, not by this user .* or root: "
        rf"its owner could point it at another file; chown -h",
    ):
        load_key(str(volume / "core1.key_secret"), "key", secret=True, follow_links=True)


def test_a_chain_or_loop_of_key_file_links_is_refused_after_a_bounded_number(keys: Path) -> None:
    from mnesite.rlog.security import KEY_LINK_HOPS_MAX

    previous = keys / "app.key_secret"
    for hop in range(KEY_LINK_HOPS_MAX):
        link = keys / f"hop{hop}.key_secret"
        link.symlink_to(previous.name)
        previous = link
    assert load_key(str(previous), "key", secret=True, follow_links=True).secret
    (keys / "one-more.key_secret").symlink_to(previous.name)
    for path in (keys / "one-more.key_secret", keys / "loop.key_secret"):
        if not path.is_symlink():
            path.symlink_to(path.name)  # a link to itself
        with pytest.raises(SecurityError, match=rf"key: {path} leads through more than {KEY_LINK_HOPS_MAX} symbolic"):
            load_key(str(path), "key", secret=True, follow_links=True)


@pytest.mark.parametrize(
    "text",
    [b"", b"curve\n    public-key\n", b'curve\n    public-key = "short"\n', b"\xff\xfe" * 40_000],
)
def test_a_key_file_that_is_not_a_certificate_is_refused_with_its_path(keys: Path, text: bytes) -> None:
    path = keys.parent / "authorized" / "broken.key"
    path.write_bytes(text)
    path.chmod(0o644)
    with pytest.raises(SecurityError, match=rf"authorized_keys: .*{path}"):
        load_authorized_keys(str(path.parent))


# ---------------------------------------------------------------- roles


def test_every_kind_names_its_roles_and_admin_may_send_everything() -> None:
    table = RoleTable(ROLES_WITH_READER)
    for kind in KIND_ROLES:
        assert table.refusal("ops", kind) is None
    assert table.refusal("dashboard", "get") is None and table.refusal("dashboard", "transact")
    assert table.refusal("app", "transact") is None
    for kind in ("create_table", "force_start", "stop", "peer", "watch", "push", "push_ack"):
        assert table.refusal("app", kind), kind
    for kind in ("peer", "push", "force_start", "stop"):
        assert table.refusal("replicant1", kind), kind
    assert table.refusal("replicant1", "watch") is None and table.refusal("replicant1", "transact") is None
    assert table.refusal("core1", "peer") is None and table.refusal("core1", "force_start")
    assert table.refusal("core1", "stop") and table.refusal("dashboard", "count") is None
    assert "needs one of: admin, core" in (table.refusal("nobody", "peer") or "")
    assert table.refusal("ops", "a_kind_nobody_has_decided_on") is None
    assert table.refusal("core1", "a_kind_nobody_has_decided_on")


def test_every_request_kind_the_codec_accepts_has_a_role_entry() -> None:
    # A kind missing from the table is admin-only: a new request kind must be placed deliberately.
    assert set(messages.SCHEMAS) - {"reply", "error"} == set(KIND_ROLES)


def test_a_body_sender_must_be_the_authenticated_principal() -> None:
    peer = {"shard": "default", "message": [1, "vote_request"]}
    watch = {"shard": "default", "endpoint": "tcp://127.0.0.1:1", "from": [0, 0], "from_digest": b"", "protocol": 1}
    push = {"shard": "default", "agent": "a", "entries": [], "committed": [0, 0], "hears_sequencer": True}
    assert sender_mismatch("core1", "peer", typed_body("peer", {**peer, "sender": "core1"})) is None
    assert "claims sender 'core2'" in (
        sender_mismatch("core1", "peer", typed_body("peer", {**peer, "sender": "core2"})) or ""
    )
    assert sender_mismatch("core1", "push", typed_body("push", {**push, "core": "core2"}))
    assert sender_mismatch("replicant1", "watch", typed_body("watch", {**watch, "replicant": "replicant2"}))
    assert sender_mismatch("app", "transact", typed_body("transact", {"ops": []})) is None


# ---------------------------------------------------------------- a secured core in a thread


class SecureNode(ServedCore):
    def __init__(self, tmp_path: Path, keys: Path) -> None:
        self.keys = keys
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.config_path = tmp_path / "core1.toml"
        self.write_config(ROLES_WITH_READER)
        super().__init__(CoreNode(load_config(str(self.config_path))))

    def write_config(self, roles: dict[str, list[str]]) -> None:
        self.config_path.write_text(
            f'[node]\nname = "core1"\ndata_dir = "{self.keys.parent / "secure-data"}"\nlisten = "{self.endpoint}"\n'
            f'[cluster]\ncore_nodes = {{ core1 = "{self.endpoint}" }}\n'
            '[storage]\nsynchronous = "NORMAL"\n' + security_toml(self.keys, roles)
        )

    def client(self, principal: str | None, **kwargs) -> Client:
        if principal is None:
            return Client(self.endpoint, timeout_ms=3000, **kwargs)
        key = self.keys / f"{principal}.key_secret"
        return Client(self.endpoint, timeout_ms=3000, key=key, server_key=self.keys / "cluster.key", **kwargs)

    def security(self) -> dict:
        with self.client("ops") as client:
            return client.status()["security"]


@pytest.fixture
def secure_node(tmp_path: Path, keys: Path):
    node = SecureNode(tmp_path, keys)
    try:
        yield node
    finally:
        node.stop()


def _secure_core(tmp_path: Path, keys: Path, roles: dict[str, list[str]], sections: str) -> CoreNode:
    """A single core (not bound) with [security] and ``roles``, from ``tmp_path/core1.toml``; ``sections``:
    the TOML between its [cluster] and its [security]."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config_path = tmp_path / "core1.toml"
    config_path.write_text(
        f'[node]\nname = "core1"\ndata_dir = "{tmp_path / "data"}"\nlisten = "{endpoint}"\n'
        f'[cluster]\ncore_nodes = {{ core1 = "{endpoint}" }}\n' + sections + security_toml(keys, roles)
    )
    return CoreNode(load_config(str(config_path)))


@contextlib.contextmanager
def _secure_core_with_table_t(
    tmp_path: Path, keys: Path, roles: dict[str, list[str]], sections: str
) -> Iterator[CoreNode]:
    """``_secure_core`` bound, not served (the test steps its driver), with its table t committed;
    closed after the block."""
    node = _secure_core(tmp_path, keys, roles, sections)
    node.bind()
    try:
        commit_table_t(node)
        yield node
    finally:
        node.close()


def test_a_flood_of_client_connections_leaves_room_for_a_replicants_and_a_cores_requests(
    tmp_path: Path, keys: Path
) -> None:
    """Regression: a core counted its peers' connections (a core forwarding its clients' writes, a
    replicant forwarding its own) against ``connections_waiting_max`` as client connections, so a
    flood of clients with requests waiting had the peers' requests refused ``overloaded``. With
    [security], a principal with the ``core`` or ``replicant`` role has ``PEER_CONNECTIONS_RESERVED``
    more places; a writer is refused at the bound as before, forwarded mark or not."""
    from tests.test_untrusted_input import _write_frame, answers_of_turns

    sections = '[limits]\nconnections_waiting_max = 2\n[storage]\nsynchronous = "NORMAL"\n'
    with _secure_core_with_table_t(tmp_path, keys, ROLES, sections) as node:
        node.hold([b"a"], "r1")
        node.hold([b"b"], "r1")
        node._backlog.append(([b"replicant1"], _write_frame("replicant-1", 1), "replicant1"))
        node._backlog.append(([b"core2"], _write_frame("core-1", 2, forwarded=True), "core2"))
        node._backlog.append(([b"app"], _write_frame("app-1", 3, forwarded=True), "app"))
        answers = answers_of_turns(node, {b"replicant1", b"core2", b"app"})
    assert answers[b"app"].kind == "error" and answers[b"app"].body.code == "overloaded", answers
    assert answers[b"replicant1"].kind == "reply" and answers[b"core2"].kind == "reply", answers


def raw_request(node: SecureNode, principal: str, frame: Message | bytes) -> Message:
    """Send one hand-made frame with ``principal``'s key; return the node's answer."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        pair = load_key(str(node.keys / f"{principal}.key_secret"), "key", secret=True)
        configure_client(socket, pair, load_key(str(node.keys / "cluster.key"), "key", secret=False).public)
        socket.connect(node.endpoint)
        socket.send(messages.encode(frame) if isinstance(frame, Message) else frame)
        if not socket.poll(5000):
            raise AssertionError(f"no answer to {frame!r}")
        return messages.decode(socket.recv())
    finally:
        socket.close(0)


def test_status_says_whether_security_is_on_and_what_it_refused(secure_node, thread_node) -> None:
    keys = [
        "--key",
        str(secure_node.keys / "dashboard.key_secret"),
        "--server-key",
        str(secure_node.keys / "cluster.key"),
    ]
    with secure_node.client("dashboard") as reader, pytest.raises(Forbidden):
        reader.put("kv", {"id": 1})
    shown = CliRunner().invoke(main, ["status", "--node", secure_node.endpoint, *keys])
    assert shown.exit_code == 0, shown.output
    assert "security: CurveZMQ, 6 authorized keys; refused:" in shown.output and "1 by role" in shown.output
    plain = CliRunner().invoke(main, ["status", "--node", thread_node.endpoint])
    assert "security: OFF (loopback only)" in plain.output
    refused = CliRunner().invoke(main, ["status", "--node", secure_node.endpoint, "--timeout-ms", "3000"])
    assert refused.exit_code == 1 and "give --key and --server-key" in refused.output


def test_clients_without_a_key_or_with_an_unknown_key_are_refused_before_the_decoder(secure_node) -> None:
    with (
        secure_node.client(None, retries=0) as client,
        pytest.raises(Unauthenticated, match="--key and --server-key") as no_key,
    ):
        client.status()
    assert no_key.value.refused is None  # no key offered: nothing to authorize
    with (
        secure_node.client("stranger", retries=0) as client,
        pytest.raises(Unauthenticated, match="authorized_keys") as unknown,
    ):
        client.status()
    assert unknown.value.refused == REFUSED_KEY  # a caller (a core's recovery) can say which key to authorize

    def counted() -> bool:
        security = secure_node.security()
        return security["refused_unknown_key"] >= 1 and security["handshakes_failed"]["auth"] >= 1

    wait_until(counted, 10, "the refusals to be counted in status")
    assert (
        secure_node.security()["handshakes_failed"]["protocol"]
        + secure_node.security()["handshakes_failed"]["no_detail"]
        >= 1
    )


def test_roles_decide_what_each_key_may_send(secure_node) -> None:
    with secure_node.client("ops") as admin:
        admin.create_table("kv", "id", [("id", "INTEGER"), ("value", "TEXT")])
    with secure_node.client("app") as writer:
        writer.put("kv", {"id": 1, "value": "a"})
        with pytest.raises(Forbidden, match="app \\(writer\\) may not send create_table"):
            writer.create_table("other", "id")
        with pytest.raises(Forbidden, match="force_start"):
            writer.force_start()
    with secure_node.client("dashboard") as reader:
        assert reader.get("kv", 1) == {"id": 1, "value": "a"}
        with pytest.raises(Forbidden, match="may not send transact"):
            reader.put("kv", {"id": 2, "value": "b"})
    assert secure_node.security()["refused_role"] == 3
    with secure_node.client("ops") as admin:
        assert admin.get("kv", 2) is None
        assert [t["table"] for t in admin.list_tables()] == ["kv"]


def test_consensus_messages_need_a_core_key_that_matches_the_sender(secure_node) -> None:
    forged = {"shard": "default", "sender": "core2", "message": message_to_wire(VoteRequest(1000, TxKey(99, 99)))}
    before = secure_node.node.shards["default"].consensus.generation if "default" in secure_node.node.shards else 0
    for principal in ("replicant1", "app", "ops"):
        if principal == "ops":
            continue  # admin may send every kind; its sender field still has to match (below)
        answer = raw_request(secure_node, principal, Message("peer", "forged", forged))
        assert answer.kind == "error" and answer.body.code == "forbidden", answer
    answer = raw_request(secure_node, "core1", Message("peer", "forged", forged))
    assert answer.body.code == "forbidden" and "claims sender 'core2'" in answer.body.message
    answer = raw_request(secure_node, "ops", Message("peer", "forged", forged))
    assert answer.body.code == "forbidden" and "comes from ops" in answer.body.message
    security = secure_node.security()
    assert security["refused_role"] == 2 and security["refused_sender"] == 2
    after = secure_node.node.shards["default"].consensus.generation if "default" in secure_node.node.shards else 0
    assert after == before


def test_a_bootstrap_batch_names_only_its_own_core_as_the_copys_sender(secure_node) -> None:
    """A learner core names itself in its bootstrap batches (``sender``) so that the sequencer counts
    its snapshot copy (``core.snapshot.CopiesServed``): any key allowed to read batches could name
    another core and have the sequencer count a copy for it. A named sender must be the principal,
    as every sender field (refused ``forbidden``, counted in ``refused_sender``); a batch that names
    none (a replicant's, or a learner's of a release before the field) is served as before."""
    with secure_node.client("ops") as admin:
        admin.create_table("kv", "id", [("id", "INTEGER"), ("value", "TEXT")])
        admin.put("kv", {"id": 1, "value": "a"})
    forged = {"table": "kv", "limit": 10, "sender": "core2"}
    for principal in ("replicant1", "core1", "ops"):
        answer = raw_request(secure_node, principal, Message("bootstrap_batch", f"forged-{principal}", forged))
        assert answer.kind == "error" and answer.body.code == "forbidden", answer
        assert f"bootstrap_batch claims sender 'core2' but comes from {principal}" in answer.body.message
    assert secure_node.security()["refused_sender"] == 3
    own = raw_request(secure_node, "core2", Message("bootstrap_batch", "own", forged))
    unnamed = raw_request(
        secure_node, "replicant1", Message("bootstrap_batch", "unnamed", {"table": "kv", "limit": 10})
    )
    for answer in (own, unnamed):
        assert answer.kind == "reply" and answer.body.result["rows"] == [{"id": 1, "value": "a"}], answer
    assert secure_node.security()["refused_sender"] == 3


def test_sighup_reloads_authorized_keys_and_roles(secure_node, keys: Path) -> None:
    generate_keys("newapp", str(keys))
    with secure_node.client("newapp", retries=0) as client, pytest.raises(Unauthenticated):
        client.status()
    shutil.copy(keys / "newapp.key", keys.parent / "authorized")
    secure_node.write_config({**ROLES_WITH_READER, "writer": ["app", "newapp"]})
    secure_node.node.reload_requested.set()  # what the SIGHUP handler does
    wait_until(lambda: secure_node.security()["reloads"] == 1, 10, "the reload")
    with secure_node.client("ops") as admin:
        admin.create_table("kv", "id", [("id", "INTEGER")])
    with secure_node.client("newapp") as client:
        client.put("kv", {"id": 1})
    # A broken reload keeps the current tables.
    secure_node.config_path.write_text(secure_node.config_path.read_text().replace("[security.roles]", "[oops"))
    secure_node.node.reload_requested.set()
    with secure_node.client("newapp") as client:
        client.put("kv", {"id": 2})
    assert secure_node.security()["reloads"] == 1


@pytest.mark.parametrize("revoked", ["removed", "replaced"])
def test_a_read_held_across_a_reload_that_removed_its_key_is_answered_forbidden(
    secure_node, keys: Path, revoked: str
) -> None:
    """A key removed by a reload "stops working at the reload, on connections it already holds too": new
    frames were refused, but a read held before the reload (here a query waiting for a key; a
    changefeed page and a replicant's read wait the same way) was answered with the data once its key
    was applied. Its answer is now ``forbidden``; a write's outcome is still told (it was allowed when
    sent). Regression: a key *replaced* by a new key of the same principal (a rotation after a leak) was
    still answered, the check being by the principal's name, which the new key holds."""
    with secure_node.client("ops") as admin:
        admin.create_table("kv", "id", [("id", "INTEGER"), ("v", "TEXT")])
        written = admin.put("kv", {"id": 1, "v": "secret"})
    answers: list[object] = []

    def held_read() -> None:
        ahead = TxKey(written.generation, written.counter + 2)  # applied only after two more writes
        key, server_key = keys / "app.key_secret", keys / "cluster.key"
        with Client(secure_node.endpoint, timeout_ms=8000, retries=0, key=key, server_key=server_key) as app:
            try:
                answers.append(list(app.query("SELECT v FROM kv WHERE id = 1", after_tx_key=ahead)))
            except MnesiteError as error:
                answers.append(error)

    reader = threading.Thread(target=held_read)
    reader.start()
    try:
        wait_until(lambda: secure_node.node.outstanding, 10, "the read to be held")
        (keys.parent / "authorized" / "app.key").unlink()
        if revoked == "replaced":
            generate_keys("app2", str(keys))
            shutil.copy(keys / "app2.key", keys.parent / "authorized" / "app.key")
        secure_node.write_config(ROLES_WITH_READER)
        secure_node.node.reload_requested.set()
        wait_until(lambda: secure_node.security()["reloads"] == 1, 10, "the reload")
        with secure_node.client("ops") as admin:
            admin.put("kv", {"id": 2, "v": "b"})
            admin.put("kv", {"id": 3, "v": "c"})
    finally:
        reader.join(timeout=15)
    [answer] = answers
    assert isinstance(answer, MnesiteError) and answer.code == "forbidden", answer
    assert "removed by a reload" in str(answer)
    assert secure_node.security()["refused_unknown_key"] == 1  # counted as its key's refusal


def test_a_sighup_reload_refuses_an_authorized_keys_directory_others_can_write_and_keeps_the_old_keys(
    secure_node, keys: Path, caplog: pytest.LogCaptureFixture
) -> None:
    generate_keys("newapp", str(keys))
    authorized = keys.parent / "authorized"
    shutil.copy(keys / "newapp.key", authorized)
    authorized.chmod(0o777)  # anyone could have put newapp.key there
    secure_node.write_config({**ROLES_WITH_READER, "writer": ["app", "newapp"]})
    with caplog.at_level(logging.ERROR, logger="mnesite.server"):
        secure_node.node.reload_requested.set()  # what the SIGHUP handler does
        wait_until(lambda: "keeping the current keys" in caplog.text, 10, "the refused reload")
    assert f"{authorized} is writable by other users" in caplog.text and "chmod go-w" in caplog.text
    assert secure_node.security()["reloads"] == 0
    with secure_node.client("newapp", retries=0) as client, pytest.raises(Unauthenticated):
        client.status()
    authorized.chmod(0o755)
    secure_node.node.reload_requested.set()
    wait_until(lambda: secure_node.security()["reloads"] == 1, 10, "the reload")
    with secure_node.client("newapp") as client:
        client.status()


def test_a_backup_cannot_be_written_as_a_key_file_in_authorized_keys(secure_node, keys: Path) -> None:
    """Regression: a backup could be named ``NAME.key`` in the authorized_keys directory. The file is the
    node's own (mode 0600), and a backup of a small database is 64 KiB, the most a key file may be: a
    row holding a ``public-key = "..."`` line (any writer's) made it a certificate, so at the next
    reload that key became the principal NAME with NAME's roles (here a revoked writer's name, still
    in [security.roles]); a larger backup stopped every later reload instead. Key files' names are
    refused as backup paths."""
    stranger = load_key(str(keys / "stranger.key_secret"), "key", secret=True).public.decode()
    authorized = keys.parent / "authorized"
    with secure_node.client("ops") as admin:
        admin.create_table("notes", "id", [("id", "INTEGER"), ("v", "TEXT")])
    with secure_node.client("app") as app:
        app.put("notes", {"id": 1, "v": f'\npublic-key = "{stranger}"\n'})
    (authorized / "app.key").unlink()  # app revoked; its name stays in the roles
    secure_node.node.reload_requested.set()  # what the SIGHUP handler does
    wait_until(lambda: secure_node.security()["reloads"] == 1, 10, "the reload")
    with secure_node.client("ops") as admin:
        for name in ("app.key", "app.key_secret"):
            with pytest.raises(MnesiteError, match="must not end in .key") as refused:
                admin.backup(str(authorized / name))
            assert refused.value.code == "backup_refused"
    assert sorted(os.listdir(authorized)) == sorted(f"{name}.key" for name in PRINCIPALS[1:] if name != "app")
    secure_node.node.reload_requested.set()
    wait_until(lambda: secure_node.security()["reloads"] == 2, 10, "the second reload")
    with secure_node.client("stranger", retries=0) as client, pytest.raises(Unauthenticated):
        client.put("notes", {"id": 2})


def test_a_frame_from_an_authenticated_key_still_goes_through_the_decoder(secure_node) -> None:
    answer = raw_request(secure_node, "app", msgpack.packb([1, "get"]))
    assert answer.kind == "error" and answer.body.code == "bad_frame"


@pytest.mark.parametrize(
    ("age", "expected"),
    [(None, 0), ({"generation": 7}, 7), ({"generation": "7"}, -1), ({"generation": True}, -1), ([7], -1)],
)
def test_a_peers_journal_answer_is_checked_before_a_force_start_uses_it(age, expected) -> None:
    from mnesite.core.recovery import journal_generation

    shards = {} if age is None else {"default": age}
    assert journal_generation({"shards": shards}, "default") == expected


def test_an_insecure_node_says_so_at_every_start(tmp_path: Path, caplog) -> None:
    config = parse_config(
        {
            "node": {"data_dir": str(tmp_path / "data"), "listen": f"tcp://127.0.0.1:{free_port()}"},
            "security": {"insecure": True},
        }
    )
    for _ in range(2):
        node = CoreNode(config)
        with caplog.at_level("WARNING", logger="mnesite.server"):
            node.bind()
        node.close()
    warnings = [r for r in caplog.records if "WITHOUT authentication" in r.getMessage()]
    assert len(warnings) == 2


def test_sighup_revokes_a_removed_or_replaced_key_on_connections_already_open(secure_node, keys: Path) -> None:
    """The ZAP handshake runs once per connection: a key taken out of authorized_keys (or replaced by a
    new key of the same principal) and reloaded must stop working on a connection it already holds,
    not only on the next one."""
    with secure_node.client("ops") as admin:
        admin.create_table("kv", "id", [("id", "INTEGER")])
    generate_keys("app2", str(keys))  # the replacement key pair of principal "app"
    authorized = keys.parent / "authorized"
    with secure_node.client("app") as revoked, secure_node.client("dashboard") as rotated:
        revoked.put("kv", {"id": 1})  # both connections are open and authenticated now
        assert rotated.get("kv", 1) == {"id": 1}
        (authorized / "app.key").unlink()
        shutil.copy(keys / "app2.key", authorized / "dashboard.key")  # dashboard's key rotated
        secure_node.node.reload_requested.set()  # what the SIGHUP handler does
        wait_until(lambda: secure_node.security()["reloads"] == 1, 10, "the reload")
        with pytest.raises(Forbidden, match="no longer in authorized_keys"):
            revoked.put("kv", {"id": 2})
        with pytest.raises(Forbidden, match="no longer in authorized_keys"):
            rotated.get("kv", 1)
    with secure_node.client("ops") as admin:
        assert admin.get("kv", 2) is None  # the revoked key wrote nothing
    with secure_node.client("app2") as fresh:  # dashboard's new key is the principal dashboard
        assert fresh.get("kv", 1) == {"id": 1}


def test_a_role_given_to_a_principal_without_a_key_is_logged_at_start_and_reload(
    keys: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``[security.roles]`` naming a principal that has no key in authorized_keys (a typo: "opps" for
    "ops") was accepted without a word: the operator learnt it only when "ops" was refused."""
    from mnesite.rlog.security import NodeSecurity, SecurityConfig

    def config(roles: dict[str, tuple[str, ...]]) -> SecurityConfig:
        return SecurityConfig(
            False,
            str(keys / "cluster.key_secret"),
            str(keys / "core1.key_secret"),
            str(keys.parent / "authorized"),
            roles,
        )

    with caplog.at_level("WARNING", logger="mnesite.security"):
        security = NodeSecurity(config({"core": ("core1", "core2"), "admin": ("opps",)}))
    assert [r.getMessage() for r in caplog.records] == [
        "[security.roles] names principals with no key in authorized_keys (a typo?): opps (admin)"
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="mnesite.security"):
        security.reload(config({"core": ("core1",), "admin": ("ops",), "reader": ("dashbord", "stranger")}))
    assert [r.getMessage() for r in caplog.records] == [
        "[security.roles] names principals with no key in authorized_keys (a typo?): dashbord (reader), "
        "stranger (reader)"
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="mnesite.security"):
        security.reload(config({"core": ("core1",), "admin": ("ops",)}))
    assert caplog.records == []


def test_refused_requests_log_a_line_a_second_of_each_kind_of_refusal(keys: Path, tmp_path: Path, caplog) -> None:
    """Every refusal is counted (``status`` ``security``); the log says at most a line a second of
    each kind (a role's refusal, a forged sender, a key a reload removed), so that a flood of one kind
    hides no other, and the last one left out, with the count of the others, once the second is over."""
    from types import SimpleNamespace

    from mnesite.rlog.security import NodeSecurity, SecurityConfig

    from tests.conftest import replicant_by_hand

    with replicant_by_hand(tmp_path / "r") as node:
        now = [0]
        node.warnings.clock = lambda: now[0]
        node.security = NodeSecurity(
            SecurityConfig(
                False,
                str(keys / "cluster.key_secret"),
                str(keys / "replicant1.key_secret"),
                str(keys.parent / "authorized"),
                {role: tuple(names) for role, names in ROLES.items()},
            )
        )
        stop = Message("stop", "s", {})
        forged = Message("peer", "p", SimpleNamespace(sender="core2"))
        caplog.set_level(logging.WARNING, logger="mnesite.server")
        for _ in range(1000):
            for principal, message in (("app", stop), ("core1", forged), ("", stop)):
                assert node.refusal(principal, message) is not None
        security = node.security
        assert (security.refused_role, security.refused_sender, security.refused_unknown_key) == (1000, 1000, 1000)
        lines = [record.getMessage() for record in caplog.records]
        assert [line.split(":")[0] for line in lines] == ["refused", "refused a forged sender", "refused"], lines
        assert "app (writer) may not send stop" in lines[0] and "peer claims sender 'core2'" in lines[1]
        now[0] = 999
        node.warnings.flush()
        assert len(caplog.records) == 3
        now[0] = 1000
        node.warnings.flush()
        assert [record.getMessage() for record in caplog.records][3:] == [
            line + " (and 998 more like it in the last 1000 ms)" for line in lines
        ]


@pytest.mark.parametrize("revoked", ["key", "role", "replaced key"])
def test_sighup_stops_the_agents_of_a_replicant_whose_key_or_role_it_revoked(secure_node, keys: Path, revoked) -> None:
    """A revoked replicant's frames are refused after the reload, but the agent its watch created kept
    pushing it every new commit (the core is the CurveZMQ client of those pushes, so no frame of the
    replicant's is needed for them) until its window filled or its acknowledgement timeout ran out.
    The reload must stop the agents of a replicant that may no longer watch. Regression: a key replaced
    by a new key of the same principal (rotated after a leak) left the old key's agent pushing to the
    endpoint the old key named; the new key watches again."""
    with secure_node.client("ops") as admin:
        admin.create_table("kv", "id", [("id", "INTEGER")])
    context = zmq.Context.instance()
    cluster_key = load_key(str(keys / "cluster.key_secret"), "key", secret=True)
    receiver = context.socket(zmq.ROUTER)  # the replicant's endpoint, where the core pushes
    receiver.setsockopt(zmq.LINGER, 0)
    configure_server(receiver, cluster_key)
    requests = context.socket(zmq.DEALER)  # the replicant's connection to the core
    requests.setsockopt(zmq.LINGER, 0)
    configure_client(requests, load_key(str(keys / "replicant1.key_secret"), "key", secret=True), cluster_key.public)
    try:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        receiver.bind(endpoint)
        requests.connect(secure_node.endpoint)
        requests.send(messages.encode(Message("watch", "w1", watch_body("replicant1", endpoint, watch_id="w1"))))
        assert requests.poll(5000), "the core did not answer the watch"
        assert messages.decode(requests.recv()).kind == "reply"
        assert receiver.poll(5000), "the core pushed nothing to the watch's endpoint"
        push = messages.decode(receiver.recv_multipart()[-1])
        assert push.kind == "push"
        # A live replicant: acknowledge what was read (echoing the push's token), so only the reload can stop it.
        ack = {"shard": "default", "agent": push.body.agent, "applied": push.body.committed, "token": push.body.token}
        requests.send(messages.encode(Message("push_ack", "ack", ack)))

        def acknowledged() -> bool:
            with secure_node.client("ops") as admin:
                return [agent["acked"] for agent in admin.status()["agents"]] == [list(push.body.committed)]

        wait_until(acknowledged, 5, "the agent to take the acknowledgement")
        if revoked == "key":
            (keys.parent / "authorized" / "replicant1.key").unlink()
        elif revoked == "replaced key":
            generate_keys("replicant1-rotated", str(keys))
            (keys.parent / "authorized" / "replicant1.key").unlink()
            shutil.copy(keys / "replicant1-rotated.key", keys.parent / "authorized" / "replicant1.key")
        else:
            secure_node.write_config({**ROLES_WITH_READER, "replicant": []})
        secure_node.node.reload_requested.set()  # what the SIGHUP handler does
        wait_until(lambda: secure_node.security()["reloads"] == 1, 10, "the reload")
        with secure_node.client("ops") as admin:
            assert admin.status()["agents"] == [], "the revoked replicant's agent outlived the reload"
    finally:
        receiver.close(0)
        requests.close(0)


@pytest.mark.parametrize("secure", [True, False])
def test_a_sighup_names_the_edited_keys_it_does_not_apply(
    tmp_path: Path, keys: Path, caplog: pytest.LogCaptureFixture, secure: bool
) -> None:
    """Regression: a reload applied [security] authorized_keys and roles and ignored every other key
    edited in the file without a word (an operator who lowered a limit and sent SIGHUP saw nothing
    change). One line names each such key: it takes effect only at a restart; the roles are applied."""
    node = _secure_core(tmp_path, keys, ROLES_WITH_READER, "[limits]\nscan_rows_max = 100\n")
    config_path = tmp_path / "core1.toml"
    if not secure:
        config_path.write_text(config_path.read_text().split("[security]")[0])
        node.close()
        node = CoreNode(load_config(str(config_path)))
    try:
        text = config_path.read_text().replace("scan_rows_max = 100", "scan_rows_max = 200")
        config_path.write_text(text.replace('reader = ["dashboard"]', 'reader = ["dashboard", "app"]'))
        with caplog.at_level(logging.INFO, logger="mnesite.server"):
            node.reload_security()  # what the loop does at a SIGHUP, between two turns
        restart = [r.getMessage() for r in caplog.records if "only at a restart" in r.getMessage()]
        assert restart == ["SIGHUP: changed keys that take effect only at a restart: [limits].scan_rows_max"]
        assert node.config.limits.scan_rows_max == 100
        if secure:
            assert node.security is not None and node.security.roles.roles_of("app") == {"writer", "reader"}
            assert "SIGHUP: reloaded" in caplog.text
    finally:
        node.close()


@pytest.mark.parametrize("revoked", ["removed", "replaced"])
def test_a_frame_left_in_the_backlog_across_a_reload_that_revoked_its_key_is_refused(
    tmp_path: Path, keys: Path, revoked: str
) -> None:
    """Regression: a frame read off the socket but left for a later turn (``receive_frames``' backlog,
    a busy turn) kept the principal its key mapped to when it was read. A reload in between that
    removed the key, or replaced it with a new key of the same principal, did not reach it: a write of
    the revoked key was committed after the reload. It is refused as its key's next frame is."""
    from tests.test_untrusted_input import _write_frame, answers_of_turns

    with _secure_core_with_table_t(tmp_path, keys, ROLES_WITH_READER, '[storage]\nsynchronous = "NORMAL"\n') as node:
        node._backlog.append(([b"app"], _write_frame("app-1", 1), "app"))  # read before the reload
        node._backlog.append(([b"ops"], _write_frame("ops-1", 2), "ops"))
        authorized = keys.parent / "authorized"
        (authorized / "app.key").unlink()
        if revoked == "replaced":
            generate_keys("app2", str(keys))
            shutil.copy(keys / "app2.key", authorized / "app.key")
        node.reload_security()  # what the loop does at a SIGHUP, between two turns
        assert node.security is not None and node.security.reloads == 1
        answers = answers_of_turns(node, {b"app", b"ops"})
        rows = [row["id"] for row in node.store.scan(node.store.catalog()["t"], None, 10)]
    assert answers[b"app"].kind == "error" and answers[b"app"].body.code == "forbidden", answers
    assert "no longer in authorized_keys" in answers[b"app"].body.message
    assert answers[b"ops"].kind == "reply", answers  # the others' frames are served
    assert rows == [2]


def test_only_a_core_key_puts_its_peer_frames_ahead_of_the_turn_budget(tmp_path: Path, keys: Path) -> None:
    """Frames that look like a consensus message are handled first and outside the turn's byte and
    time budget (DESIGN invariant 11). The look is the frame's first bytes, which any client can write:
    a writer (or a replicant) could make every frame of its own a forged peer frame of up to
    frame_bytes_max and have all of them decoded in one turn, holding back the cores' heartbeats.
    With [security] only a core's key buys that place; the others' frames wait in the budget."""
    node = _secure_core(tmp_path, keys, ROLES_WITH_READER, "[limits]\nturn_bytes_max = 1024\n")
    try:
        forged = b"\x94\x01\xa4peer" + b"x" * 1500  # over the turn's budget on its own (turn_bytes_max 1024)
        waiting = [([b"app"], forged, "app"), ([b"replicant1"], forged, "replicant1"), ([b"core1"], forged, "core1")]

        def receive() -> tuple[list[bytes], bytes, str]:
            if not waiting:
                raise zmq.Again()
            return waiting.pop(0)

        node.receive = receive  # type: ignore[method-assign]
        handled = [principal for _, _, principal in node.receive_frames(lambda: 0)]
        assert handled == ["core1"]  # first, and it spent the turn's budget: the others wait for the next turn
        assert [principal for _, _, principal in node._backlog] == ["app", "replicant1"]
    finally:
        node.close()


# The client side of follow_key_links: an application or the CLI in a pod with mounted secrets.


def test_a_client_follows_key_file_links_only_with_follow_key_links(secure_node, tmp_path: Path, keys: Path) -> None:
    """Regression: ``Client``, ``client_keys``, ``dbapi.connect`` and the CLI refused key files that are
    symbolic links, whatever the caller wanted, and said to set ``[security] follow_key_links`` (a node's
    setting), so an application in a pod with a Kubernetes secret volume could not connect. They take
    ``follow_key_links`` (``--follow-key-links``), off by default."""
    from mnesite.dbapi import InterfaceError, connect

    volume = secret_volume(tmp_path, keys)
    key, server_key = volume / "ops.key_secret", volume / "cluster.key"
    opt_in = rf"key: {key} is a symbolic link; .*--follow-key-links \(follow_key_links=True\)"
    with pytest.raises(MnesiteError, match=opt_in):
        Client(secure_node.endpoint, key=key, server_key=server_key)
    with pytest.raises(SecurityError, match=opt_in):
        client_keys(key, server_key)
    with pytest.raises(InterfaceError, match=opt_in):
        connect(secure_node.endpoint, key=key, server_key=server_key)
    expected = load_key(str(keys / "ops.key_secret"), "key", secret=True)
    assert client_keys(key, server_key, follow_links=True) == (
        expected,
        load_key(str(keys / "cluster.key"), "server_key", secret=False).public,
    )
    with Client(secure_node.endpoint, timeout_ms=3000, key=key, server_key=server_key, follow_key_links=True) as ops:
        assert ops.status()["security"]["authorized_keys"] == 6
        with ops.pinned() as pinned:  # the keys loaded, not the paths again
            assert pinned.status()["security"]["authorized_keys"] == 6
    with connect(secure_node.endpoint, key=key, server_key=server_key, follow_key_links=True) as connection:
        assert connection.client is not None and connection.client.status()["security"]["authorized_keys"] == 6


def test_a_client_refuses_a_followed_key_link_in_a_directory_others_can_write(
    secure_node, tmp_path: Path, keys: Path
) -> None:
    """The opt-in follows links, it does not lift the checks: a volume others can write (not sticky)
    could have its link repointed."""
    volume = secret_volume(tmp_path, keys)
    volume.chmod(0o777)
    try:
        with pytest.raises(MnesiteError, match=rf"key: {volume} is writable by other users.*chmod go-w {volume}$"):
            Client(
                secure_node.endpoint,
                key=volume / "ops.key_secret",
                server_key=keys / "cluster.key",
                follow_key_links=True,
            )
        with pytest.raises(SecurityError, match=rf"server_key: {volume} is writable by other users"):
            client_keys(keys / "ops.key_secret", volume / "cluster.key", follow_links=True)
    finally:
        volume.chmod(0o700)


def test_the_cli_follows_key_file_links_with_follow_key_links(secure_node, tmp_path: Path, keys: Path) -> None:
    volume = secret_volume(tmp_path, keys)
    status = ["status", "--node", secure_node.endpoint, "--timeout-ms", "3000"]
    status += ["--key", str(volume / "ops.key_secret"), "--server-key", str(volume / "cluster.key")]
    refused = CliRunner().invoke(main, status)
    assert refused.exit_code == 1 and "is a symbolic link" in refused.output, refused.output
    assert "--follow-key-links" in refused.output
    followed = CliRunner().invoke(main, [*status, "--follow-key-links"])
    assert followed.exit_code == 0 and "security: CurveZMQ, 6 authorized keys" in followed.output, followed.output
    from_env = CliRunner().invoke(main, status, env={"MNESITE_FOLLOW_KEY_LINKS": "1"})
    assert from_env.exit_code == 0 and "security: CurveZMQ" in from_env.output, from_env.output
    assert "--follow-key-links" in CliRunner().invoke(main, ["get", "--help"]).output


def test_compare_follows_key_file_links_with_follow_key_links(secure_node, tmp_path: Path, keys: Path) -> None:
    """Regression: ``mnesite compare`` (Spark's command, with its own --key and --server-key) had no
    --follow-key-links and built its ``Client`` without it, so a compare of ``tcp://`` replicas in a pod
    with a Kubernetes secret volume was refused. It takes the flag (and $MNESITE_FOLLOW_KEY_LINKS)."""
    volume = secret_volume(tmp_path, keys)
    with secure_node.client("ops") as client:
        client.create_table("kv", key="k", columns=[("k", "INTEGER"), ("v", "TEXT")])
    compare = ["compare", secure_node.endpoint, secure_node.endpoint, "--table", "missing", "--quiet"]
    compare += ["--timeout-ms", "3000", "--key", str(volume / "ops.key_secret")]
    compare += ["--server-key", str(volume / "cluster.key")]
    refused = CliRunner().invoke(main, compare)
    assert refused.exit_code == 2 and "is a symbolic link" in refused.output, refused.output
    assert "--follow-key-links" in refused.output
    # Followed, both replicas are opened and their catalogs read: the compare stops at the table no
    # replica has, before Spark starts.
    unknown = "unknown table 'missing': no replica has it (tables: kv)"
    followed = CliRunner().invoke(main, [*compare, "--follow-key-links"])
    assert followed.exit_code == 2 and unknown in followed.output, followed.output
    from_env = CliRunner().invoke(main, compare, env={"MNESITE_FOLLOW_KEY_LINKS": "1"})
    assert from_env.exit_code == 2 and unknown in from_env.output, from_env.output
    assert "--follow-key-links" in CliRunner().invoke(main, ["compare", "--help"]).output


def test_the_spark_data_source_follows_key_file_links_with_its_option(secure_node, tmp_path: Path, keys: Path) -> None:
    """Regression: the Spark data source's ``key`` and ``server_key`` options had no ``follow_key_links``
    beside them, so reading a ``tcp://`` node in a pod with a Kubernetes secret volume was refused. The
    option reaches the driver's ``Client`` and, in the spec sent to them, every executor's."""
    from mnesite.spark.datasource import MnesiteDataSource
    from mnesite.spark.replica import ReplicaError

    volume = secret_volume(tmp_path, keys)
    with secure_node.client("ops") as client:
        client.create_table("kv", key="k", columns=[("k", "INTEGER"), ("v", "TEXT")])
        for key in range(10):
            client.put("kv", {"k": key, "v": f"value {key}"})
    options = {"node": secure_node.endpoint, "table": "kv", "timeout_ms": "3000", "partitions": "3"}
    options |= {"key": str(volume / "ops.key_secret"), "server_key": str(volume / "cluster.key")}
    with pytest.raises(ReplicaError, match=r"is a symbolic link.*--follow-key-links"):
        MnesiteDataSource(options)
    with pytest.raises(ReplicaError, match=r"option follow_key_links must be true or false, got 'yes'"):
        MnesiteDataSource({**options, "follow_key_links": "yes"})
    source = MnesiteDataSource({**options, "follow_key_links": "True"})  # what .option(name, True) sends
    reader = source.reader(source.schema())
    # What the executors do, each with the reader's spec: open the node again and read a partition.
    rows = [row for partition in reader.partitions() for row in reader.read(partition)]
    assert rows == [(key, f"value {key}") for key in range(10)]


def test_a_peer_core_s_key_is_never_refused_for_connections_max(tmp_path: Path, keys: Path) -> None:
    # A flood of clients must not cut the cluster apart: a core's key passes connections_max.
    node = ServedCore(_secure_core(tmp_path, keys, ROLES, "[limits]\nconnections_max = 1\n"))
    endpoint = node.node.config.listen

    def client(principal: str) -> Client:
        key = keys / f"{principal}.key_secret"
        return Client(endpoint, timeout_ms=2000, retries=0, key=key, server_key=keys / "cluster.key")

    try:
        with client("ops") as ops, client("app") as app, client("core2") as core2:
            ops.status()
            with pytest.raises(Unavailable, match="connections_max"):
                app.put("t", {"id": 1})
            with contextlib.suppress(Forbidden):
                core2.status()  # answered, whatever its role may ask: the connection was let in
            assert ops.status()["connections"]["refused_open_max"] == 1
            # The refused connection is closed by zmq after its handshake: seen by the monitor a moment later.
            wait_until(lambda: ops.status()["connections"]["open"] == 2, 10, "the refused connection's close")
            assert ops.status()["security"]["handshakes_failed"]["auth"] == 0  # not a key's refusal
    finally:
        node.stop()


def test_a_rebuilt_core_whose_key_a_member_refuses_says_so_when_it_gives_up(tmp_path: Path, keys: Path, secure_node):
    """A core on an empty database declared ``existing`` whose key its one peer does not authorize: its
    probe is refused at the handshake every round, and the core gives up naming that refusal and what to
    do (authorize the key there, SIGHUP), not only that the peer did not answer."""
    from mnesite.rlog.store import StoreError

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config_path = tmp_path / "core2.toml"
    config_path.write_text(
        f'[node]\nname = "core2"\ndata_dir = "{tmp_path / "core2"}"\nlisten = "{endpoint}"\n'
        f'[cluster]\ncore_nodes = {{ core1 = "{secure_node.endpoint}", core2 = "{endpoint}" }}\n'
        'initial_cluster_state = "existing"\nrecovery_timeout_ms = 50\n[storage]\nsynchronous = "NORMAL"\n'
        f'[security]\nserver_key = "{keys / "cluster.key_secret"}"\nclient_key = "{keys / "stranger.key_secret"}"\n'
        f'authorized_keys = "{keys.parent / "authorized"}"\n[security.roles]\ncore = ["core1", "core2"]\n'
    )
    with pytest.raises(StoreError) as gave_up:
        CoreNode(load_config(str(config_path)))
    message = str(gave_up.value)
    assert (
        "1 did not: ['core1'] (heard []); core1 refused this core's key: authorize it there (copy the public key "
        in (message)
    )
    assert "into core1's authorized_keys) and send core1 SIGHUP; start it again" in message
    assert secure_node.security()["refused_unknown_key"] >= 1


def test_a_new_core_whose_key_the_cores_refuse_says_so_at_start_not_that_it_starts_a_new_cluster(
    tmp_path: Path, keys: Path, secure_node, caplog
):
    """Regression: a core being added whose key the running core does not authorize yet (not declared
    ``existing``: the README's add) heard no peer at its start-up recovery and logged that it starts
    "as a core of a new cluster". The peer refused its key and said nothing about history: the log
    now says that, and what to do (authorize the key there, SIGHUP), as a warning."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config_path = tmp_path / "core2.toml"
    config_path.write_text(
        f'[node]\nname = "core2"\ndata_dir = "{tmp_path / "core2"}"\nlisten = "{endpoint}"\n'
        f'[cluster]\ncore_nodes = {{ core1 = "{secure_node.endpoint}", core2 = "{endpoint}" }}\n'
        'recovery_timeout_ms = 50\n[storage]\nsynchronous = "NORMAL"\n'
        f'[security]\nserver_key = "{keys / "cluster.key_secret"}"\nclient_key = "{keys / "stranger.key_secret"}"\n'
        f'authorized_keys = "{keys.parent / "authorized"}"\n[security.roles]\ncore = ["core1", "core2"]\n'
    )
    with caplog.at_level(logging.INFO, logger="mnesite"):
        node = CoreNode(load_config(str(config_path)))
    node.close()
    said = [record for record in caplog.records if "empty database" in record.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, caplog.text
    assert "new cluster" not in said[0].getMessage()
    assert "peers refused this core's connection, so it cannot tell whether the cluster has history" in caplog.text
    assert "core1 refused this core's key: authorize it there (copy the public key file of core2's" in caplog.text
    assert "and send core1 SIGHUP" in caplog.text
    assert secure_node.security()["refused_unknown_key"] >= 1
