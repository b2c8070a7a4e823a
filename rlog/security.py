"""CurveZMQ keys, the ZAP handler that maps an authenticated key to a principal, and socket setup.

Theory of operation
-------------------
Every node binds its ROUTER as a CurveZMQ *server* with the cluster's server key pair (the same
``server_key`` file on every node), and connects its DEALERs (to peer cores and to replicants) as a
CurveZMQ *client* with its own key pair (``client_key``), pinning the cluster's server public key.
A client (``rlog.client.Client``, the CLI) does the same with the caller's key.

The ZAP handler (pyzmq's ``ThreadAuthenticator``, one per node context, run by
``rlog.connections.ListenGuard``, which also applies ``[limits] connections_max``) accepts a client key only
if it is one of the public keys in the ``authorized_keys`` directory. The ZAP user id, a property of
every frame, is the client's public key (z85); the node maps it to its principal, the file's name
(``keys/app.key`` -> ``app``), at every frame with the current table. Unknown keys and clients
without CurveZMQ fail the handshake: their bytes never reach the message decoder. The node counts
those handshake failures from the listen socket's monitor (``ListenGuard``).

``reload`` re-reads ``authorized_keys`` and the roles (SIGHUP): the new maps replace the old ones
in one assignment each, so the ZAP thread and the node thread never see half a table. Because the
principal is looked up per frame, not fixed at the handshake, a key removed (or replaced) by a
reload stops working on the connections it already holds too: their frames have no principal and
are refused (``REVOKED``), and so are the frames read before the reload and left for a later turn
(the node re-maps its backlog). State a revoked principal set up before the reload and that needs no
frame of its own to go on (a replicant's watch: its core pushes on its own connection) is ended by
the node at the reload, and a held read is refused when answered (``NodeSecurity.allows``,
``Server.security_reloaded``). A key *replaced* by a new key of the same principal revokes the same
way: ``revoked_at`` keeps the reload that did it, which a check by the principal's name alone, now
the new key's, would miss.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.utils.z85
from mnesite.rlog.errors import REFUSED_FULL, REFUSED_KEY
from mnesite.rlog.roles import ROLES, RoleTable

log = logging.getLogger("mnesite.security")

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
AUTHORIZED_KEYS_MAX = 10_000  # public key files read from authorized_keys
KEY_FILE_BYTES_MAX = 65_536  # a certificate is some 200 bytes; a larger file is not one
DIRECTORIES_ABOVE_MAX = 4096  # directories checked above a key directory: PATH_MAX allows some 2048
# Symbolic links followed for one key path with follow_key_links (a Kubernetes secret volume needs two:
# NAME -> ..data/NAME and ..data -> ..TIMESTAMP); more is a loop or a maze, not a deployment.
KEY_LINK_HOPS_MAX = 8
# How a key file that is a symbolic link is followed, named in the error that refuses it: a node's
# setting, or a client's (``Client(follow_key_links=True)``, ``client_keys``, the CLI).
FOLLOW_LINKS_NODE = "set [security] follow_key_links = true"
FOLLOW_LINKS_CLIENT = "give --follow-key-links (follow_key_links=True)"
# The help of --follow-key-links: every command that talks to a node, and ``mnesite compare`` (spark.cli).
FOLLOW_KEY_LINKS_HELP = (
    "Follow --key and --server-key through symbolic links (a Kubernetes secret volume), checking that each "
    "link is yours or root's and that no directory on the way lets others repoint it or replace the file "
    "($MNESITE_FOLLOW_KEY_LINKS)."
)
# O_PATH: a directory this user may search but not list (/home at 0711) is still opened and checked.
DIRECTORY_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC
# What whoever can write the authorized_keys directory or a key file in it could do.
ADD_A_PRINCIPAL = "add a principal"
Z85_KEY_LENGTH = 40  # a 32-byte CurveZMQ key in z85
Z85_CHARACTERS = frozenset(zmq.utils.z85.Z85CHARS)
ZAP_DOMAIN = "mnesite"
# What a frame whose key a reload took out of authorized_keys is refused with (its connection was
# authenticated before the reload).
REVOKED = "this connection's key is no longer in authorized_keys (reloaded); connect with an authorized key"
# The ZAP status of a connection refused for [limits] connections_max (rlog.connections). 500 (ZAP's
# "internal error") because it is the one status besides 400 after which zmq closes the connection at
# once and tells the client the code: 300 ("temporary") would leave the connection open, holding its
# descriptor, until zmq's handshake interval ends. A key refused is 400, so a client can say which.
REFUSED_STATUS = 500
# The ZAP status of a connection whose key is not in authorized_keys (pyzmq's CURVE check).
KEY_REFUSED_STATUS = 400
# Why a node refused a connection at its handshake (``rlog.errors``), by that status.
REFUSAL_REASONS = {REFUSED_STATUS: REFUSED_FULL, KEY_REFUSED_STATUS: REFUSED_KEY}
HANDSHAKE_FAILURES = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no_detail",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth",
}


class SecurityError(ValueError):
    """A key file or the security configuration is unusable; the message names the file or key."""


@dataclass(frozen=True)
class SecurityConfig:
    """The ``[security]`` section; paths are absolute (resolved against the config file)."""

    insecure: bool = False
    server_key: str | None = None
    client_key: str | None = None
    authorized_keys: str | None = None
    roles: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # Follow a key path that is a symbolic link (a Kubernetes secret volume), checking every link and
    # directory on the way (``_open_key_directory``); off: such a key file is refused.
    follow_key_links: bool = False

    @property
    def enabled(self) -> bool:
        return not self.insecure


@dataclass(frozen=True)
class KeyPair:
    public: bytes
    secret: bytes | None


def generate_keys(name: str, directory: str) -> tuple[str, str]:
    """Write ``DIR/NAME.key`` (public) and ``DIR/NAME.key_secret`` (mode 0600); refuse to overwrite.

    Each file is created exclusively (``O_EXCL``, ``O_NOFOLLOW``): never over an existing file, nor
    through a symbolic link, even one to a file that does not exist yet (in a directory others can
    write, a link placed there would have received the secret key wherever it pointed).
    """
    # 0o755 whatever the umask: the directory may serve as authorized_keys, which others must not write.
    # So must every directory made above it (makedirs gives those 0o777 less the umask: 0o775 under umask
    # 002), or the node refuses the keys below it (_check_directories_above).
    made = []
    path = os.path.abspath(directory)
    while not os.path.lexists(path):
        made.append(path)
        path = os.path.dirname(path)
    os.makedirs(directory, mode=0o755, exist_ok=True)
    for path in made:
        os.chmod(path, 0o755)
    public_path = os.path.join(directory, name + PUBLIC_SUFFIX)
    secret_path = os.path.join(directory, name + SECRET_SUFFIX)
    for path in (public_path, secret_path):
        if os.path.lexists(path):
            raise SecurityError(f"{path} exists already; remove it first to make a new key")
    public, secret = zmq.curve_keypair()
    written: list[str] = []
    try:
        for path, mode, text in (
            (secret_path, 0o600, _certificate("Secret", public, secret)),
            (public_path, 0o644, _certificate("Public", public, None)),
        ):
            _write_exclusive(path, mode, text)
            written.append(path)
    except BaseException:
        for path in written:
            os.unlink(path)  # no half pair left behind
        raise
    return public_path, secret_path


def _certificate(what: str, public: bytes, secret: bytes | None) -> str:
    """A certificate in zmq's format (what ``zmq.auth.load_certificate`` reads)."""
    lines = [f"#   ZeroMQ CURVE {what} Certificate (mnesite keys generate)", "", "metadata", "curve"]
    lines.append(f'    public-key = "{public.decode("ascii")}"')
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode("ascii")}"')
    return "\n".join(lines) + "\n"


