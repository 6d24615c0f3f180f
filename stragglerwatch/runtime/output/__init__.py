"""Where the records go: the step log thread (``writer``) and the Prometheus exporter (``exporter``).
"""
