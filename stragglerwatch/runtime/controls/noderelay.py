"""One rank per host looks at the run dir's control file: the relay, elected with a node-local lock.

Design: every rank ``stat``ing the shared ``control.json`` once per ``control_interval_s`` is, at a few
thousand ranks, thousands of metadata operations a second on the shared file system, for a feature that
is idle nearly always. So the ranks of one host share a node-local directory, keyed by the run dir and
the run id (``$STRAGGLERWATCH_NODE_DIR``, else ``/dev/shm``, else the temporary directory; one per user,
mode 0700). The rank that holds an exclusive ``flock`` on its ``relay.lock`` is the host's relay: it
looks at the shared file and, when it changes, copies it there; the other ranks look at the copy (a
``stat`` of a local file system, not a shared-file-system operation). The kernel releases the lock
when the relay closes or dies, and the next rank to look takes over. The election needs no host name,
no ``LOCAL_RANK`` and no collective; ranks that do not share the directory (a container each) are each
their own relay, as before. Every member holds a shared ``flock`` on ``members.lock``; the last one to
leave removes the directory. A forked child (a DataLoader worker) lets go of its copies of the locks'
descriptors without releasing the parent's locks.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
import threading
import time
import weakref
from pathlib import Path

#: A node-local directory for the relay's files, in place of ``/dev/shm`` (ranks given different ones
#: never share a relay).
NODE_DIR_ENV = "STRAGGLERWATCH_NODE_DIR"
COPY_FILE = "control.json"
_JOIN_TRIES = 50  # while a leaving rank removes the directory: at most about half a second


def node_base() -> Path:
    """Where the ranks of this host meet: ``$STRAGGLERWATCH_NODE_DIR``, else ``/dev/shm`` (tmpfs), else the
    temporary directory."""
    given = os.environ.get(NODE_DIR_ENV)
    if given:
        return Path(given)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return Path(tempfile.gettempdir())


def _own_dir(path: Path) -> None:
    """Make ``path`` (mode 0700) or check that it is a directory of this user's, not a link."""
    path.mkdir(mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise OSError(f"{path} is not a directory of this user's")


class NodeRelay:
    """This rank's place in its host's relay group for one run. Raises ``OSError`` or ``ImportError``
    (no ``fcntl``) when it cannot join; the caller then looks at the shared file itself."""

    def __init__(self, run_dir: Path, run_id: str, base: Path | None = None):
        import fcntl

        self._fcntl = fcntl
        base = base or node_base()
        base.mkdir(parents=True, exist_ok=True)
        user = base / f"stragglerwatch-{os.getuid()}"
        _own_dir(user)
        key = hashlib.sha1(f"{Path(run_dir).resolve()}|{run_id}".encode()).hexdigest()[:16]
        self.dir = user / key
        self.copy = self.dir / COPY_FILE
        self.leader = False
        self._relay_fd: int | None = None
        self._forked = False
        self._member_fd: int | None = self._join()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _forked(ref))

    def _join(self) -> int:
        members = self.dir / "members.lock"
        for _ in range(_JOIN_TRIES):
            _own_dir(self.dir)
            try:
                fd = os.open(members, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except FileNotFoundError:  # a leaving rank removed the directory just now
                continue
            try:
                self._fcntl.flock(fd, self._fcntl.LOCK_SH | self._fcntl.LOCK_NB)
                same = os.fstat(fd).st_ino == os.stat(members).st_ino  # not the file a leaving rank removed
            except (BlockingIOError, FileNotFoundError):
                same = False
            if same:
                return fd
            os.close(fd)
            time.sleep(0.01)
        raise OSError(f"{self.dir} was being removed for {_JOIN_TRIES} tries")

    def lead(self) -> bool:
        """Become the host's relay if no rank is (never blocks); whether this rank is it."""
        if self.leader or self._forked:
            return self.leader
        if self._relay_fd is None:
            self._relay_fd = os.open(self.dir / "relay.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            self._fcntl.flock(self._relay_fd, self._fcntl.LOCK_EX | self._fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self.leader = True
        return True

    def publish(self, data: bytes) -> None:
        """Put a new copy of the control file where the host's other ranks look (atomically)."""
        tmp = self.dir / f".{COPY_FILE}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.copy)

    def leave(self) -> None:
        """Let another rank be the relay; the last member removes the directory."""
        fcntl, relay, member = self._fcntl, self._relay_fd, self._member_fd
        self._relay_fd = self._member_fd = None
        self.leader = False
        if self._forked:
            return
        if relay is not None:
            fcntl.flock(relay, fcntl.LOCK_UN)  # explicitly: a forked child's copy must not keep it
            os.close(relay)
        if member is None:
            return
        try:
            fcntl.flock(member, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the last one here?
        except BlockingIOError:
            fcntl.flock(member, fcntl.LOCK_UN)
            os.close(member)
            return
        try:  # removed while locked: a rank that opened the old file sees it is gone and makes a new one
            for name in (COPY_FILE, "relay.lock", "members.lock"):
                (self.dir / name).unlink(missing_ok=True)
            self.dir.rmdir()
        except OSError:
            pass  # a rank arrived meanwhile, or a stray file: the directory stays
        finally:
            fcntl.flock(member, fcntl.LOCK_UN)
            os.close(member)


def _forked(ref: weakref.ReferenceType[NodeRelay]) -> None:
    """In a forked child: point its copies of the descriptors at /dev/null, which drops them without
    releasing the parent's locks (an ``flock`` belongs to the open file, which the parent still holds)."""
    relay = ref()
    if relay is None:
        return
    relay._forked = True
    fds = [fd for fd in (relay._relay_fd, relay._member_fd) if fd is not None]
    if not fds:
        return
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        try:
            for fd in fds:
                os.dup2(devnull, fd)
        finally:
            os.close(devnull)
    except OSError:
        pass