def _write_exclusive(path: str, mode: int, text: str) -> None:
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    except FileExistsError:
        raise SecurityError(f"{path} exists already; remove it first to make a new key") from None
    with os.fdopen(descriptor, "w", encoding="ascii") as file:
        os.fchmod(file.fileno(), mode)  # whatever the umask
        file.write(text)


def load_key(
    path: str, what: str, secret: bool, follow_links: bool = False, how_to_follow: str = FOLLOW_LINKS_NODE
) -> KeyPair:
    """Load a zmq certificate file; ``secret`` requires the secret half (a ``.key_secret`` file) in a
    file that is this user's alone (``_check_secret_file``). A public key loaded here is one a client
    pins (the cluster's ``server_key``): whoever can write it could make the client trust their own
    server, so it is checked as an authorized key file is (``_check_others_cannot_write``).

    The directory holding the file is opened once and the file is opened in it, never through a
    symbolic link (``O_NOFOLLOW``) unless ``follow_links`` (``_open_key_directory``: then every link on
    the way is checked). The checks (``fstat``) and the parse are of that one descriptor: the file
    checked is the file whose key is used, whatever is renamed over the path meanwhile. Whoever can
    write that directory, or one above it, could rename another file over the key between two runs:
    they are checked as ``authorized_keys`` is (the directory holding the file is not sticky-allowed).
    ``how_to_follow``: what the refusal of a link says to do to follow it (``FOLLOW_LINKS_CLIENT``).
    """
    directory, directory_path, file_path = _open_key_directory(path, what, follow_links, how_to_follow)
    try:
        text, status = _read_key_file(file_path, what, directory)
        public, secret_key = _parse_certificate(text, file_path, what)
        if secret and not secret_key:
            raise SecurityError(f"{what}: {file_path} has no secret key (give the {SECRET_SUFFIX} file)")
        if secret:
            _check_secret_file(status, file_path, what)
        else:
            _check_others_cannot_write(status, file_path, what, "make clients trust their own server as the cluster")
        _check_directory(directory, directory_path, what, f"put another file in place of {file_path}")
    finally:
        os.close(directory)
    return KeyPair(public, secret_key)


