"""Evidence when the job is torn down: the SIGTERM handler (torchrun's teardown) and the
uncaught-exception hook (:class:`ShutdownHooks`) record what the rank was doing, through the watchdog.

An application's own handler, installed before attach (we chain to it) or after (it replaced ours),
always runs to completion; a process forked from the trainer passes the signal straight on. Only when
nobody else handles SIGTERM and the main thread still has not handled it after ``exit_grace_s`` does
the watchdog end the process, as the default action would have.

The hang policy (``hangabort.py``) ends a rank through the same handler: :meth:`ShutdownHooks.terminate`
sends this process SIGTERM, and ours, seeing the watchdog ``aborting``, records nothing more (the
action is recorded), runs the application's handler it chained to, and exits with
``HANG_EXIT_STATUS`` (a status of 0 from that handler becomes it; another is kept). A victim whose
collective fails (a culprit left) before its policy acted leaves the same way from the exception hook,
the application's handler run there, once in all.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from stragglerwatch.runtime.actions.hangabort import HANG_EXIT_STATUS, TORN_DOWN

if TYPE_CHECKING:  # the watchdog owns its hooks
    from stragglerwatch.runtime.hangs.watchdog import Watchdog



class ShutdownHooks:
    """SIGTERM handler (main thread only), wakeup fd for the watchdog, uncaught-exception hook.

    Only this process's signals count: the handler and the wakeup pipe are inherited by a forked
    child (a DataLoader worker, a fork ``Pool``), where :meth:`forked` puts back what was there
    before us; a signal the handler sees in another process than ours passes straight on. After
    :meth:`remove` the handler, if it could not be taken off (``close()`` off the main thread, or
    somebody chained to it since), is a plain pass-through to what came before it."""

    def __init__(self, watchdog: Watchdog):
        self.watchdog = watchdog
        self._pid = os.getpid()
        self._prev_handler: Any = None
        self._prev_excepthook = sys.excepthook
        self._pipe: tuple[int, int] | None = None
        self._prev_wakeup = -1
        self._active = True  # False after remove(): the handler only passes the signal on
        self._handled = False  # the application's handler ran for the hang policy: not again
        self._handling = False  # and it runs now: a SIGTERM meanwhile does not interrupt it
        sys.excepthook = self._excepthook
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            self._prev_handler = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._on_sigterm)
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            self._prev_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            if self._prev_wakeup != -1:  # somebody (asyncio?) uses it: leave it to them
                signal.set_wakeup_fd(self._prev_wakeup)
                os.close(r)
                os.close(w)
            else:
                self._pipe = (r, w)
                watchdog._wakeup = r
                watchdog.exits_by_default = self._exits_by_default
        except (ValueError, OSError):
            pass

    def _ours(self) -> bool:
        return self._active and os.getpid() == self._pid

    def _exits_by_default(self) -> bool:
        """True while ours is the SIGTERM handler and there was none before it: then the default
        action (ending the process) is what SIGTERM means. A handler of the application's,
        installed before attach (we chain to it) or after (it replaced ours), is never overridden."""
        try:
            ours = signal.getsignal(signal.SIGTERM) == self._on_sigterm
            return ours and self._ours() and self._prev_handler in (signal.SIG_DFL, None)
        except Exception:
            return False

    def _excepthook(self, exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        if not self._ours() or issubclass(exc_type, KeyboardInterrupt):
            self._prev_excepthook(exc_type, exc, tb)
            return
        reason = f"{exc_type.__name__}: {exc}"[:500]
        policy = self.watchdog.collective_failed(reason) if issubclass(exc_type, Exception) else None
        if policy is None:
            self.watchdog.on_terminate(reason)
        self._prev_excepthook(exc_type, exc, tb)
        if policy is None:
            return
        what, seconds = policy
        if what == "claimed":  # the hang policy ends this rank here: the application's handler, then its status
            raise SystemExit(self._application_handler(self._their_handler(), None))
        # the policy's thread is ending this rank: its SIGTERM runs the handler here (where Python still runs),
        # raising SystemExit out of this hook; or the exit at the bound comes first
        time.sleep(seconds)

    def _their_handler(self) -> Any:
        """The application's SIGTERM handler: the one that replaced ours, or the one ours chained to."""
        try:
            current = signal.getsignal(signal.SIGTERM)
        except Exception:
            return self._prev_handler
        return self._prev_handler if current == self._on_sigterm else current

    def _application_handler(self, handler: Any, frame: Any) -> Any:
        """Run ``handler`` (the application's SIGTERM handler) for the hang policy, once in all; the exit
        status: that of its ``sys.exit`` where not 0 (or None), else ``HANG_EXIT_STATUS``."""
        if self._handled or not callable(handler):
            return HANG_EXIT_STATUS
        self._handled = self._handling = True
        try:
            handler(signal.SIGTERM, frame)
        except SystemExit as exc:
            return exc.code if exc.code not in (0, None) else HANG_EXIT_STATUS
        finally:
            self._handling = False
        return HANG_EXIT_STATUS

    def terminate(self) -> str:
        """For the hang policy (from the watchdog thread): send this process SIGTERM where a Python
        handler will run it on the main thread; which handler, or why none. Where the application's
        own replaced ours, the process is also told to end with ``HANG_EXIT_STATUS`` at exit."""
        try:
            current = signal.getsignal(signal.SIGTERM)
        except Exception as exc:
            return f"none ({type(exc).__name__})"
        if current == self._on_sigterm and self._ours():
            which = "ours, then the application's" if callable(self._prev_handler) else "ours"
        elif callable(current):
            which = "the application's"
            self.watchdog.exit_status = HANG_EXIT_STATUS
        else:
            return "none (no Python handler is installed)"
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except OSError as exc:
            return f"none ({exc})"
        return which

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        prev = self._prev_handler
        # the hang policy is ending this rank, or ends it now (a victim sent SIGTERM in its stall)
        if self._ours() and (self.watchdog.aborting or self.watchdog.collective_failed(TORN_DOWN) is not None):
            if self._handling:  # another SIGTERM (torchrun's teardown, as a peer left) while it runs: it finishes
                return
            raise SystemExit(self._application_handler(prev, frame))
        if self._ours():
            self.watchdog.on_terminate("SIGTERM")
        if callable(prev):
            prev(signum, frame)
        elif prev != signal.SIG_IGN:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def _restore(self) -> None:
        """Put back what was there before us where it is still ours (main thread only)."""
        if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._prev_handler if self._prev_handler is not None else signal.SIG_DFL)
        if self._pipe is not None:
            current = signal.set_wakeup_fd(-1)
            if current != self._pipe[1]:  # somebody set their own since: theirs stays
                signal.set_wakeup_fd(current)
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None

    def forked(self) -> None:
        """In a forked child, before any of its own code: everything back to what it was before us."""
        self._active = False
        self.watchdog._wakeup = None
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._prev_excepthook
        try:
            self._restore()
        except (ValueError, OSError):
            pass

    def remove(self) -> None:
        self._active = False
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._prev_excepthook
        if threading.current_thread() is not threading.main_thread():
            return  # signals can be changed on the main thread only: ours stays, as a pass-through
        try:
            self._restore()
            self.watchdog._wakeup = None
        except (ValueError, OSError):
            pass
