"""gunicorn's settings for the dashboard service, from the environment (see the README, "As a service
(gunicorn)"): ``STRAGGLERWATCH_HOST`` (default 127.0.0.1: loopback only), ``STRAGGLERWATCH_PORT`` (8050),
``STRAGGLERWATCH_WORKERS`` (1) and ``STRAGGLERWATCH_THREADS`` (8).

With or without ``--preload`` the sources' threads start in the workers (at the first request that
needs them), never in the master: a thread does not survive a fork.
"""

import sys

from stragglerwatch.presentation.dashboard.service import ConfigError, ServiceConfig

try:
    _config = ServiceConfig.from_env()
except ConfigError as exc:
    sys.exit(f"stragglerwatch: error: {exc}")

bind = [_config.bind]
workers = _config.workers
worker_class = "gthread"  # threads: a page's callbacks wait on nothing but a snapshot in memory
threads = _config.threads
timeout = 120  # a worker silent this long is restarted
graceful_timeout = 10
keepalive = 5
limit_request_line = 8190
limit_request_fields = 100
proc_name = "stragglerwatch-dashboard"
control_socket_disable = True  # gunicorn >= 25.1 would open a control socket in $HOME: nothing to change at runtime