def _open_key_directory(path: str, what: str, follow_links: bool, how_to_follow: str) -> tuple[int, str, str]:
    """The open directory (``O_PATH``) that holds the key file ``path``, its real path and the file's path.

    The directories of ``path`` are followed as ssh's realpath does (the real directories are the
    ones checked, by the caller). A key file that is a symbolic link is refused, unless
    ``follow_links``: then it is resolved one name at a time, relative to open directories, at most
    ``KEY_LINK_HOPS_MAX`` links, and each link met (in its target's directories too: ``..data``) must be
    this user's or root's (its owner could repoint it) in a directory others cannot write, or sticky
    (there no one else can rename it), with every directory above. The path returned names the real
    file when a link was followed, so that the messages name what to fix."""
    absolute = os.path.abspath(path)
    directory_path = os.path.realpath(os.path.dirname(absolute))  # for the messages
    try:
        directory = os.open(os.path.dirname(absolute), DIRECTORY_FLAGS)
    except OSError as error:
        raise SecurityError(f"{what}: cannot open the directory of {path}: {error.strerror}") from None
    pending = [os.path.basename(absolute)]  # names still to resolve, in order
    hops = 0
    entry = path
    try:
        while pending:
            name = pending.pop(0)
            if name == "..":
                parent = os.open("..", DIRECTORY_FLAGS, dir_fd=directory)
                os.close(directory)
                directory, directory_path = parent, os.path.dirname(directory_path)
                continue
            entry = os.path.join(directory_path, name)
            status = os.stat(name, dir_fd=directory, follow_symlinks=False)
            if stat.S_ISLNK(status.st_mode):
                if not follow_links:
                    raise SecurityError(
                        f"{what}: {path} is a symbolic link; give the key file itself (a link can be repointed), "
                        f"or {how_to_follow} to check and follow it"
                    )
                hops += 1
                if hops > KEY_LINK_HOPS_MAX:
                    raise SecurityError(
                        f"{what}: {path} leads through more than {KEY_LINK_HOPS_MAX} symbolic links; "
                        "give the key file itself"
                    )
                _check_owner(status, entry, what, "point it at another file", link=True)
                _check_directory(directory, directory_path, what, f"put another file in place of {entry}", True)
                target = os.readlink(name, dir_fd=directory)
                if target.startswith("/"):
                    root = os.open("/", DIRECTORY_FLAGS)
                    os.close(directory)
                    directory, directory_path = root, "/"
                pending[:0] = [part for part in target.split("/") if part not in ("", ".")]
            elif pending:  # a directory on the way of a link's target
                below = os.open(name, DIRECTORY_FLAGS | os.O_NOFOLLOW, dir_fd=directory)
                os.close(directory)
                directory, directory_path = below, entry
            else:
                return directory, directory_path, entry if hops else path
        raise SecurityError(f"{what}: {path} leads to a directory ({directory_path}), not to a key file")
    except OSError as error:
        os.close(directory)
        raise SecurityError(f"{what}: cannot read {entry}: {error.strerror}") from None
    except BaseException:
        os.close(directory)
        raise


