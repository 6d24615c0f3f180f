"""The dashboard as a service: ``gunicorn -c dashboard/gunicorn.conf.py dashboard.app:server``.

Configured by the environment (``STRAGGLERWATCH_SOURCE``: a run dir, a directory of run dirs, or
``http://PROMETHEUS:9090/?run=RUN_ID``; see the README, "As a service (gunicorn)"). The code is the
package's (``stragglerwatch.presentation.dashboard.service``); no thread starts here: each worker starts the
sources its requests need, after gunicorn has forked it.
"""

from stragglerwatch.presentation.dashboard.service import server_from_env

server = server_from_env()