def _read_key_file(path: str, what: str, directory: int) -> tuple[bytes, os.stat_result]:
    """The bytes of the key file ``path`` (its name in the open ``directory``) and the status of the
    file they were read from. ``O_NONBLOCK``: a FIFO placed there must not hang the node."""
    name = os.path.basename(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        descriptor = os.open(name, flags, dir_fd=directory)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.EMLINK):  # what O_NOFOLLOW answers for a link
            raise SecurityError(
                f"{what}: {path} is a symbolic link; give the key file itself (a link can be repointed)"
            ) from None
        raise SecurityError(f"{what}: cannot read {path}: {error.strerror}") from None
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise SecurityError(f"{what}: {path} is not a regular file")
        text = b""
        while len(text) <= KEY_FILE_BYTES_MAX:
            chunk = os.read(descriptor, KEY_FILE_BYTES_MAX + 1 - len(text))
            if not chunk:
                break
            text += chunk
    except OSError as error:
        raise SecurityError(f"{what}: cannot read {path}: {error.strerror}") from None
    finally:
        os.close(descriptor)
    if len(text) > KEY_FILE_BYTES_MAX:
        raise SecurityError(f"{what}: {path} is larger than {KEY_FILE_BYTES_MAX} bytes: not a zmq certificate")
    return text, status


def _parse_certificate(text: bytes, path: str, what: str) -> tuple[bytes, bytes | None]:
    """(public key, secret key or None) from a certificate in zmq's format, read line by line as
    ``zmq.auth.load_certificate`` does; each key must be 40 z85 characters."""
    keys: dict[bytes, bytes] = {}
    for line in text.splitlines():
        line = line.strip()
        for name in (b"public-key", b"secret-key"):
            if line.startswith(name) and name not in keys:
                keys[name] = line.partition(b"=")[2].strip(b" \t'\"")
    if b"public-key" not in keys:
        raise SecurityError(f"{what}: {path} is not a zmq certificate: it has no public-key line")
    for name, key in keys.items():
        if len(key) != Z85_KEY_LENGTH or not set(key) <= Z85_CHARACTERS:
            raise SecurityError(
                f"{what}: {path}: its {name.decode()} is not a CurveZMQ key ({Z85_KEY_LENGTH} z85 characters)"
            )
    return keys[b"public-key"], keys.get(b"secret-key")


def _check_secret_file(status: os.stat_result, path: str, what: str) -> None:
    """Like ssh: a secret others can read, or that another user owns (and so may rewrite or chmod),
    is not this user's secret; say how to fix it rather than use it."""
    if status.st_uid != os.geteuid():
        raise SecurityError(
            f"{what}: {path} is owned by uid {status.st_uid}, not by this user (uid {os.geteuid()}); "
            f"chown it to the user that runs mnesite, then chmod 600 {path}"
        )
    if status.st_mode & 0o077:
        raise SecurityError(f"{what}: {path} is readable by other users; chmod 600 {path}")


def _check_others_cannot_write(
    status: os.stat_result, path: str, what: str, power: str, sticky_allowed: bool = False
) -> None:
    """ssh's StrictModes: a file (or directory) whose owner or writers could ``power`` must be this
    user's (or root's) and writable by no one else. ``sticky_allowed``: a directory above the one that
    matters may be writable by others if it is sticky (/tmp): there only an entry's owner, the
    directory's owner or root can rename or remove an entry, and the entry below is checked in turn."""
    _check_owner(status, path, what, power)
    if status.st_mode & 0o022 and not (sticky_allowed and status.st_mode & stat.S_ISVTX):
        raise SecurityError(f"{what}: {path} is writable by other users, who could {power}; chmod go-w {path}")


def _check_owner(status: os.stat_result, path: str, what: str, power: str, link: bool = False) -> None:
    """The file, directory or symbolic ``link`` at ``path`` is this user's or root's: its owner could ``power``."""
    if status.st_uid not in (os.geteuid(), 0):
        kind, chown = (" a symbolic link", "chown -h") if link else ("", "chown")
        raise SecurityError(
            f"{what}: {path} is{kind} owned by uid {status.st_uid}, not by this user (uid {os.geteuid()}) "
            f"or root: its owner could {power}; {chown} it to the user that runs mnesite"
        )


def _check_directory(descriptor: int, directory: str, what: str, power: str, sticky_allowed: bool = False) -> None:
    """The open ``directory`` (whose writers could ``power``) and every directory above it."""
    try:
        status = os.fstat(descriptor)
    except OSError as error:
        raise SecurityError(f"{what}: cannot check {directory}: {error.strerror}") from None
    _check_others_cannot_write(status, directory, what, power, sticky_allowed)
    _check_directories_above(descriptor, directory, what)


def _check_directories_above(descriptor: int, directory: str, what: str) -> None:
    """Every directory above the open ``directory`` up to /, found by ``..`` from its descriptor (the
    directory checked is the one opened, a symbolic link on the way resolved, as ssh's realpath does):
    whoever can write one could put another directory in place of ``directory``."""
    path = os.path.realpath(directory)  # for the messages: the names of the directories walked
    current = descriptor
    try:
        status = os.fstat(descriptor)
        for _ in range(DIRECTORIES_ABOVE_MAX):
            parent = os.open("..", DIRECTORY_FLAGS, dir_fd=current)
            if current != descriptor:
                os.close(current)
            current = parent
            parent_status = os.fstat(parent)
            if (parent_status.st_dev, parent_status.st_ino) == (status.st_dev, status.st_ino):
                return  # / is its own parent
            path = os.path.dirname(path)
            _check_others_cannot_write(
                parent_status, path, what, f"put another directory in place of {directory}", True
            )
            status = parent_status
        raise SecurityError(f"{what}: {directory} is more than {DIRECTORIES_ABOVE_MAX} directories deep")
    except OSError as error:
        raise SecurityError(f"{what}: cannot check the directories above {directory}: {error.strerror}") from None
    finally:
        if current != descriptor:
            os.close(current)


def load_authorized_keys(directory: str) -> dict[bytes, str]:
    """z85 public key -> principal name, from every ``NAME.key`` file in ``directory``.

    The directory is opened once and every check and read goes through it (``dir_fd``): the
    directory listed is the one checked, and each key file is checked on the descriptor it is read
    from (``_check_others_cannot_write``); so is every directory above it (``_check_directories_above``).
    """
    try:
        descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as error:
        raise SecurityError(f"authorized_keys: cannot list {directory}: {error.strerror}") from None
    try:
        _check_others_cannot_write(os.fstat(descriptor), directory, "authorized_keys", ADD_A_PRINCIPAL)
        try:
            names = sorted(n for n in os.listdir(descriptor) if n.endswith(PUBLIC_SUFFIX))
        except OSError as error:
            raise SecurityError(f"authorized_keys: cannot list {directory}: {error.strerror}") from None
        if len(names) > AUTHORIZED_KEYS_MAX:
            raise SecurityError(f"authorized_keys: {directory} holds more than {AUTHORIZED_KEYS_MAX} keys")
        keys: dict[bytes, str] = {}
        for file_name in names:
            path = os.path.join(directory, file_name)
            principal = file_name[: -len(PUBLIC_SUFFIX)]
            if not principal:
                # "" is what ``principal_of`` answers for a frame with no known key: never a real principal.
                raise SecurityError(f"authorized_keys: {path} names no principal; rename it NAME{PUBLIC_SUFFIX}")
            text, status = _read_key_file(path, "authorized_keys", descriptor)
            _check_others_cannot_write(status, path, "authorized_keys", ADD_A_PRINCIPAL)
            public, _secret = _parse_certificate(text, path, "authorized_keys")
            if public in keys:
                raise SecurityError(f"authorized_keys: {file_name} repeats the key of {keys[public]}")
            keys[public] = principal
        # After the files: the result is all or nothing, and a file's own error is the more useful one.
        _check_directories_above(descriptor, directory, "authorized_keys")
        return keys
    finally:
        os.close(descriptor)


def check_roles(roles: object) -> dict[str, tuple[str, ...]]:
    """Validate ``[security.roles]``: role -> list of principal names."""
    if not isinstance(roles, dict):
        raise SecurityError("[security.roles] must be a table of role = [principal, ...]")
    checked: dict[str, tuple[str, ...]] = {}
    for role, names in roles.items():
        if role not in ROLES:
            raise SecurityError(f"unknown role [security.roles].{role} (known: {', '.join(ROLES)})")
        if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
            raise SecurityError(f"[security.roles].{role} must be a list of principal names")
        checked[role] = tuple(names)
    return checked


def configure_server(socket: zmq.Socket, server: KeyPair) -> None:
    socket.curve_server = True
    socket.curve_secretkey = server.secret
    socket.curve_publickey = server.public
    socket.zap_domain = ZAP_DOMAIN.encode()


def configure_client(socket: zmq.Socket, own: KeyPair, server_public: bytes) -> None:
    socket.curve_secretkey = own.secret
    socket.curve_publickey = own.public
    socket.curve_serverkey = server_public


class _KeyCheck:
    def __init__(self, security: NodeSecurity) -> None:
        self.security = security

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.security.authorized:
            return True
        self.security.refused_unknown_key += 1
        return False


class NodeSecurity:
    """A node's keys, authorized keys and roles, its ZAP handler and refusal counters."""

    def __init__(self, config: SecurityConfig) -> None:
        if config.server_key is None or config.client_key is None or config.authorized_keys is None:
            raise SecurityError("[security] needs server_key, client_key and authorized_keys (or insecure = true)")
        follow = config.follow_key_links
        self.server = load_key(config.server_key, "[security].server_key", secret=True, follow_links=follow)
        self.client = load_key(config.client_key, "[security].client_key", secret=True, follow_links=follow)
        self.authorized = load_authorized_keys(config.authorized_keys)
        self.roles = RoleTable(config.roles)
        _warn_roles_without_keys(self.roles, self.authorized)
        self.refused_unknown_key = 0
        self.handshakes_failed: dict[str, int] = {reason: 0 for reason in HANDSHAKE_FAILURES.values()}
        self.refused_role = 0
        self.refused_sender = 0
        self.reloads = 0
        # Principal -> the reload that last removed or replaced its key (``reload``, ``allows``).
        self.revoked_at: dict[str, int] = {}

    def key_check(self) -> _KeyCheck:
        """The CURVE key check of the node's ZAP handler (``rlog.connections.ListenGuard``)."""
        return _KeyCheck(self)

    def secure_server(self, socket: zmq.Socket) -> None:
        configure_server(socket, self.server)

    def secure_client(self, socket: zmq.Socket) -> None:
        configure_client(socket, self.client, self.server.public)

    def handshake_failed(self, reason: str) -> None:
        """Count a failed handshake on the listen socket (its monitor's thread: ``ListenGuard``)."""
        self.handshakes_failed[reason] += 1

    def reload(self, config: SecurityConfig) -> None:
        """SIGHUP: new authorized keys and roles; a bad file keeps the old ones (and raises)."""
        if config.authorized_keys is None:
            raise SecurityError("[security].authorized_keys is missing")
        authorized = load_authorized_keys(config.authorized_keys)
        roles = RoleTable(config.roles)
        previous = self.authorized
        self.authorized, self.roles = authorized, roles
        self.reloads += 1
        # A principal whose key this reload removed, replaced (a rotated key of the same name) or gave
        # another name: what its old key sent or set up before is no longer allowed by the name alone,
        # which a new key of that principal may hold now (``allows``' ``since``).
        for key, name in previous.items():
            if authorized.get(key) != name:
                self.revoked_at[name] = self.reloads
        _warn_roles_without_keys(roles, authorized)

    def revoked_by_last_reload(self) -> frozenset[str]:
        """The principals whose key the last reload removed or replaced (none before a reload)."""
        return frozenset(name for name, at in self.revoked_at.items() if at == self.reloads and at > 0)

    def allows(self, principal: str, kind: str, since: int | None = None) -> bool:
        """Whether ``principal`` may send ``kind`` now: it has a key in the current authorized_keys and
        a role that allows the kind. What a reload asks of the senders of standing state (a watch's
        agents) and of held requests, which no new frame of theirs re-checks. ``since``: the reload
        count when the request was received or the state set up; a reload after it that removed or
        replaced the principal's key refuses it, even though a new key may hold the name now."""
        if since is not None and self.revoked_at.get(principal, 0) > since:
            return False
        return principal in self.authorized.values() and self.roles.refusal(principal, kind) is None

    def principal_of(self, frame: zmq.Frame) -> str:
        """The principal of ``frame``'s authenticated key (its ZAP user id) in the current
        ``authorized_keys``; "" if there is none (no key, or a key a reload removed)."""
        try:
            user_id = frame.get("User-Id")
        except zmq.ZMQError:
            return ""
        return self.authorized.get(user_id.encode("ascii", "replace"), "") if user_id else ""

    def status(self) -> dict[str, object]:
        return {
            "curve": True,
            "refused_unknown_key": self.refused_unknown_key,
            "handshakes_failed": dict(self.handshakes_failed),
            "refused_role": self.refused_role,
            "refused_sender": self.refused_sender,
            "authorized_keys": len(self.authorized),
            "reloads": self.reloads,
        }


def _warn_roles_without_keys(roles: RoleTable, authorized: Mapping[bytes, str]) -> None:
    """One line at start and at each reload when a role names a principal with no key (a typo is
    otherwise silent until that principal is refused)."""
    missing = roles.without_keys(authorized.values())
    if missing:
        log.warning(
            "[security.roles] names principals with no key in authorized_keys (a typo?): %s", ", ".join(missing)
        )


def client_keys(
    key_path: str | Path | None, server_key_path: str | Path | None, follow_links: bool = False
) -> tuple[KeyPair, bytes] | None:
    """The caller's key pair and the cluster's public key for a ``Client``; None without keys.
    ``follow_links``: key files that are symbolic links are followed, checked (``load_key``)."""
    if key_path is None and server_key_path is None:
        return None
    if key_path is None or server_key_path is None:
        raise SecurityError("give both key (the caller's .key_secret file) and server_key (the cluster's .key file)")
    own = load_key(str(key_path), "key", True, follow_links, FOLLOW_LINKS_CLIENT)
    server = load_key(str(server_key_path), "server_key", False, follow_links, FOLLOW_LINKS_CLIENT)
    return own, server.public
